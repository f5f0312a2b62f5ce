"""A rank alive but stuck, named by its progress (the launcher's side of dflash.train.supervisor.heartbeat).

Training is synchronous: every rank runs the same collectives in the same order, so a rank that stops
making progress (a hung collective, a deadlocked loader, a kernel that never returns) soon holds every
other rank in a collective. The run is stuck when no rank of this node has entered a new phase for
longer than that phase's bound (`StuckBound`): `train.stuck_after_steps` times the measured step time
(for the phases of a step) or the longest such phase seen so far (a save, a validation pass), never
below `train.stuck_floor_s`. A phase never timed yet (the start, the first save) has no bound: the
process group's timeout (`train.collective_timeout_s`) guards it.

The rank to blame (`find_stuck`) is, in this order: one whose heartbeat stopped (its process is
stopped); one behind the others (an earlier step, or fewer collectives entered, from torch's flight
recorder); one that is not inside a collective while the others wait in one (read from each rank's
Python stack). When every rank waits in the same collective at the same count, the collective itself
does not complete (on CUDA, the NCCL flight recorder's dumps in train/failures/ say more), and no rank
is blamed. Before the launcher stops a stuck run it asks every rank for its dumps (`request_dumps`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash.train.supervisor.heartbeat import (
    DUMP_REQUEST,
    FLIGHT_RECORDER_PREFIX,
    STACKS_SIGNAL,
    STEP_PHASES,
    RankRecord,
    failures_dir,
    flight_recorder_dir,
    nccl_dump_pipe,
    nccl_flight_recorder_dir,
    process_state,
    rank_records,
    ranks_dir,
    stacks_path,
)
from launcher_core.fileio import write_text_atomic

DUMP_WAIT_S = 5.0            # how long the launcher waits for the ranks' stack dumps before it stops them
STALE_BEATS = 3              # a record older than this many beat intervals: its heartbeat thread does not run


@dataclass(frozen=True)
class StuckBound:
    """How long a phase may last before the run counts as stuck: max(floor_s, steps x the measured
    duration), None while the phase has not been timed."""

    floor_s: float
    steps: float

    def seconds(self, phase: str, records: list[RankRecord]) -> Optional[float]:
        measured = measured_s(phase, records)
        return None if measured is None else max(self.floor_s, self.steps * measured)

    def describe(self, phase: str, records: list[RankRecord]) -> str:
        measured = measured_s(phase, records)
        what = "step" if phase in STEP_PHASES else f"longest {phase}"
        return (f"{self.steps:g} x the {measured:.1f} s {what}, at least train.stuck_floor_s = {self.floor_s:g} s"
                if measured is not None else "not timed yet")


def plan_figures(floor_s: float, steps: float, collective_timeout_s: float, heartbeat_timeout_s: float) -> dict[str, object]:
    """What `plan` says of a rank alive but stuck (the figures and one line)."""
    line = (f"stuck rank: named after max({floor_s:g} s, {steps:g} x the measured step) without progress "
            f"(train.stuck_floor_s, train.stuck_after_steps), before the {collective_timeout_s:g} s collective "
            f"timeout; a rank silent {heartbeat_timeout_s:g} s is named stopped; every rank's stacks and "
            f"flight recorder go to train/failures/")
    return {"floor_s": floor_s, "after_steps": steps, "collective_timeout_s": collective_timeout_s,
            "heartbeat_timeout_s": heartbeat_timeout_s, "line": line}


def measured_s(phase: str, records: list[RankRecord]) -> Optional[float]:
    """A step phase: the ranks' median step time (the largest of them); another phase: the longest time
    any rank has spent in it so far. None when nothing has been measured."""
    if phase in STEP_PHASES:
        times = [float(r.progress["step_s"]) for r in records if r.progress.get("step_s")]
    else:
        times = [float((r.progress.get("longest") or {}).get(phase, 0.0)) for r in records]
        times = [t for t in times if t > 0]
    return max(times) if times else None


@dataclass(frozen=True)
class Stuck:
    """The run made no progress for longer than the bound; `rank` is the one to blame (None: none is)."""

    rank: Optional[int]
    pid: Optional[int]
    where: str               # "its backward at step 3"
    quiet_s: float           # how long the blamed rank (or every rank) has made no progress
    bound: str               # how the bound was derived
    reason: str              # why this rank: stopped, behind, not in a collective; or what all wait in

    def describe(self) -> str:
        if self.rank is None:
            return f"no rank made progress for {self.quiet_s:.0f} s ({self.bound}): {self.reason}"
        return (f"rank {self.rank} (pid {self.pid}) is stuck in {self.where}: no progress for {self.quiet_s:.0f} s "
                f"(bound: {self.bound}); {self.reason}")


def quiet_s(record: RankRecord, now: float) -> float:
    return now - float(record.progress.get("since", now))


def beat_stale(record: RankRecord, now: float) -> bool:
    beat = record.last_beat()
    interval = float(record.progress.get("interval", 1.0))
    return beat is None or now - beat > STALE_BEATS * interval + 1.0


HELD = ("stopped", "tracing-stop")


def halted(record: RankRecord, now: float) -> bool:
    """Its process is held (SIGSTOP, a debugger) or its heartbeat thread no longer runs."""
    return process_state(record.pid) in HELD or beat_stale(record, now)


def entered(record: RankRecord) -> int:
    """Collectives this rank has entered, over all its process groups (0 without a flight recorder)."""
    return sum(int(seq) for seq in (record.progress.get("collectives") or {}).values())


def find_stuck(run_dir: Path, bound: StuckBound, now: Optional[float] = None) -> Optional[Stuck]:
    """The stuck rank of this node's run (module docstring), None while the run progresses."""
    now = time.time() if now is None else now
    records = [r for r in rank_records(run_dir, socket.gethostname()) if process_state(r.pid) is not None]
    attempt = max((r.attempt for r in records), default=0)
    records = [r for r in records if r.attempt == attempt]
    if len(records) < 2:
        return None
    for record in records:
        limit = bound.seconds(record.phase, records)
        if limit is None or quiet_s(record, now) <= limit:
            return None
    return blame(records, bound, now)


def blame(records: list[RankRecord], bound: StuckBound, now: float) -> Stuck:
    """The rank that holds the others (module docstring), or none."""
    def key(r: RankRecord) -> tuple[bool, int, int, bool, int]:
        return (not halted(r, now), r.step, entered(r), bool(r.progress.get("waiting")), r.rank)

    ordered = sorted(records, key=key)
    first, rest = ordered[0], ordered[1:]
    reason = blame_reason(first, rest, now)
    if reason is None:
        waits = sorted({str(r.progress.get("waiting") or "its own work") for r in records})
        return Stuck(None, None, first.where(), min(quiet_s(r, now) for r in records),
                     bound.describe(first.phase, records),
                     f"every rank of this node is in {first.where()} at the same collective count, waiting in "
                     f"{', '.join(waits)}: the collective itself does not complete (or the rank that holds it is "
                     f"on another node)")
    return Stuck(first.rank, first.pid, first.where(), quiet_s(first, now), bound.describe(first.phase, records), reason)


def blame_reason(first: RankRecord, rest: list[RankRecord], now: float) -> Optional[str]:
    """Why `first` holds the others, or None when nothing sets it apart."""
    others = ", ".join(f"rank {r.rank}" for r in rest)
    waiting = [f"rank {r.rank} waits in {r.progress['waiting']}" for r in rest if r.progress.get("waiting")]
    waits = f" ({'; '.join(waiting)})" if waiting else ""
    if halted(first, now):
        state = process_state(first.pid) or "gone"
        return (f"its process is {state}" + (" (SIGSTOP, Ctrl-Z or a debugger holds it)" if state in HELD else
                                             ": its heartbeat thread does not run either") + waits)
    if any(r.step > first.step for r in rest):
        return f"it is behind: {others} reached a later step{waits}"
    if any(entered(r) > entered(first) for r in rest):
        return f"it has entered {entered(first)} collectives, {others} {max(entered(r) for r in rest)}{waits}"
    if not first.progress.get("waiting") and waiting:
        return f"it is not inside a collective while the others wait for it{waits}"
    return None


def request_dumps(run_dir: Path, wait_s: float = DUMP_WAIT_S) -> list[Path]:
    """Every live rank of this node dumps every thread's Python stack (STACKS_SIGNAL, faulthandler) and its
    flight recorder (its heartbeat thread, DUMP_REQUEST); a NCCL rank's monitor thread also dumps NCCL's recorder
    into train/failures/nccl-flight-recorder/ (its dump pipe, `ask_nccl_dump`), which needs no GIL. A stopped rank
    is continued so it can (it is killed right after, with the rest). The stacks are copied to
    train/failures/stacks-rank-R.txt; returns those written within `wait_s`."""
    request = ranks_dir(run_dir) / DUMP_REQUEST
    request.parent.mkdir(parents=True, exist_ok=True)
    asked = time.time()
    request.write_text(f"{asked}\n", encoding="utf-8")
    records = [r for r in rank_records(run_dir, socket.gethostname()) if process_state(r.pid) is not None]
    sizes = {r.rank: _size(stacks_path(run_dir, r.rank)) for r in records}
    for record in records:
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, STACKS_SIGNAL)
            if process_state(record.pid) in HELD:
                os.kill(record.pid, signal.SIGCONT)
    piped = {r.rank for r in records if ask_nccl_dump(run_dir, r.rank)}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_dumped(run_dir, r.rank, sizes[r.rank]) and
                                                  _recorder_dumped(run_dir, r, asked) and
                                                  (r.rank not in piped or _nccl_dumped(run_dir, r.rank, asked))
                                                  for r in records):
        time.sleep(0.1)
    time.sleep(0.2)                   # a dump under way ends
    return [copy_stacks(run_dir, r.rank, sizes[r.rank]) for r in records if _dumped(run_dir, r.rank, sizes[r.rank])]


def ask_nccl_dump(run_dir: Path, rank: int) -> bool:
    """Write the rank's NCCL dump pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE, the launcher's: a FIFO its NCCL monitor
    thread reads about once a second and answers with a dump of NCCL's flight recorder). False where there is
    none: a gloo rank, or a rank whose process group has not started (nobody reads the FIFO)."""
    path = nccl_dump_pipe(run_dir, rank)
    try:
        if not stat.S_ISFIFO(path.stat().st_mode):
            return False
        descriptor = os.open(path, os.O_WRONLY | os.O_NONBLOCK)     # ENXIO at once where nobody reads it
    except OSError:
        return False
    try:
        os.write(descriptor, b"dump\n")
    except OSError:
        return False
    finally:
        os.close(descriptor)
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _dumped(run_dir: Path, rank: int, before: int) -> bool:
    return _size(stacks_path(run_dir, rank)) > before


def _recorder_dumped(run_dir: Path, record: RankRecord, asked: float) -> bool:
    """Its flight recorder's dump is written, or it has none (no collective recorded)."""
    if not record.progress.get("collectives"):
        return True
    try:
        return (flight_recorder_dir(run_dir) / f"{FLIGHT_RECORDER_PREFIX}{record.rank}").stat().st_mtime >= asked - 1.0
    except OSError:
        return False


def _nccl_dumped(run_dir: Path, rank: int, asked: float) -> bool:
    try:
        return (nccl_flight_recorder_dir(run_dir) / f"{FLIGHT_RECORDER_PREFIX}{rank}").stat().st_mtime >= asked - 1.0
    except OSError:
        return False


def copy_stacks(run_dir: Path, rank: int, before: int) -> Path:
    """The new part of the rank's stacks file, as train/failures/stacks-rank-R.txt."""
    source = stacks_path(run_dir, rank)
    with source.open("rb") as handle:
        handle.seek(before)
        dump = handle.read().decode("utf-8", errors="replace")
    target = failures_dir(run_dir) / f"stacks-rank-{rank}.txt"
    write_text_atomic(target, f"# rank {rank}: every thread's Python stack when the launcher stopped the run "
                              f"(faulthandler; most recent call first)\n{dump}")
    return target
