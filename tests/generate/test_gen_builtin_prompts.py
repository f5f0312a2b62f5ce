"""The shipped prompt sets: valid, varied, disjoint, and reproduced exactly by their script."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

from dflash.generate.prompts import load_prompts


def text_of(record):
    return record.messages[-1]["content"]


def test_builtin_sets_are_valid_varied_and_disjoint(repo_root):
    train = load_prompts(repo_root / "dflash/prompts/builtin_prompts.jsonl")
    heldout = load_prompts(repo_root / "dflash/prompts/heldout_prompts.jsonl")
    assert len(train) == 300 and len(heldout) == 40
    families = Counter(record.id.rsplit("-", 1)[1] for record in train)
    assert set(families) == {"math", "word", "code", "rewrite", "list", "define", "tool"}
    assert min(families.values()) >= 20
    assert all(record.tools for record in train if record.id.endswith("-tool"))
    assert len({text_of(r) for r in train}) == len(train)
    assert not {text_of(r) for r in train} & {text_of(r) for r in heldout}


def test_script_reproduces_the_shipped_files(repo_root, tmp_path):
    script = repo_root / "dflash/prompts/make_prompts.py"
    subprocess.run([sys.executable, str(script), "--out-dir", str(tmp_path)], check=True, capture_output=True)
    for name in ("builtin_prompts.jsonl", "heldout_prompts.jsonl"):
        assert (tmp_path / name).read_bytes() == (repo_root / "dflash/prompts" / name).read_bytes()


def test_everyday_set_is_written_apart_from_the_training_templates(repo_root):
    """dflash/prompts/everyday_prompts.jsonl: 40 everyday prompts written by hand, not by
    make_prompts.py (for `launcher.py eval --prompts ...`); none of them is a training prompt."""
    train = load_prompts(repo_root / "dflash/prompts/builtin_prompts.jsonl")
    everyday = load_prompts(repo_root / "dflash/prompts/everyday_prompts.jsonl")
    assert len(everyday) == 40 and len({record.id for record in everyday}) == 40
    assert all(record.id.startswith("everyday-") for record in everyday)     # not make_prompts.py's ids
    assert not {text_of(r) for r in everyday} & {text_of(r) for r in train}
