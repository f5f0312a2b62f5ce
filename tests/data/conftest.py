"""Helpers for the data tests: profiles pointing at a tokenizer, completions files, synthetic datasets."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest


def make_profile(tokenizer_dir: Path, run_dir: Path, **data: Any):
    """The cpu-demo profile with another tokenizer, its run dir under tmp, and data overrides."""
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    return dataclasses.replace(
        profile,
        model=dataclasses.replace(profile.model, tokenizer=str(tokenizer_dir)),
        paths=dataclasses.replace(profile.paths, run_dir=str(run_dir), completions=str(run_dir / "completions.jsonl"),
                                  dataset=str(run_dir / "dataset")),
        data=dataclasses.replace(profile.data, **data),
    )


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """Records (dicts, or raw strings written as they are) one per line."""
    lines = [record if isinstance(record, str) else json.dumps(record) for record in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def turn(user: str, reasoning: str | None, answer: str) -> list[dict[str, Any]]:
    assistant: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [{"role": "user", "content": user}, assistant]


def build_dataset(directory: Path, ids: list[str], seed: int = 0, tokens: int = 64,
                  fingerprint: str = "tok-A", shard_rows: int = 50, batch_rows: int = 25) -> Path:
    """A tokenized-dataset directory with random token rows (for merge tests; no tokenizer needed)."""
    from dflash.data import dataset_io
    from dflash.data.samples import TokenizedSample, samples_to_batch
    from launcher_core.fileio import atomic_directory

    rng = np.random.default_rng(seed)
    samples = []
    for record_id in ids:
        length = int(rng.integers(tokens // 2, tokens + 1))
        mask = (rng.random(length) < 0.5).astype(np.uint8)
        samples.append(TokenizedSample(record_id, record_id, rng.integers(0, 150000, length, dtype=np.int32),
                                       mask, 0, "stop", 0, False))
    with atomic_directory(directory) as staging:
        writer = dataset_io.ShardWriter(staging, dataset_io.dataset_schema(), shard_rows)
        for start in range(0, len(samples), batch_rows):
            writer.write(samples_to_batch(samples[start: start + batch_rows]))
        meta = {"tokenizer": {"fingerprint": fingerprint, "chat_template_fingerprint": "tpl-A", "path": "synthetic"},
                "max_length": 8192, "settings": {"min_loss_tokens": 4, "tool_call_repeat_limit": 8},
                "sources": [{"path": f"synthetic-{seed}"}], "rejects": {"total": 0, "by_reason": {}}, "history": []}
        dataset_io.finalize_dataset(staging, writer.close(), dataset_io.dataset_schema(), meta)
    return directory


def directory_digest(path: Path) -> dict[str, str]:
    """File name -> sha256 of every file in a directory."""
    from dflash.data.dataset_io import file_sha256

    return {p.name: file_sha256(p) for p in sorted(Path(path).iterdir()) if p.is_file()}


@pytest.fixture
def dataset_factory(tmp_path: Path) -> Callable[..., Path]:
    def factory(name: str, ids: list[str], **kwargs: Any) -> Path:
        return build_dataset(tmp_path / name, ids, **kwargs)

    return factory
