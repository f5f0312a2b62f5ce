"""Runtime side of the memory budgets: agreement, OOM recovery, the persisted micro-batch, and the
fault-injection switch. Used inside torchrun workers.

The collective sequence of one optimizer step is the same on every rank whatever happens:

    all_reduce(SUM) of the step's loss weight      (global_weight: data only, cannot OOM)
    forward/backward of each micro-batch           (no collectives: do not let DDP sync here)
    all_reduce(MIN) of an ok flag                  (did every rank get through?)
    either  the gradient sum (all_reduce SUM, bucket by bucket) + optimizer.step
    or      every rank drops its gradients, halves the micro-batch and redoes the step

so a rank that runs out of memory can never leave the others waiting in a different collective.
Gradients are summed by `dflash.train.dist.prepare_gradient_sum` + `GradientSum.run` (not by DDP
hooks, which would fire inside the backward of whichever rank got furthest). The sum's one
allocation (its bucket-sized staging buffer) is made inside the guarded region, after the
backward and before the ok flag; its collectives run after every rank said ok and allocate
nothing. So an OOM of the sum is agreed on and recovered from like an OOM of the backward. Because the loss of each micro-batch is divided by the
GLOBAL weight of the step, the summed gradient does not depend on how the batch was split.

Fault injection (off by default), for CPU tests and drills on real nodes:

    DFLASH_INJECT_OOM="rank=1,step=3"      rank 1 raises torch.OutOfMemoryError at the first injection
                                           point of step 3 (once; not again after a torchrun restart)
    DFLASH_INJECT_OOM="rank=1,above=2"     rank 1 raises it in every forward with micro-batch > 2
    DFLASH_INJECT_OOM="rank=0,step=5,phase=optimizer"   ... inside optimizer.step (fatal by design)
    DFLASH_INJECT_OOM="rank=1,step=3,phase=sync"        ... inside the gradient sum (as it allocates its bucket)

`rank` may be omitted (every rank); the trainer calls `injector.check(step, micro_batch, phase)`.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from dflash.train.dist import DEFAULT_GRAD_BUCKET_MIB, GradientSum, agree_micro_batch, count_failed, prepare_gradient_sum
from launcher_core.errors import ConfigError, RunFailed

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

Reduction = dict[str, int | str]      # one halving, as autobatch.json keeps it: step, from, to, failed_ranks, at

INJECT_ENV = "DFLASH_INJECT_OOM"
RUN_STATE_NAME = "autobatch.json"
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


def parse_injection(text: str) -> OomInjector | None:
    """`rank=1,step=3` / `rank=1,above=2` / `...,phase=optimizer` -> OomInjector ("" -> None)."""
    if not text.strip():
        return None
    fields: dict[str, str] = {}
    for item in text.split(","):
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


def injector_from_env(environ: Mapping[str, str] | None = None) -> OomInjector | None:
    """The switch from the environment; a `step=` injection does not fire again after a torchrun
    restart (TORCHELASTIC_RESTART_COUNT > 0), so a drill shows the restart resuming cleanly."""
    variables = environ if environ is not None else os.environ
    injector = parse_injection(variables.get(INJECT_ENV, ""))
    if injector is not None and int(variables.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        injector.fired = True
    return injector


# --- run state (the agreed micro-batch, persisted) ----------------------------------------

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


# --- OOM recovery -------------------------------------------------------------------------

@dataclass(frozen=True)
class StepOutcome:
    micro_batch: int                    # the micro-batch the step finally ran at
    attempts: int                       # 1 when nothing ran out of memory


def _attempt(work: Callable[[], None]) -> bool:
    """Run `work`; False if it ran out of memory. Nothing is cleaned up inside the except block:
    the exception's traceback pins the failed step's tensors until the block is left."""
    import torch

    try:
        work()
        return True
    except torch.OutOfMemoryError:
        pass
    return False


def release_memory(optimizer: torch.optim.Optimizer) -> None:
    """Drop every gradient and hand cached blocks back (after leaving the except block)."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class AutoBatch:
    """One agreed micro-batch for all ranks, halved together when any rank runs out of memory.

    Usage in a worker (after init_process_group):

        auto = AutoBatch.start(plan.micro_batch, state_path, rank)   # agree + resume + persist
        for step in ...:
            outcome = auto.run_step(step, accumulate, optimizer, update)
        # accumulate(micro_batch): all forward/backward calls of the step (share split into
        # micro-batches), each loss divided by global_weight(...); calls auto.inject("forward")
        # update(): clip + optimizer.step + scheduler.step (default optimizer.step)
        # the gradients of the optimizer's parameters are summed over the ranks in between
        # (buckets of grad_bucket_mib, train.grad_bucket_mib)
    """

    def __init__(self, micro_batch: int, rank: int, state_path: str | Path | None = None,
                 group: ProcessGroup | None = None,
                 injector: OomInjector | None = None, log: Callable[[str], None] | None = None,
                 grad_bucket_mib: float = DEFAULT_GRAD_BUCKET_MIB):
        self.micro_batch = micro_batch
        self.grad_bucket_mib = grad_bucket_mib
        self.rank = rank
        self.state_path = Path(state_path) if state_path else None
        self.group = group
        self.injector = injector
        self.log = log or (lambda line: print(line, flush=True))
        self.reductions: list[Reduction] = []
        self.step = 0

    @classmethod
    def start(cls, planned_micro_batch: int, state_path: str | Path | None, rank: int,
              group: ProcessGroup | None = None,
              injector: OomInjector | None = None, log: Callable[[str], None] | None = None,
              grad_bucket_mib: float = DEFAULT_GRAD_BUCKET_MIB) -> "AutoBatch":
        """Resume from the persisted micro-batch (never above it), agree on the minimum, persist."""
        local = resume_micro_batch(planned_micro_batch, state_path) if state_path else planned_micro_batch
        previous = load_run_state(state_path) if state_path else None
        auto = cls(agree_micro_batch(local, group), rank, state_path, group,
                   injector if injector is not None else injector_from_env(), log, grad_bucket_mib)
        auto.reductions = previous.reductions if previous else []
        auto.persist()
        auto.log(f"[autobatch] rank {rank}: planned micro-batch {planned_micro_batch}, "
                 f"resumed/local {local}, agreed {auto.micro_batch}")
        return auto

    def inject(self, phase: str = "forward") -> None:
        """The fault-injection point (no-op unless DFLASH_INJECT_OOM is set)."""
        if self.injector is not None:
            self.injector.check(self.rank, self.step, self.micro_batch, phase)

    def persist(self) -> None:
        if self.state_path is not None and self.rank == 0:
            save_run_state(self.state_path, RunState(self.micro_batch, self.reductions))

    def run_step(self, step: int, accumulate: Callable[[int], None], optimizer: torch.optim.Optimizer,
                 update: Callable[[], None] | None = None) -> StepOutcome:
        """Forward/backward and the gradient sum at the agreed micro-batch, halving on all ranks
        until every rank gets through; then update once."""
        self.step = step
        attempts = 1
        while not self._all_got_through(accumulate, optimizer):
            self._halve(step)
            attempts += 1
        self._update(step, optimizer, update or optimizer.step)
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(self.micro_batch, attempts)

    def _all_got_through(self, accumulate: Callable[[int], None], optimizer: torch.optim.Optimizer) -> bool:
        """Guarded: the forward/backward calls and the gradient sum's allocation; then one ok flag
        (all_reduce); only when every rank got through, the sum's collectives (no allocation)."""
        prepared: list[GradientSum] = []

        def work() -> None:
            accumulate(self.micro_batch)
            prepared.append(self.prepare_sum(optimizer))

        ok = _attempt(work)
        if not ok:
            self.log(f"[autobatch] rank {self.rank}: out of memory at step {self.step}, micro-batch {self.micro_batch}")
        failed = count_failed(ok, self.group)
        self._last_failed = failed
        if failed:
            prepared.clear()                    # the staging buffer of a rank that got through
            release_memory(optimizer)
            return False
        prepared[0].run()
        return True

    def prepare_sum(self, optimizer: torch.optim.Optimizer) -> GradientSum:
        """The gradient sum of the optimizer's parameters, its staging buffer allocated (the
        fault-injection point `sync` fires just before that allocation)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return prepare_gradient_sum(params, self.group, self.grad_bucket_mib, lambda: self.inject("sync"))

    def _halve(self, step: int) -> None:
        if self.micro_batch <= 1:
            raise RunFailed(f"step {step}: out of memory at micro-batch 1 on {self._last_failed} rank(s); one "
                            f"sequence does not fit: lower data.max_length or train.num_anchors, or free GPU memory")
        before, self.micro_batch = self.micro_batch, self.micro_batch // 2
        self.reductions.append({"step": step, "from": before, "to": self.micro_batch,
                                "failed_ranks": self._last_failed, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        self.persist()
        self.log(f"[autobatch] rank {self.rank}: step {step}: {self._last_failed} rank(s) out of memory -> "
                 f"micro-batch {before} -> {self.micro_batch} on every rank; gradients dropped, step redone")

    def _update(self, step: int, optimizer: torch.optim.Optimizer, update: Callable[[], None]) -> None:
        def guarded() -> None:
            self.inject("optimizer")
            update()

        if not _attempt(guarded):
            raise RunFailed(f"rank {self.rank}, step {step}: out of memory inside optimizer.step; optimizer "
                            f"states are allocated lazily at the first update, so shrinking the micro-batch "
                            f"cannot help: raise memory.margin (or memory.overhead_mib) so the plan leaves "
                            f"room for them, free the GPU, or train fewer drafter layers")
