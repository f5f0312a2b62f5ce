"""The shipped prompt sets: valid, varied, disjoint, and reproduced exactly by their script.

Training (`builtin_prompts.jsonl`) and in-distribution held-out (`indist_prompts.jsonl`) come from
the hand-written bank; the default eval set (`everyday_prompts.jsonl`) is written apart from it.
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest

from dflash.eval.options import DEFAULT_EVAL_PROMPTS, INDIST_EVAL_PROMPTS
from dflash.generate.prompt_files import load_prompts

CATEGORIES = {"explain", "howto", "math", "code", "writing", "creative", "edit", "translate", "multilingual",
              "compare", "list", "facts", "food", "plan", "classify", "chat", "tool"}


def user_texts(record) -> list[str]:
    return [m["content"] for m in record.messages if m["role"] == "user"]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


@pytest.fixture(scope="module")
def sets(repo_root):
    return (load_prompts(repo_root / "dflash/prompts/builtin_prompts.jsonl"), load_prompts(INDIST_EVAL_PROMPTS),
            load_prompts(DEFAULT_EVAL_PROMPTS))


def test_training_prompts_cover_many_kinds_languages_and_turns(sets):
    train, _, _ = sets
    categories = Counter(record.id.rsplit("-", 1)[1] for record in train)
    assert set(categories) == CATEGORIES and min(categories.values()) >= 7
    assert len(train) >= 250 and len({tuple(user_texts(r)) for r in train}) == len(train)
    assert sum(len(r.messages) >= 3 and r.messages[-2]["role"] == "assistant" for r in train) >= 15
    assert all(record.tools for record in train if record.id.endswith("-tool"))
    assert sum(r.messages[0]["role"] == "system" for r in train) >= 50
    non_ascii = [r for r in train if r.id.endswith("-multilingual") and not user_texts(r)[-1].isascii()]
    assert len(non_ascii) >= 10
    lengths = sorted(len(words(" ".join(user_texts(r)))) for r in train)
    assert lengths[0] <= 6 and lengths[-1] >= 30


def test_first_prompts_mix_every_category(sets):
    """generate.max_prompts takes the first N: any N >= the number of categories covers them all."""
    train, _, _ = sets
    assert {r.id.rsplit("-", 1)[1] for r in train[:len(CATEGORIES)]} == CATEGORIES


def test_in_distribution_set_is_disjoint_from_training(sets):
    train, indist, _ = sets
    assert len(indist) >= 20
    seen = {text for r in train for text in user_texts(r)}
    assert not any(user_texts(r)[-1] in seen or any(user_texts(r)[-1] in t for t in seen) for r in indist)


def test_everyday_set_shares_no_prompt_or_phrase_with_the_bank(sets):
    """No shared prompt, and no run of five words in common with any training or in-distribution prompt."""
    train, indist, everyday = sets
    assert len(everyday) == 40 and all(r.id.startswith("everyday-") for r in everyday)
    bank = set().union(*(shingles(text) for r in train + indist for text in user_texts(r)))
    shared = {r.id: shingles(text) & bank for r in everyday for text in user_texts(r) if shingles(text) & bank}
    assert shared == {}
    kinds = {r.id.split("-", 2)[2] for r in everyday[:16]}
    assert {"word-problem", "code", "explain", "translate", "email", "recipe", "haiku", "chat"} <= kinds


def test_script_reproduces_the_shipped_files(repo_root, tmp_path):
    script = repo_root / "dflash/prompts/make_prompts.py"
    subprocess.run([sys.executable, str(script), "--out-dir", str(tmp_path)], check=True, capture_output=True)
    for name in ("builtin_prompts.jsonl", "indist_prompts.jsonl"):
        assert (tmp_path / name).read_bytes() == (repo_root / "dflash/prompts" / name).read_bytes()

