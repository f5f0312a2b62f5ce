"""The disk a run's checkpoints take (dflash.train.rank.sharded_checkpoints writes them, dflash.train.rank.retention bounds
them) and what one OOM restart costs, from the memory plan's figures: `launcher.py plan` prints both and
`train` refuses a run whose kept checkpoints do not fit the free disk at its run directory.

A checkpoint holds the drafter's trainable weights in float32 and AdamW's two float32 states, in the DCP
shards: 3 x the float32 weights. Only the run's last checkpoint also holds the consolidated
`model.safetensors` (1 x); the others' weights are read from their shards on demand. With
`train.keep_checkpoints` N (3 by default) the run holds at most N + 2 at once: the newest N, the best by
held-out tau, and the one being written before the oldest is removed. With 0 every checkpoint stays: the
run needs at least one of them and the last's weights, and how many saves fill the disk is said.

A resumed run's own whole checkpoints already fill part of the disk: retention removes them as new ones
come, so the disk it still needs is what it writes beyond them (`CheckpointDisk.on_disk`).

An OOM restarts every rank from the last checkpoint (dflash.train.supervisor.launch): each reloads the target and the
run recomputes the steps since that checkpoint, at most train.save_every_steps, and with
train.save_every_minutes at most that many minutes of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from dflash.memory.budget import Plan
    from envcheck.snapshot import DiskFacts
    from launcher_core.schema import TrainSection

MIB_PER_GIB = 1024.0


@dataclass(frozen=True)
class CheckpointDisk:
    """One checkpoint's size and what the run's retention holds at once, in MiB."""

    sharded_mib: float          # dcp/: every rank's float32 weight and AdamW shards
    weights_mib: float          # model.safetensors: the whole float32 weights (the run's last checkpoint only)
    every_steps: int
    keep: int                   # train.keep_checkpoints (0: every one)
    every_minutes: float = 0.0  # train.save_every_minutes (0: by steps only)
    asynchronous: bool = True   # train.async_save
    on_disk: int = 0            # the run's own whole checkpoints already there (a resume), which retention removes

    @property
    def each_mib(self) -> float:
        """An intermediate checkpoint: the shards (and a few KiB of config and training state)."""
        return self.sharded_mib

    @property
    def last_mib(self) -> float:
        return self.sharded_mib + self.weights_mib

    @property
    def held(self) -> Optional[int]:
        """Checkpoints on disk at most (None: every one is kept, so no bound)."""
        return self.keep + 2 if self.keep > 0 else None

    @property
    def to_write(self) -> int:
        """Checkpoints the run adds to the disk at its fullest: with a bound, what it holds beyond its own already
        there (at least the one being written); with every one kept, at least one."""
        return max(1, self.held - self.on_disk) if self.held is not None else 1

    @property
    def need_mib(self) -> float:
        """Free disk the run needs (with every checkpoint kept: at least this much)."""
        return self.to_write * self.each_mib + self.weights_mib

    def line(self, free: Optional[DiskFacts] = None) -> str:
        when = f"every {self.every_steps} steps" + (f" or {self.every_minutes:g} minutes" if self.every_minutes else "")
        how = "written while the ranks train on (train.async_save)" if self.asynchronous else "written with the ranks waiting"
        size = (f"checkpoints: {gib(self.each_mib)} each (float32 weight and AdamW shards; the last also "
                f"{gib(self.weights_mib)} of model.safetensors), {when}, {how}\n  ")
        where = f"; {gib(free.free_mib)} free at {free.path}" if free else ""
        short = " (DOES NOT FIT: train refuses the run)" if self.problem(free) else ""
        if self.held is None:
            saves = f", {int(free.free_mib // self.each_mib)} saves fill it" if free and self.each_mib else ""
            return f"{size}every one kept (train.keep_checkpoints 0){where}{saves}{short}"
        own = (f"; {self.on_disk} of the run's own already there, {self.to_write} more = {gib(self.need_mib)}"
               if self.on_disk else "")
        return (f"{size}at most {self.held} on disk (train.keep_checkpoints {self.keep}, the best by held-out tau, "
                f"one being written) = {gib(self.held * self.each_mib + self.weights_mib)}{own}{where}{short}")

    def problem(self, free: Optional[DiskFacts]) -> Optional[str]:
        """Why the checkpoints the run writes do not fit the free disk (None: they do, or nothing is known)."""
        if free is None or self.need_mib <= free.free_mib:
            return None
        return f"{self._needs()} and {free.path} has {gib(free.free_mib)} free; {self._remedy()}"

    def _needs(self) -> str:
        weights = f"the last's {gib(self.weights_mib)} model.safetensors"
        if self.held is None:
            return (f"one checkpoint of the run needs {gib(self.need_mib)} ({gib(self.each_mib)} of shards and "
                    f"{weights}; train.keep_checkpoints 0 keeps every one)")
        if self.on_disk:
            return (f"the resumed run's checkpoints need {gib(self.need_mib)} more ({self.to_write} x "
                    f"{gib(self.each_mib)} beside the {self.on_disk} of its own already there, which retention "
                    f"removes as new ones come: train.keep_checkpoints {self.keep}, the best, one being written; "
                    f"and {weights})")
        return (f"the run's checkpoints need {gib(self.need_mib)} at once ({self.held} x {gib(self.each_mib)}: "
                f"train.keep_checkpoints {self.keep}, the best, one being written; and {weights})")

    def _remedy(self) -> str:
        lower = "lower train.keep_checkpoints, " if self.keep > 1 and self.to_write > 1 else ""
        return f"{lower}free space or move paths.run_dir"


@dataclass(frozen=True)
class RestartCost:
    """What one OOM restart costs: every rank's target reload and the steps since the last checkpoint."""

    ranks: int
    target_mib: float                   # one rank's target weights
    steps_at_risk: int                  # train.save_every_steps
    minutes_at_risk: float              # train.save_every_minutes (0: not bounded in time)
    start_s: Optional[float]            # one rank's start (the target loaded, the drafter built and sharded),
                                        # measured by `launcher.py calibrate` (None: not yet)

    def line(self) -> str:
        load = (f"a rank's start, target load included, {self.start_s:.0f} s as calibrate measured it"
                if self.start_s is not None else "its load time not yet measured: `launcher.py calibrate` measures it")
        risk = f"up to {self.steps_at_risk} steps"
        if self.minutes_at_risk:
            risk += f" or {self.minutes_at_risk:g} minutes of them, whichever is less (train.save_every_minutes)"
        else:
            risk += " (not bounded in time: train.save_every_minutes is 0)"
        return (f"an OOM restart: every rank reloads the target ({gib(self.target_mib)} a rank, "
                f"{gib(self.target_mib * self.ranks)} read on the node; {load})\n  and the run recomputes {risk} "
                f"since the last checkpoint")


def gib(mib: float) -> str:
    """GiB with one decimal; under 1 GiB in MiB (under 10 MiB with one decimal)."""
    if mib >= MIB_PER_GIB:
        return f"{mib / MIB_PER_GIB:,.1f} GiB"
    return f"{mib:,.1f} MiB" if mib < 10 else f"{mib:,.0f} MiB"


def checkpoint_disk(plan: Plan, train: TrainSection, on_disk: int = 0) -> CheckpointDisk:
    """From the plan's per-rank float32 weight and AdamW shards, summed over the ranks; `on_disk`: the run's own
    whole checkpoints already there (a resume)."""
    weights = plan.estimate.drafter_weights * plan.world_size
    states = plan.estimate.optimizer_states * plan.world_size
    return CheckpointDisk(sharded_mib=weights + states, weights_mib=weights, every_steps=train.save_every_steps,
                          keep=train.keep_checkpoints, every_minutes=train.save_every_minutes,
                          asynchronous=train.async_save, on_disk=on_disk)


def restart_cost(plan: Plan, train: TrainSection, start_s: Optional[float] = None) -> RestartCost:
    return RestartCost(ranks=plan.world_size, target_mib=plan.estimate.target_weights,
                       steps_at_risk=train.save_every_steps, minutes_at_risk=train.save_every_minutes, start_s=start_s)


def run_dir_disk(disks: Sequence[DiskFacts], run_dir: str) -> Optional[DiskFacts]:
    """The snapshot's disk entry for the run directory: the deepest recorded path that holds it, else the one
    entry a snapshot records (the run directory of the node it was taken on, envcheck.preflight.disk_paths)."""
    target = PurePosixPath(run_dir)
    holding = [d for d in disks if target == PurePosixPath(d.path) or PurePosixPath(d.path) in target.parents]
    if holding:
        return max(holding, key=lambda d: len(PurePosixPath(d.path).parts))
    return disks[0] if len(disks) == 1 else None
