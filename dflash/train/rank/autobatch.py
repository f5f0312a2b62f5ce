"""The agreed micro-batch and OOM recovery by restart, inside each torchrun worker.

FSDP2's collectives run inside the forward and backward, so a rank out of memory in one of them
leaves the others waiting there: no rank recovers in place. It writes an OOM record
(dflash.train.supervisor.oom_records) and exits with OOM_EXIT_CODE; the launcher starts every rank
again with --resume; at start (`AutoBatch.start`) each rank takes half the recorded micro-batch (never
above the persisted or planned one), the ranks agree on the smallest (all_reduce MIN), and rank 0
persists it with the reduction in `train/autobatch.json`.

Only the steps since the last checkpoint are recomputed (their metrics lines rewritten, never counted
twice), and since each micro-batch's loss is divided by the step's global weight they give the same
gradients at the smaller micro-batch. An OOM at micro-batch 1 cannot be halved: the restart fails
saying what to change. Drills inject OOMs through dflash.train.rank.faults.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dflash.train.rank.parallel import agree_micro_batch
from dflash.train.supervisor.oom_records import (
    OOM_EXIT_CODE,
    OomRecord,
    clear_oom_records,
    fatal_oom_message,
    read_oom_records,
    unrecoverable,
    write_oom_record,
)
from launcher_core.errors import RunFailed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Reduction = dict[str, int | str]      # one halving, as autobatch.json keeps it: step, from, to, failed_ranks, phase, at

RUN_STATE_NAME = "autobatch.json"


# --- run state (the agreed micro-batch, persisted) -------------------------

@dataclass
class RunState:
    micro_batch: int
    reductions: list[Reduction] = field(default_factory=list)


def run_state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / RUN_STATE_NAME


def load_run_state(path: str | Path) -> RunState | None:
    from launcher_core.fileio import read_json

    if not Path(path).exists():
        return None
    document = read_json(path)
    return RunState(micro_batch=int(document["micro_batch"]), reductions=list(document.get("reductions", [])))


def save_run_state(path: str | Path, state: RunState) -> None:
    from launcher_core.fileio import write_json_atomic

    write_json_atomic(path, {"micro_batch": state.micro_batch, "reductions": state.reductions})


def resume_micro_batch(planned: int, path: str | Path) -> int:
    """A restart never goes back above the micro-batch the ranks last agreed on."""
    state = load_run_state(path)
    return planned if state is None else min(planned, state.micro_batch)


def reduction_after(records: list[OomRecord], micro_batch: int) -> Reduction:
    """The halving the records ask for, as autobatch.json keeps it."""
    first = min(records, key=lambda r: (r.step, r.rank))
    return {"step": first.step, "from": micro_batch, "to": min(r.halved for r in records),
            "failed_ranks": len({r.rank for r in records}), "phase": first.phase,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# --- the agreed micro-batch ---------------------------------------------------------------

class AutoBatch:
    """One agreed micro-batch for all ranks; an OOM anywhere in a step ends in a restart of every
    rank at half of it (module docstring).

    Usage in a worker (after init_process_group):

        auto = AutoBatch.start(plan.micro_batch, run_dir, rank)   # records + persisted + agree
        with auto.guard(step, lambda: progress.phase):            # an OOM inside -> record, exit
            ... the step ...
    """

    def __init__(self, micro_batch: int, rank: int, run_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None):
        self.micro_batch = micro_batch
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.log = log or (lambda line: print(line, flush=True))
        self.reductions: list[Reduction] = []

    @property
    def state_path(self) -> Path | None:
        return run_state_path(self.run_dir) if self.run_dir is not None else None

    @classmethod
    def start(cls, planned_micro_batch: int, run_dir: str | Path | None, rank: int,
              group: ProcessGroup | None = None, log: Callable[[str], None] | None = None) -> "AutoBatch":
        """Half of any recorded OOM's micro-batch, never above the persisted or planned one; the
        ranks agree on the smallest; rank 0 persists it with the reduction and clears the records."""
        records = read_oom_records(run_dir) if run_dir is not None else []
        fatal = unrecoverable(records)
        if fatal is not None:
            raise RunFailed(fatal_oom_message(fatal))
        previous = load_run_state(run_state_path(run_dir)) if run_dir is not None else None
        local = min([planned_micro_batch] + ([previous.micro_batch] if previous else [])
                    + [r.halved for r in records])
        agreed = agree_micro_batch(local, group)        # every rank read the records before this collective
        reductions = (previous.reductions if previous else []) + \
            ([reduction_after(records, max(r.micro_batch for r in records))] if records else [])
        auto = cls(agreed, rank, run_dir, log)
        auto.reductions = reductions
        if records:
            auto.log(f"[autobatch] restarted after an OOM on {len({r.rank for r in records})} rank(s) at step "
                     f"{min(r.step for r in records)} ({records[0].phase}): micro-batch -> {agreed} on every rank")
        auto.persist()
        if records and rank == 0 and run_dir is not None:
            clear_oom_records(run_dir)
        auto.log(f"[autobatch] rank {rank}: planned micro-batch {planned_micro_batch}, resumed/local {local}, "
                 f"agreed {auto.micro_batch}")
        return auto

    def persist(self) -> None:
        if self.state_path is not None and self.rank == 0:
            save_run_state(self.state_path, RunState(self.micro_batch, self.reductions))

    def guard(self, step: int, phase: Callable[[], str]) -> "OomGuard":
        """Around one step: an OOM inside it is recorded with the phase the step had reached (`phase()`: the
        rank's progress mark, dflash.train.supervisor.heartbeat) and ends this rank (OomRestart)."""
        return OomGuard(self, step, phase)

    def record_oom(self, step: int, phase: str, error: BaseException) -> OomRecord:
        record = OomRecord(self.rank, step, self.micro_batch, phase, str(error).splitlines()[0][:300] if str(error) else "")
        if self.run_dir is not None:
            write_oom_record(self.run_dir, record)
        self.log(f"[autobatch] rank {self.rank}: out of memory at step {step}, micro-batch {self.micro_batch} "
                 f"({phase}); every rank restarts from the last checkpoint at micro-batch "
                 f"{max(1, record.halved)}" + ("" if record.micro_batch > 1 else " -- not possible: micro-batch 1"))
        return record


class OomRestart(SystemExit):
    """This rank ran out of memory and recorded it; it exits with OOM_EXIT_CODE for a restart."""

    def __init__(self, record: OomRecord):
        super().__init__(OOM_EXIT_CODE)
        self.record = record


class OomGuard:
    """Context manager of one step: turns torch.OutOfMemoryError into a record and OomRestart. The
    phase it names is the last one the step reached."""

    def __init__(self, auto: AutoBatch, step: int, phase: Callable[[], str]):
        self.auto, self.step, self.phase = auto, step, phase

    def __enter__(self) -> "OomGuard":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: object) -> None:
        import torch

        if error is None or not isinstance(error, torch.OutOfMemoryError):
            return
        raise OomRestart(self.auto.record_oom(self.step, self.phase(), error)) from None

