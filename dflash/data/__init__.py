"""Training data: tokenize completions with the target's chat template, inspect, merge.

The callable API (imports stay light until a function is called):

    tokenize_completions(profile, input_path=None, output_path=None, workers=None,
                         allow_degenerate=False, run_dir=None) -> TokenizeSummary
    inspect_dataset(path) -> InspectReport
    merge_datasets(base, add, output=None, in_place=False, dedup="none") -> MergeSummary
    load_training_dataset(path) -> datasets.Dataset (memory-mapped)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask", "length", "num_loss_tokens")


def tokenize_completions(*args: Any, **kwargs: Any) -> Any:
    from dflash.data.tokenize import tokenize_completions as run

    return run(*args, **kwargs)


def inspect_dataset(*args: Any, **kwargs: Any) -> Any:
    from dflash.data.inspect import inspect_dataset as run

    return run(*args, **kwargs)


def merge_datasets(*args: Any, **kwargs: Any) -> Any:
    from dflash.data.merge import merge_datasets as run

    return run(*args, **kwargs)


def load_training_dataset(path: str | Path) -> Any:
    """The dataset for the trainer: `datasets.load_from_disk`, memory-mapped, columns checked."""
    import datasets

    from dflash.data.dataset_io import read_meta
    from launcher_core.errors import InputError

    read_meta(Path(path))
    dataset = datasets.load_from_disk(str(path))
    missing = [name for name in REQUIRED_COLUMNS if name not in dataset.column_names]
    if missing:
        raise InputError(f"{path}: dataset lacks columns {', '.join(missing)}; re-run `launcher.py tokenize`")
    return dataset
