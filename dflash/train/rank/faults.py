"""Fault injection for tests and drills: a debugging option, never part of a plain run.

A rank reads DFLASH_INJECT_OOM, DFLASH_INJECT_STALL and DFLASH_FAIL_RANK once, at its start
(`FaultInjection.from_env`; a bad value is a ConfigError naming the valid forms). When one is set,
the injection listens to the step's phase marks (dflash.train.supervisor.heartbeat.RankProgress)
and, for the points inside torch's own work, installs a hook at the start of the drafter's backward
(`backward`) and an observer of FSDP2's reduce-scatter (`sync`). With none set nothing is installed
(tests/train/test_plain_run.py counts the hooks). Forms and phases: docs/oom-recovery.md "Fault
injection", docs/processes.md "Fault injection".
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from launcher_core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from dflash.train.supervisor.heartbeat import RankProgress

INJECT_ENV = "DFLASH_INJECT_OOM"
STALL_ENV = "DFLASH_INJECT_STALL"
FAIL_RANK_ENV = "DFLASH_FAIL_RANK"
OOM_POINTS = ("forward", "backward", "sync", "optimizer")          # where an injected OOM can fire
STALL_POINTS = ("data", "forward", "backward", "reduction", "update")
RECORDED_PHASE = {"forward": "forward", "backward": "backward", "sync": "backward", "optimizer": "update"}
# the progress mark each point fires at; backward and sync fire inside torch's work instead
MARKED_AT = {"forward": "forward", "optimizer": "update", "data": "data", "reduction": "reduction", "update": "update"}


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


@dataclass
class StallInjector:
    """Sleeps `seconds` on a chosen rank at a point of a step (every step without `step`)."""

    phase: str
    seconds: float
    rank: int | None = None
    step: int | None = None

    def check(self, rank: int, step: int, phase: str) -> None:
        if phase == self.phase and self.rank in (None, rank) and self.step in (None, step):
            time.sleep(self.seconds)


def parse_injection(text: str) -> list[OomInjector]:
    """`rank=1,step=3` / `rank=1,above=2` / `...,phase=optimizer`, several separated by `;` ("" -> none)."""
    return [_oom_injector(_fields(part.strip(), text, INJECT_ENV, ("rank", "step", "above", "phase")), text)
            for part in text.split(";") if part.strip()]


def parse_stalls(text: str) -> list[StallInjector]:
    """`rank=1,step=3,phase=backward,seconds=600`, several separated by `;` ("" -> none)."""
    return [_stall_injector(_fields(part.strip(), text, STALL_ENV, ("rank", "step", "phase", "seconds")), text)
            for part in text.split(";") if part.strip()]


def _fields(spec: str, text: str, variable: str, keys: tuple[str, ...]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in keys:
            raise ConfigError(f"{variable}={text!r}: {item!r} is not one of " + ", ".join(f"{k}=..." for k in keys))
        fields[key.strip()] = value.strip()
    return fields


def _numbers(fields: dict[str, str], text: str, variable: str) -> dict[str, float]:
    try:
        return {key: float(value) for key, value in fields.items() if key != "phase"}
    except ValueError:
        raise ConfigError(f"{variable}={text!r}: {', '.join(k for k in fields if k != 'phase')} take numbers") from None


def _whole(numbers: dict[str, float], key: str) -> int | None:
    return int(numbers[key]) if key in numbers else None


def _oom_injector(fields: dict[str, str], text: str) -> OomInjector:
    numbers = _numbers(fields, text, INJECT_ENV)
    injector = OomInjector(rank=_whole(numbers, "rank"), step=_whole(numbers, "step"), above=_whole(numbers, "above"),
                           phase=fields.get("phase", "forward"))
    if injector.phase not in OOM_POINTS:
        raise ConfigError(f"{INJECT_ENV}={text!r}: phase must be forward, backward, sync or optimizer")
    if injector.step is None and injector.above is None:
        raise ConfigError(f"{INJECT_ENV}={text!r}: say when: step=N or above=N")
    return injector


def _stall_injector(fields: dict[str, str], text: str) -> StallInjector:
    numbers = _numbers(fields, text, STALL_ENV)
    phase = fields.get("phase", "forward")
    if phase not in STALL_POINTS:
        raise ConfigError(f"{STALL_ENV}={text!r}: phase must be one of {', '.join(STALL_POINTS)}")
    if "seconds" not in numbers:
        raise ConfigError(f"{STALL_ENV}={text!r}: say how long: seconds=N")
    return StallInjector(phase, numbers["seconds"], _whole(numbers, "rank"), _whole(numbers, "step"))


def parse_fail_rank(text: str) -> Optional[tuple[int, int, Optional[int]]]:
    """`RANK:STEP` or `RANK:STEP:ATTEMPT` -> (rank, step, attempt or None); "" -> None."""
    if not text:
        return None
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise ConfigError(f"{FAIL_RANK_ENV}={text!r}: write RANK:STEP or RANK:STEP:ATTEMPT (whole numbers)")
    return int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else None


@dataclass
class FaultInjection:
    """The injections one rank runs (`from_env`); `install` ties them to the rank's progress marks."""

    rank: int
    ooms: list[OomInjector] = field(default_factory=list)
    stalls: list[StallInjector] = field(default_factory=list)
    fail_at: Optional[tuple[int, int, Optional[int]]] = None
    attempt: int = 0
    micro_batch: Callable[[], int] = lambda: 1

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] | None = None,
                 recovered: list[dict[str, int | str]] | None = None) -> Optional["FaultInjection"]:
        """None when no switch is set. A `step=` OOM injection does not fire again once the run recovered
        from it (autobatch.json records a reduction at that step and the phase it records: `recovered`), so
        a drill shows the restart resuming cleanly, and several injections can fire one after another."""
        variables = environ if environ is not None else os.environ
        ooms = parse_injection(variables.get(INJECT_ENV, ""))
        stalls = parse_stalls(variables.get(STALL_ENV, ""))
        fail_at = parse_fail_rank(variables.get(FAIL_RANK_ENV, ""))
        if not (ooms or stalls or fail_at):
            return None
        done = {(r.get("step"), r.get("phase")) for r in recovered or []}
        for injector in ooms:
            injector.fired = (injector.step, RECORDED_PHASE[injector.phase]) in done
        return cls(rank, ooms, stalls, fail_at, int(variables.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def install(self, progress: RankProgress, drafter: nn.Module, micro_batch: Callable[[], int]) -> None:
        """Listen to the rank's phase marks; hook the drafter only for the points inside torch's work."""
        self.micro_batch = micro_batch
        progress.listeners.append(self.at_mark)
        points = {i.phase for i in self.ooms} | {s.phase for s in self.stalls}
        if "backward" in points:
            drafter.register_full_backward_pre_hook(lambda _module, _grads: self.inside("backward", progress.step))
        if "sync" in points:
            from dflash.train.rank.parallel import observe_reductions

            observe_reductions(drafter, lambda: self.inside("sync", progress.step), lambda: None)

    def at_mark(self, phase: str, step: int) -> None:
        if phase == "data" and self.fail_at is not None:
            rank, at, attempt = self.fail_at
            if rank == self.rank and at == step and attempt in (None, self.attempt):
                raise RuntimeError(f"injected failure on rank {self.rank} at step {step} ({FAIL_RANK_ENV})")
        for point, marked in MARKED_AT.items():
            if marked == phase:
                self.inside(point, step)

    def inside(self, point: str, step: int) -> None:
        for stall in self.stalls:
            stall.check(self.rank, step, point)
        for injector in self.ooms:
            injector.check(self.rank, step, self.micro_batch(), point)
