"""Checkpoint retention (`train.keep_checkpoints`): a run that saves every `train.save_every_steps`
steps for days keeps a bounded number of checkpoints instead of filling its disk.

After each checkpoint is published, rank 0 removes the complete `step-N` directories beyond the newest
`keep_checkpoints`, keeping also the best step by held-out tau (train.validation_share) and whatever
`latest` names. A checkpoint being written is a staging directory (`.step-N.*.tmp`), never a
`step-N`, and a `step-N` without every file of a checkpoint (config.json, training_state.pt,
dcp/.metadata; model.safetensors only in the run's last) is left alone: only what this trainer wrote whole is removed.
0 keeps every checkpoint.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash.drafter.checkpoint_files import LATEST, STEP_DIR, checkpoints_dir, complete_checkpoints


@dataclass(frozen=True)
class Retention:
    """What one pruning kept (step -> why) and removed (steps)."""

    kept: dict[int, str]
    removed: list[int]

    def line(self) -> str:
        kept = ", ".join(f"step-{step} ({why})" for step, why in sorted(self.kept.items()))
        return (f"checkpoints: removed {', '.join(f'step-{s}' for s in self.removed)}; kept {kept} "
                "(train.keep_checkpoints)")


def latest_step(run_dir: Path) -> Optional[int]:
    """The step `latest` names (None without a readable pointer)."""
    try:
        match = STEP_DIR.fullmatch((checkpoints_dir(run_dir) / LATEST).read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        return None
    return int(match.group(1)) if match else None


def prune_checkpoints(run_dir: Path, keep: int, best: Optional[int] = None) -> Retention:
    """Remove the whole checkpoints beyond the newest `keep` (0: none), the best step's and the latest's kept."""
    checkpoints = complete_checkpoints(run_dir)
    steps = sorted(checkpoints)
    if keep <= 0:
        return Retention({step: "every one kept" for step in steps}, [])
    reasons = {step: f"the newest {keep}" for step in steps[-keep:]}
    for step, why in ((latest_step(run_dir), "latest"), (best, "the best by held-out tau")):
        if step in checkpoints:
            reasons[step] = why if step not in reasons else f"{reasons[step]}, {why}"
    removed = [step for step in steps if step not in reasons]
    for step in removed:
        shutil.rmtree(checkpoints[step])
    return Retention(reasons, removed)
