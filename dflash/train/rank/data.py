"""Training data of one rank: the Arrow dataset, the per-epoch order, this rank's rows of a
step, and collation into right-padded micro-batches with their anchors.

`train.validation_share` holds a share of the dataset's rows out of training (dflash.data.validation_split:
chosen once from the row count and train.seed, the same on every rank and every restart; the trainer
records them in train/validation.json): the epochs, the steps and the draft vocabulary see only the
training rows (`TrainData.dataset`), and dflash.train.rank.validation measures the drafter on the others."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dflash.data.validation_split import split_rows
from dflash.drafter.anchors import sample_anchors
from dflash.train.rank.parallel import WorkerEnv
from launcher_core.errors import DataError
from launcher_core.schema import Profile


@dataclass
class MicroBatch:
    """Right-padded sequences and their anchors (padded anchors: 0, anchor_valid False)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    tokens: int
    rows: tuple[int, ...] = ()          # dataset rows (the feature cache's keys)
    lengths: tuple[int, ...] = ()       # unpadded length of each sequence

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(self.input_ids.to(device), self.loss_mask.to(device), self.anchors.to(device),
                          self.anchor_valid.to(device), self.tokens, self.rows, self.lengths)


class StepData(Protocol):
    """What a training state reads its batches from: the rank's dataset (`TrainData`), or the
    memory trace's worst case (dflash.measure.trace.WorstCaseData)."""

    dataset: Any                # a datasets.Dataset (untyped third-party object) with input_ids, loss_mask
    max_length: int

    @property
    def steps_per_epoch(self) -> int: ...

    def collate(self, rows: list[int], epoch: int) -> MicroBatch: ...


class TrainData:
    """The Arrow dataset, the per-epoch order, each rank's rows of a step, and collation."""

    def __init__(self, path: Path, profile: Profile, env: WorkerEnv):
        import datasets

        if not Path(path).exists():
            raise DataError(f"{path}: no dataset; run `launcher.py tokenize --profile {profile.name}` first")
        verify_dataset(Path(path), hashes=env.rank == 0)
        self.source = datasets.load_from_disk(str(path)).with_format(None)      # every row, held-out ones too
        missing = {"input_ids", "loss_mask"} - set(self.source.column_names)
        if missing:
            raise DataError(f"{path}: dataset lacks columns {sorted(missing)}; re-run tokenize")
        self.split = split_rows(len(self.source), profile.train.validation_share, profile.train.seed)
        self.dataset = self.source.select(self.split.train) if self.split.validation else self.source
        self.global_batch, self.env, self.train = profile.train.global_batch, env, profile.train
        self.max_length = profile.data.max_length
        self._check_sizes(path)

    def _check_sizes(self, path: Path) -> None:
        assert self.global_batch % self.env.world_size == 0, "the profile schema divides train.global_batch over the ranks"
        if len(self.dataset) < self.global_batch:
            held = f" after {len(self.split.validation)} held out (train.validation_share)" if self.split.validation else ""
            raise DataError(f"{path}: {len(self.dataset)} training rows{held}, fewer than train.global_batch {self.global_batch}")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch

    @property
    def rows_per_rank(self) -> int:
        return self.global_batch // self.env.world_size

    def step_rows(self, step: int) -> tuple[int, list[int]]:
        """(epoch, this rank's row indices) of global step `step` (0-based); drop-last per epoch."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.train.seed, epoch]).permutation(len(self.dataset))
        chosen = order[index * self.global_batch:(index + 1) * self.global_batch]
        return epoch, [int(row) for row in chosen[self.env.rank::self.env.world_size]]

    def collate(self, rows: list[int], epoch: int) -> MicroBatch:
        """Rows of `dataset` (the training rows) -> a micro-batch keyed by their dataset rows."""
        return self.collate_dataset_rows([self.split.train[row] for row in rows] if self.split.validation else rows, epoch)

    def loss_masks(self, rows: list[int]) -> list[list[int]]:
        """The whole (uncut) loss masks of training rows `rows` (dflash.train.rank.loss_check names a step's cause)."""
        dataset_rows = [self.split.train[row] for row in rows] if self.split.validation else rows
        return [list(self.source[row]["loss_mask"]) for row in dataset_rows]

    def collate_dataset_rows(self, rows: list[int], epoch: int) -> MicroBatch:
        """Rows of the whole dataset (held-out ones too) -> a micro-batch; anchors and feature-cache
        keys follow these row numbers."""
        records = [self.source[row] for row in rows]
        ids = [list(r["input_ids"])[: self.max_length] for r in records]
        masks = [list(r["loss_mask"])[: self.max_length] for r in records]
        return collate_rows(ids, masks, rows, self.train.num_anchors, self.train.seed, epoch)

def verify_dataset(path: Path, hashes: bool) -> None:
    """A dataset written by tokenize or merge: every shard's recorded size on every rank, and its
    sha256 on rank 0 (one read of the data; benchmarks/results/integrity-sha256_cpu-2core_2026-12-01.md), before anything is trained on it. A
    mismatch is a DataError naming the shard and the backup."""
    from dflash.data import dataset_io

    if (path / dataset_io.META_NAME).exists():
        dataset_io.verify_shards(path, dataset_io.read_meta(path), hashes=hashes)


def collate_rows(ids: list[list[int]], masks: list[list[int]], rows: list[int], num_anchors: int,
                 seed: int, epoch: int) -> MicroBatch:
    """Right-pad sequences into a MicroBatch; anchors sampled per (seed, epoch, dataset row)."""
    anchors = [sample_anchors(m, num_anchors, seed=seed, epoch=epoch, row=row) for m, row in zip(masks, rows)]
    width, count = max(map(len, ids)), max(1, max(map(len, anchors)))
    batch = MicroBatch(torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long),
                       torch.zeros(len(rows), count, dtype=torch.long), torch.zeros(len(rows), count, dtype=torch.bool),
                       tokens=sum(map(len, ids)), rows=tuple(rows), lengths=tuple(map(len, ids)))
    for i, (seq, mask, anchor) in enumerate(zip(ids, masks, anchors)):
        batch.input_ids[i, : len(seq)] = torch.tensor(seq)
        batch.loss_mask[i, : len(mask)] = torch.tensor(mask)
        batch.anchors[i, : len(anchor)] = torch.from_numpy(anchor)
        batch.anchor_valid[i, : len(anchor)] = True
    return batch
