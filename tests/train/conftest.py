"""Shared setups for the training tests: a loaded tiny Qwen3 target, tiny datasets, profiles."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

MASK_ID = 151669   # a padding row of the Qwen3 embedding (the tokenizer has 151669 tokens)
# A draft vocabulary of every token write_dataset's rows hold (counting mod 50): a cheap head for the runs whose
# behaviour does not depend on the head's width (on the tiny target the head over Qwen3's 151,936 rows is two
# thirds of a rank's CPU).
DATA_VOCAB = {"draft_vocab_size": 50}


def write_dataset(path: Path, rows: int = 32, seed: int = 0) -> Path:
    """Token sequences with a learnable pattern (counting mod 50) and a prompt without loss."""
    from dflash.data.dataset_io import save_token_rows

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(rows):
        length, prompt, start = int(rng.integers(40, 80)), int(rng.integers(5, 15)), int(rng.integers(0, 50))
        records.append(([1000 + (start + j) % 50 for j in range(length)], [0] * prompt + [1] * (length - prompt)))
    return save_token_rows(path, records)


def write_profile(path: Path, target: Path, dataset: Path, run_dir: Path, **train: object) -> Path:
    machine = train.pop("machine", {"nproc_per_node": 2})
    drafter = {"num_layers": 1, "block_size": 4, "mask_token_id": MASK_ID, **train.pop("drafter", {})}
    settings = {"epochs": 1, "max_steps": 24, "global_batch": 4, "max_micro_batch": 1, "num_anchors": 8,
                "decay_gamma": 3.0, "log_every_steps": 1, "save_every_steps": 12, "lr": 1e-2, **train}
    lines = ["[machine]", 'device = "cpu"', 'backend = "gloo"', *(f"{k} = {_toml(v)}" for k, v in machine.items()),
             "[model]", f'target = "{target}"', 'dtype = "float32"',
             "[paths]", f'run_dir = "{run_dir}"', f'dataset = "{dataset}"',
             "[drafter]", *(f"{k} = {_toml(v)}" for k, v in drafter.items()),
             "[train]", *(f"{k} = {_toml(v)}" for k, v in settings.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _toml(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture(scope="session")
def tiny_target_model(tiny_qwen3_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, dtype="float32", local_files_only=True).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "dataset")
