"""Runtime side of the memory budgets: the agreed micro-batch, OOM recovery by restart, and the
fault-injection switch. Used inside torchrun workers.

Under FSDP2 (dflash.train.sharding) the drafter's collectives run INSIDE its forward and
backward: an all-gather before each unit's forward (and again before its backward), a
reduce-scatter as each unit's backward ends, an all-reduce in gradient clipping. A rank that runs
out of memory inside one of them never reaches a later agreement point, while the other ranks wait
in the collective it left. So no rank tries to recover in place. Instead:

    a rank that runs out of memory anywhere in a step (forward, backward, the gradient reduction,
    the update) writes an OOM record (`train/autobatch/oom-rank-R.json`: step, micro-batch,
    phase) and exits with OOM_EXIT_CODE; the others fail in the collective it left (or are
    stopped by torchrun's agent);
    the launcher (dflash.train.launch) sees the record and starts every rank again with --resume
    (as torchrun's own --max-restarts would: the record is read the same way);
    at start (`AutoBatch.start`) every rank reads the records, takes half the micro-batch that ran
    out of memory (never above the persisted or planned one), the ranks agree on the smallest
    (all_reduce MIN), rank 0 persists it in `train/autobatch.json` with the reduction, and
    training continues from the last complete checkpoint at that micro-batch.

Nothing done is lost beyond the steps since the last checkpoint, which are recomputed (and their
metrics lines rewritten, never counted twice: dflash.train.worker.truncate_metrics). Because the
loss of each micro-batch is divided by the GLOBAL weight of the step, the recomputed steps give
the same gradients at the smaller micro-batch. An OOM at micro-batch 1 cannot be recovered from
by halving: the record says so and the restart fails with what to change.

Fault injection (off by default), for CPU tests and drills on real nodes:

    DFLASH_INJECT_OOM="rank=1,step=3"      rank 1 raises torch.OutOfMemoryError at the first injection
                                           point of step 3 (once; not again after a restart)
    DFLASH_INJECT_OOM="rank=1,above=2"     rank 1 raises it in every forward with micro-batch > 2
    DFLASH_INJECT_OOM="rank=0,step=5,phase=optimizer"   ... inside the update
    DFLASH_INJECT_OOM="rank=1,step=3,phase=sync"        ... inside the gradient reduction (FSDP2's reduce-scatter)
    DFLASH_INJECT_OOM="rank=1,step=3,phase=backward"    ... inside a draft layer's backward
    DFLASH_INJECT_OOM="rank=1,step=2;rank=0,step=3,phase=sync"   several, one after another

`rank` may be omitted (every rank); the trainer calls `AutoBatch.inject(phase)`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from dflash.train.dist import agree_micro_batch
from launcher_core.errors import ConfigError, RunFailed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Reduction = dict[str, int | str]      # one halving, as autobatch.json keeps it: step, from, to, failed_ranks, phase, at

INJECT_ENV = "DFLASH_INJECT_OOM"
RUN_STATE_NAME = "autobatch.json"
OOM_RECORDS_DIR = "autobatch"
OOM_EXIT_CODE = 75                    # a rank ran out of memory and recorded it: restart at a smaller micro-batch
PHASES = ("forward", "backward", "sync", "optimizer")     # where an injected OOM can fire


# --- fault injection ----------------------------------------------------------------------

@dataclass
class OomInjector:
    """Raises torch.OutOfMemoryError on a chosen rank, at a step or above a micro-batch size."""

    rank: int | None = None
    step: int | None = None
    above: int | None = None
    phase: str = "forward"
    fired: bool = False

    def check(self, rank: int, step: int, micro_batch: int, phase: str = "forward") -> None:
        if not self._due(rank, step, micro_batch, phase):
            return
        import torch

        self.fired = True
        raise torch.OutOfMemoryError(f"injected by {INJECT_ENV} (rank {rank}, step {step}, "
                                     f"micro-batch {micro_batch}, {phase})")

    def _due(self, rank: int, step: int, micro_batch: int, phase: str) -> bool:
        if phase != self.phase or (self.rank is not None and rank != self.rank):
            return False
        if self.above is not None and micro_batch > self.above:
            return True
        return self.step is not None and step == self.step and not self.fired


def parse_injection(text: str) -> list[OomInjector]:
    """`rank=1,step=3` / `rank=1,above=2` / `...,phase=optimizer`, several separated by `;` ("" -> none)."""
    return [_parse_one(part.strip(), text) for part in text.split(";") if part.strip()]


def _parse_one(spec: str, text: str) -> OomInjector:
    fields: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("rank", "step", "above", "phase"):
            raise ConfigError(f"{INJECT_ENV}={text!r}: {item!r} is not one of rank=N, step=N, above=N, "
                              f"phase=forward|backward|sync|optimizer")
        fields[key.strip()] = value.strip()
    return _injector_from_fields(fields, text)


def _injector_from_fields(fields: dict[str, str], text: str) -> OomInjector:
    try:
        numbers = {key: int(value) for key, value in fields.items() if key != "phase"}
    except ValueError:
        raise ConfigError(f"{INJECT_ENV}={text!r}: rank, step and above take integers") from None
    injector = OomInjector(rank=numbers.get("rank"), step=numbers.get("step"), above=numbers.get("above"),
                           phase=fields.get("phase", "forward"))
    if injector.phase not in PHASES:
        raise ConfigError(f"{INJECT_ENV}={text!r}: phase must be forward, backward, sync or optimizer")
    if injector.step is None and injector.above is None:
        raise ConfigError(f"{INJECT_ENV}={text!r}: say when: step=N or above=N")
    return injector


def injectors_from_env(environ: Mapping[str, str] | None = None,
                       recovered: list[Reduction] | None = None) -> list[OomInjector]:
    """The switch from the environment. A `step=` injection does not fire again once the run recovered
    from it (autobatch.json records a reduction at that step and phase: `recovered`), so a drill
    shows the restart resuming cleanly, and several injections can fire one after another."""
    variables = environ if environ is not None else os.environ
    injectors = parse_injection(variables.get(INJECT_ENV, ""))
    done = {(r.get("step"), r.get("phase")) for r in recovered or []}
    for injector in injectors:
        injector.fired = (injector.step, injector.phase) in done
    return injectors


# --- run state (the agreed micro-batch, persisted) and OOM records -------------------------

@dataclass
class RunState:
    micro_batch: int
    reductions: list[Reduction] = field(default_factory=list)


@dataclass(frozen=True)
class OomRecord:
    """What a rank that ran out of memory wrote before it exited."""

    rank: int
    step: int
    micro_batch: int
    phase: str
    error: str

    @property
    def halved(self) -> int:
        return self.micro_batch // 2


def run_state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / RUN_STATE_NAME


def oom_records_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / OOM_RECORDS_DIR


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


def write_oom_record(run_dir: str | Path, record: OomRecord) -> Path:
    import dataclasses

    from launcher_core.fileio import write_json_atomic

    return write_json_atomic(oom_records_dir(run_dir) / f"oom-rank-{record.rank}.json",
                             {**dataclasses.asdict(record), "time": time.time()})


def read_oom_records(run_dir: str | Path) -> list[OomRecord]:
    """Every rank's OOM record not yet taken into autobatch.json (a damaged one is skipped: its rank
    will run out of memory again and write it anew)."""
    import json

    records = []
    for path in sorted(oom_records_dir(run_dir).glob("oom-rank-*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            records.append(OomRecord(int(document["rank"]), int(document["step"]), int(document["micro_batch"]),
                                     str(document["phase"]), str(document.get("error", ""))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def clear_oom_records(run_dir: str | Path) -> None:
    for path in oom_records_dir(run_dir).glob("oom-rank-*.json"):
        path.unlink(missing_ok=True)


def reduction_after(records: list[OomRecord], micro_batch: int) -> Reduction:
    """The halving the records ask for, as autobatch.json keeps it."""
    first = min(records, key=lambda r: (r.step, r.rank))
    return {"step": first.step, "from": micro_batch, "to": min(r.halved for r in records),
            "failed_ranks": len({r.rank for r in records}), "phase": first.phase,
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def unrecoverable(records: list[OomRecord]) -> OomRecord | None:
    """A record of an OOM at micro-batch 1: halving cannot help."""
    return next((r for r in records if r.micro_batch <= 1), None)


def fatal_oom_message(record: OomRecord) -> str:
    phase = record.phase
    advice = ("AdamW's states are allocated at the first update: raise memory.margin (or memory.overhead_mib) so "
              "the plan leaves room for them, free the GPU, or train fewer drafter layers") if phase == "optimizer" else \
        ("one sequence does not fit: lower data.max_length or train.num_anchors, set "
         "train.activation_checkpointing = \"layers\", or free GPU memory")
    return (f"rank {record.rank} ran out of memory at step {record.step}, micro-batch 1 ({phase}): {advice}")


# --- the agreed micro-batch ---------------------------------------------------------------

class AutoBatch:
    """One agreed micro-batch for all ranks; an OOM anywhere in a step ends in a restart of every
    rank at half of it (module docstring).

    Usage in a worker (after init_process_group):

        auto = AutoBatch.start(plan.micro_batch, run_dir, rank)   # records + persisted + agree
        with auto.guard(step):                                    # an OOM inside -> record, exit
            ... the step: auto.inject("forward") etc. at the injection points ...
    """

    def __init__(self, micro_batch: int, rank: int, run_dir: str | Path | None = None,
                 injectors: list[OomInjector] | None = None, log: Callable[[str], None] | None = None):
        self.micro_batch = micro_batch
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.injectors = injectors or []
        self.log = log or (lambda line: print(line, flush=True))
        self.reductions: list[Reduction] = []
        self.step = 0
        self.phase = "forward"          # the last phase of the step reached (named in an OOM record)

    @property
    def state_path(self) -> Path | None:
        return run_state_path(self.run_dir) if self.run_dir is not None else None

    @classmethod
    def start(cls, planned_micro_batch: int, run_dir: str | Path | None, rank: int,
              group: ProcessGroup | None = None, injectors: list[OomInjector] | None = None,
              log: Callable[[str], None] | None = None) -> "AutoBatch":
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
        auto = cls(agreed, rank, run_dir, injectors if injectors is not None else injectors_from_env(recovered=reductions),
                   log)
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

    def inject(self, phase: str = "forward") -> None:
        """The step reached `phase`; the fault-injection point (raises only when DFLASH_INJECT_OOM says so)."""
        self.phase = phase
        for injector in self.injectors:
            injector.check(self.rank, self.step, self.micro_batch, phase)

    def persist(self) -> None:
        if self.state_path is not None and self.rank == 0:
            save_run_state(self.state_path, RunState(self.micro_batch, self.reductions))

    def guard(self, step: int) -> "OomGuard":
        """Around one step: an OOM inside it is recorded and ends this rank (OomRestart)."""
        self.step, self.phase = step, "forward"
        return OomGuard(self)

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
    phase it names is the last one the step reached (`AutoBatch.inject`)."""

    def __init__(self, auto: AutoBatch):
        self.auto = auto

    def __enter__(self) -> "OomGuard":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: object) -> None:
        import torch

        if error is None or not isinstance(error, torch.OutOfMemoryError):
            return
        raise OomRestart(self.auto.record_oom(self.auto.step, self.auto.phase, error)) from None

