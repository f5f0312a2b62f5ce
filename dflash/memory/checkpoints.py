"""The disk a run's checkpoints take (dflash.train.checkpointing writes them, dflash.train.retention bounds
them), from the memory plan's figures: `launcher.py plan` prints it and `train` refuses a run whose kept
checkpoints do not fit the free disk at its run directory.

A checkpoint holds the drafter's trainable weights in float32 twice (the DCP shards and the consolidated
`model.safetensors`) and AdamW's two float32 states once (in the shards): 4 x the float32 weights. With
`train.keep_checkpoints` N the run holds at most N + 2 at once: the newest N, the best by held-out tau,
and the one being written before the oldest is removed. With 0 every checkpoint stays.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from dflash.memory.plan import Plan
    from envcheck.snapshot import DiskFacts
    from launcher_core.schema import TrainSection

MIB_PER_GIB = 1024.0


@dataclass(frozen=True)
class CheckpointDisk:
    """One checkpoint's size and what the run's retention holds at once, in MiB."""

    sharded_mib: float          # dcp/: every rank's float32 weight and AdamW shards
    weights_mib: float          # model.safetensors: the whole float32 weights
    every_steps: int
    keep: int                   # train.keep_checkpoints (0: every one)

    @property
    def each_mib(self) -> float:
        return self.sharded_mib + self.weights_mib

    @property
    def held(self) -> Optional[int]:
        """Checkpoints on disk at most (None: every one is kept, so no bound)."""
        return self.keep + 2 if self.keep > 0 else None

    @property
    def need_mib(self) -> Optional[float]:
        return None if self.held is None else self.held * self.each_mib

    def line(self, free: Optional[DiskFacts] = None) -> str:
        size = (f"checkpoints: {gib(self.each_mib)} each ({gib(self.sharded_mib)} of sharded float32 weights and AdamW "
                f"states, {gib(self.weights_mib)} of model.safetensors), every {self.every_steps} steps, resumable at "
                f"another world size")
        where = f"; {gib(free.free_mib)} free at {free.path}" if free else ""
        if self.need_mib is None:
            saves = f", {int(free.free_mib // self.each_mib)} saves fill it" if free and self.each_mib else ""
            return f"{size}; every one kept (train.keep_checkpoints 0){where}{saves}"
        return (f"{size}; at most {self.held} on disk (train.keep_checkpoints {self.keep}, the best by held-out tau, "
                f"one being written) = {gib(self.need_mib)}{where}")

    def problem(self, free: Optional[DiskFacts]) -> Optional[str]:
        """Why the kept checkpoints do not fit the free disk (None: they do, or nothing is known)."""
        if free is None or self.need_mib is None or self.need_mib <= free.free_mib:
            return None
        return (f"the run's checkpoints need {gib(self.need_mib)} at once ({self.held} x {gib(self.each_mib)}: "
                f"train.keep_checkpoints {self.keep}, the best, one being written) and {free.path} has "
                f"{gib(free.free_mib)} free; lower train.keep_checkpoints, free space or move paths.run_dir")


def gib(mib: float) -> str:
    """GiB with one decimal; under 1 GiB in MiB."""
    return f"{mib / MIB_PER_GIB:,.1f} GiB" if mib >= MIB_PER_GIB else f"{mib:,.0f} MiB"


def checkpoint_disk(plan: Plan, train: TrainSection) -> CheckpointDisk:
    """From the plan's per-rank float32 weight and AdamW shards, summed over the ranks."""
    weights = plan.estimate.drafter_weights * plan.world_size
    states = plan.estimate.optimizer_states * plan.world_size
    return CheckpointDisk(sharded_mib=weights + states, weights_mib=weights, every_steps=train.save_every_steps,
                          keep=train.keep_checkpoints)


def run_dir_disk(disks: Sequence[DiskFacts], run_dir: str) -> Optional[DiskFacts]:
    """The snapshot's disk entry for the run directory: the deepest recorded path that holds it, else the one
    entry a snapshot records (the run directory of the node it was taken on, envcheck.preflight.disk_paths)."""
    target = PurePosixPath(run_dir)
    holding = [d for d in disks if target == PurePosixPath(d.path) or PurePosixPath(d.path) in target.parents]
    if holding:
        return max(holding, key=lambda d: len(PurePosixPath(d.path).parts))
    return disks[0] if len(disks) == 1 else None
