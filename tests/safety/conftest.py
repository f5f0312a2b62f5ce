"""Helpers for the safety tests (issue table "nothing the user has is lost"): the CLI run in
process, a profile for tokenize, and a digest of every file under a path to prove nothing changed."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.generate.gen_helpers import served_tiny_model  # noqa: F401  (a fixture: a real `transformers serve`)


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


@pytest.fixture
def small_fs(tmp_path):
    """mount(name, size) -> a directory on a real tmpfs of `size` bytes (a full disk without
    tricks: `mount -t tmpfs`, which needs root; skipped, with the reason, where it cannot be done).
    Unmounted after the test."""
    import subprocess

    mounted: list[Path] = []

    def mount(name: str, size: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"a small tmpfs cannot be mounted here (mount -t tmpfs needs root): {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, leave: int) -> Path:
    """Fill the filesystem of `directory` until about `leave` bytes are free (a filler file)."""
    import shutil

    filler = directory / "filler.bin"
    with filler.open("wb") as handle:
        while shutil.disk_usage(directory).free > leave + 4096:
            handle.write(b"\0" * min(1 << 20, shutil.disk_usage(directory).free - leave))
            handle.flush()
    return filler


def save_real_checkpoint(profile_path: Path, run_dir: Path, step: int) -> Path:
    """step-N of the profile's drafter, written by the trainer's save_checkpoint (AdamW state after one update)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.target_model import resolve_model_path
    from dflash.train.rank.setup import build_drafter, cosine_schedule, resolve_layer_ids
    from launcher_core.profile import load_profile

    profile = load_profile(str(profile_path))
    target = AutoModelForCausalLM.from_pretrained(resolve_model_path(profile.model.target), local_files_only=True)
    layers = target.config.num_hidden_layers
    drafter = build_drafter(profile, target, resolve_layer_ids(profile, layers), layers)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    scheduler = cosine_schedule(optimizer, 10, 0.1)
    return save_checkpoint(run_dir, drafter, step, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                                     "micro_batch": 1, "total_steps": 10})
