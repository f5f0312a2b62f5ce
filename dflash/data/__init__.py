"""Training data: tokenize completions with the target's chat template, inspect, merge.

The callable API, with the signatures of the modules that define it (each module is imported
when its name is first used, so importing this package stays light):

    tokenize_completions(profile, input_path=None, output_path=None, workers=None,
                         allow_degenerate=False, run_dir=None, ...) -> TokenizeSummary
    inspect_dataset(path, ...) -> InspectReport
    merge_datasets(base, add, output=None, in_place=False, dedup="none", ...) -> MergeSummary
    load_training_dataset(path) -> datasets.Dataset (memory-mapped)
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

    from dflash.data.inspect import InspectReport, inspect_dataset
    from dflash.data.merge import MergeSummary, merge_datasets
    from dflash.data.tokenize import TokenizeSummary, tokenize_completions

REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask", "length", "num_loss_tokens")
# name -> the module that defines it
_LAZY = {"tokenize_completions": "dflash.data.tokenize", "TokenizeSummary": "dflash.data.tokenize",
         "inspect_dataset": "dflash.data.inspect", "InspectReport": "dflash.data.inspect",
         "merge_datasets": "dflash.data.merge", "MergeSummary": "dflash.data.merge"}

__all__ = ["REQUIRED_COLUMNS", "InspectReport", "MergeSummary", "TokenizeSummary", "inspect_dataset",
           "load_training_dataset", "merge_datasets", "tokenize_completions"]


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def load_training_dataset(path: str | Path) -> datasets.Dataset:
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
