"""Helpers for the safety tests (issue table "nothing the user has is lost"): the CLI run in
process, a profile for tokenize, and a digest of every file under a path to prove nothing changed."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_cache_for_every_test(private_cache: Path) -> Path:
    """Crash reports and baselines go to a per-test cache, not the user's."""
    return private_cache


def tree_digest(path: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `path` (or of `path` itself, a file)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)) if p != path else p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def write_tokenize_profile(path: Path, tokenizer_dir: Path, run_dir: Path, **data: object) -> Path:
    """A profile extending cpu-demo with the real Qwen3 tokenizer and a run dir under tmp."""
    settings = {"max_degenerate_share": 1.0, "min_loss_tokens": 1, **data}
    lines = ['extends = "cpu-demo"', "[model]", f'tokenizer = "{tokenizer_dir}"', "[paths]", f'run_dir = "{run_dir}"',
             "[data]", *(f"{key} = {value!r}" for key, value in settings.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def completions(path: Path, count: int, start: int = 0) -> Path:
    import json

    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                             {"role": "assistant", "reasoning_content": "Adding.",
                                              "content": f"It is {2 * i}."}]}
               for i in range(start, start + count)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path
