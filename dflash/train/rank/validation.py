"""Validation during training: the drafter measured on dataset rows held out of training.

`train.validation_share` holds rows out (`dflash.data.validation_split.split_rows`: chosen once from the row
count and train.seed). Every `train.validation_every_steps` steps (0: at every checkpoint,
train.save_every_steps) and after the last step, EVERY rank runs the training step's own forward
(`dflash.train.rank.step.forward_micro`, under torch.no_grad()) over its share of the held-out rows
(rows rank, rank + world, ...), all ranks the same number of drafter forwards: the drafter's
forward is a collective once it is sharded, so a rank short of rows runs a pass whose figures it
drops (`rank_batches`). The sums are all-reduced into:

* the held-out loss: the training loss (decay-weighted cross entropy over block slots 1..B-1),
* the held-out tau, counted as eval counts a decoding step: 1 + the leading draft tokens of a
  block whose argmax is the target's token (dflash.drafter.loss.leading_accepted).

The anchors are sampled once (as epoch 0 samples them), so every measurement sees the same blocks.
Rank 0 writes `train/validation.json` (the held-out rows, every measurement, the best step by
held-out tau and its checkpoint) and the run manifest's train entry names the best step, which the
pipeline evaluates (dflash.stages).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from dflash.train.rank.data import TrainData
    from dflash.train.rank.setup import TrainState
    from launcher_core.schema import Profile

VALIDATION_FILE = "validation.json"
ANCHOR_EPOCH = 0          # the held-out blocks: anchors as epoch 0 samples them, the same at every measurement


@dataclass(frozen=True)
class HeldOut:
    """One measurement on the held-out rows (every rank's share summed)."""

    step: int
    loss: float
    tau: float                  # 1 + accepted draft tokens per block (eval's definition)
    acc: list[float]            # per block slot 1..B-1: the share of its labelled positions predicted right
    blocks: int
    seconds: float

    def line(self) -> str:
        return f"held-out at step {self.step}: loss {self.loss:.4f}, tau {self.tau:.3f} ({self.blocks} blocks, {self.seconds:.1f} s)"


def rank_batches(rows: Sequence[int], rank: int, world: int, micro_batch: int) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches of `rows` and whether each one's figures count. A rank takes rows
    rank, rank + world, ...; every rank gets ceil(ceil(len(rows) / world) / micro_batch) batches, so
    all run the same number of forwards: a rank short of rows repeats one of them, not counted."""
    per_rank = -(-len(rows) // world)
    count = -(-per_rank // micro_batch)
    own = list(rows[rank::world])
    batches = [(own[i:i + micro_batch], True) for i in range(0, len(own), micro_batch)]
    filler = (own or list(rows))[:1]
    return batches + [(filler, False)] * (count - len(batches))


def measure(state: TrainState, data: TrainData, rows: Sequence[int]) -> HeldOut:
    """Held-out loss and tau of the drafter as it is now, over `rows` (every rank calls this)."""
    import torch

    from dflash.drafter.loss import counted_tau, per_slot_accuracy
    from dflash.train.rank import parallel
    from dflash.train.rank.step import forward_micro

    started = time.perf_counter()
    slots = state.drafter.block_size - 1
    totals = torch.zeros(4 + 2 * slots, dtype=torch.float64)
    with torch.no_grad():
        for batch_rows, counted in rank_batches(rows, state.env.rank, state.env.world_size, state.micro_batch):
            parts = forward_micro(state, data.collate_dataset_rows(batch_rows, ANCHOR_EPOCH))
            if counted:
                assert parts.accepted is not None and parts.blocks is not None, "block_loss counts accepted tokens"
                totals += torch.cat([torch.stack([parts.weighted_ce, parts.weight_sum, parts.accepted, parts.blocks])
                                     .detach().double().cpu(), parts.correct.double().cpu(), parts.counted.double().cpu()])
    reduced = parallel.all_reduce_tensor(totals)
    weight, accepted, blocks = float(reduced[1]), float(reduced[2]), float(reduced[3])
    return HeldOut(step=state.step, loss=float(reduced[0]) / weight if weight else float("nan"),
                   tau=counted_tau(accepted, blocks), acc=per_slot_accuracy(reduced[4:4 + slots], reduced[4 + slots:]),
                   blocks=int(blocks), seconds=time.perf_counter() - started)


@dataclass
class ValidationLog:
    """Rank 0's record of the held-out rows and every measurement (train/validation.json)."""

    path: Path
    share: float
    seed: int
    every_steps: int
    rows: list[int]
    history: list[HeldOut] = field(default_factory=list)

    def best(self) -> Optional[HeldOut]:
        """The measurement with the highest held-out tau (ties: the lower loss, then the earlier step)."""
        return max(self.history, key=lambda h: (h.tau, -h.loss, -h.step), default=None)

    def add(self, result: HeldOut) -> None:
        self.history = [h for h in self.history if h.step < result.step] + [result]
        self.write()

    def write(self, best_checkpoint: Optional[str] = None) -> None:
        from launcher_core.fileio import write_json_atomic

        best = self.best()
        write_json_atomic(self.path, {
            "share": self.share, "seed": self.seed, "every_steps": self.every_steps, "rows": self.rows,
            "history": [asdict(h) for h in self.history],
            "best": None if best is None else {"step": best.step, "tau": best.tau, "loss": best.loss,
                                               "checkpoint": best_checkpoint}})

    def resumed(self, step: int) -> "ValidationLog":
        """The measurements of an earlier attempt up to `step` (a resumed run redoes the rest)."""
        import json

        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return self
        if saved.get("rows") != self.rows:
            return self
        self.history = [HeldOut(**entry) for entry in saved.get("history", []) if int(entry["step"]) <= step]
        return self


class Validation:
    """The trainer's hook (dflash.train.rank.worker.train_loop): `after_step` on every rank."""

    def __init__(self, data: TrainData, every_steps: int, log: Optional[ValidationLog]):
        self.data, self.every_steps, self.log = data, every_steps, log
        self.rows = list(data.split.validation)
        self.last: Optional[HeldOut] = log.history[-1] if log and log.history else None

    def due(self, step: int, total: int) -> bool:
        return step == total or step % self.every_steps == 0

    def after_step(self, state: TrainState) -> Optional[HeldOut]:
        """The held-out figures when a measurement is due after this step (every rank runs it), else None."""
        if not self.due(state.step, state.total_steps):
            return None
        state.progress.enter("validation")
        result = measure(state, self.data, self.rows)
        self.last = result
        if self.log is not None:
            self.log.add(result)
            print(result.line(), flush=True)
        return result

    def finish(self, run_dir: Path) -> None:
        """Rank 0, after the final checkpoint: name the best step and record it in the manifest."""
        from dflash.drafter.checkpoint_files import checkpoints_dir, has_weights
        from launcher_core.manifest import update_stage

        assert self.log is not None, "rank 0 keeps the log"
        best = self.log.best()
        if best is None:
            return
        checkpoint = checkpoints_dir(run_dir) / f"step-{best.step}"
        saved = has_weights(checkpoint)
        self.log.write(str(checkpoint) if saved else None)
        last = self.log.history[-1]
        update_stage(run_dir, "train", None, validation_best_step=best.step, validation_best_tau=round(best.tau, 4),
                     validation_best_checkpoint=str(checkpoint) if saved else None,
                     validation_last_step=last.step, validation_last_tau=round(last.tau, 4),
                     validation_rows=len(self.rows))
        where = f"checkpoint {checkpoint}" if saved else "no checkpoint of that step (train.validation_every_steps " \
                                                          "off the train.save_every_steps grid)"
        print(f"held-out tau: best {best.tau:.3f} at step {best.step} ({where}); last {last.tau:.3f} at step {last.step}",
              flush=True)


def start_validation(state: TrainState, profile: Profile, run_dir: Path) -> Optional[Validation]:
    """The run's validation (None with train.validation_share 0); rank 0 records the held-out rows now."""
    from dflash.train.rank.data import TrainData

    data = state.data
    if not isinstance(data, TrainData) or not data.split.validation:
        return None
    every = profile.train.validation_every_steps or profile.train.save_every_steps
    log = None
    if state.env.is_main:
        log = ValidationLog(run_dir / "train" / VALIDATION_FILE, profile.train.validation_share, profile.train.seed,
                            every, list(data.split.validation)).resumed(state.step)
        log.write()
        print(f"validation: {len(log.rows)} of {len(data.source)} rows held out of training "
              f"(train.validation_share {profile.train.validation_share}), measured every {every} steps and at the end",
              flush=True)
    return Validation(data, every, log)


def read_validation(run_dir: Path) -> Optional[dict[str, Any]]:
    """train/validation.json of a run, or None (no validation, or unreadable)."""
    import json

    try:
        value = json.loads((Path(run_dir) / "train" / VALIDATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
