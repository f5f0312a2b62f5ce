"""Rank heartbeats: every rank shows that its process runs and how far it has got; the launcher reads them.

Each rank rewrites `train/ranks/rank-R.json` ({rank, pid, host, attempt} and its `RankProgress`: the
step and phase its main thread last entered and since when, its step times, the collective it waits
in, and once quiet for half of train.stuck_floor_s the collectives it entered per process group, from
torch's flight recorder) from a daemon thread every `beat_interval` seconds. The thread beats while
the rank computes or waits in a collective, so the file's age names a rank whose process stopped
(`find_stall`) and its progress one that lives but no longer moves (dflash.train.supervisor.watchdog),
well before the process group's timeout.

Asked by the launcher, a rank writes every thread's stack (faulthandler on STACKS_SIGNAL, which runs
even while the main thread holds the GIL) and its flight recorder's dump (`DUMP_REQUEST`; on NCCL, NCCL's
own recorder, which the launcher also asks NCCL's monitor thread to dump through the rank's dump pipe). The records
also name the run's rank processes (`rank_records`), and a rank whose launcher (`LAUNCHER_PID_ENV`)
has been gone for ORPHAN_GRACE_S kills itself. The rank runs the writer defined here.
"""
from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional, TextIO

RANKS_DIR = "ranks"
LAUNCHER_PID_ENV = "DFLASH_LAUNCHER_PID"
ORPHAN_GRACE_S = 10.0
DUMP_REQUEST = "dump-request"           # the launcher's request for stacks and flight-recorder dumps
STEP_PHASES = ("data", "forward", "backward", "reduction", "update")   # bounded by the measured step time
STEP_TIMES_KEPT = 16
DUMP_POLL_S = 0.5
MARK_WRITE_S = 0.25                    # the least time between two records written for marks
STACKS_SIGNAL = signal.SIGUSR1         # every thread's Python stack into the rank's stacks file (faulthandler)
PhaseListener = Callable[[str, int], None]


def beat_interval(timeout_s: float, stuck_floor_s: Optional[float] = None) -> float:
    """How often a rank beats: several beats per timeout (and per the shortest stuck bound, so the
    launcher's view of a rank's progress is never far behind it), at most every 5 s, at least every 0.2 s."""
    shortest = min(timeout_s / 6.0, stuck_floor_s / 4.0 if stuck_floor_s else timeout_s)
    return max(0.2, min(5.0, shortest))


def ranks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "train" / RANKS_DIR


def failures_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "train" / "failures"


FLIGHT_RECORDER_PREFIX = "rank-"     # torch's fr_trace reads the rank from what follows the prefix


def flight_recorder_dir(run_dir: Path) -> Path:
    """The flight recorder's dumps the launcher asked for: `fr_trace DIR --prefix rank-` reads them."""
    return failures_dir(run_dir) / "flight-recorder"


def nccl_flight_recorder_dir(run_dir: Path) -> Path:
    """Where NCCL's own monitor thread dumps its flight recorder (TORCH_NCCL_DEBUG_INFO_TEMP_FILE: at a
    collective's timeout, and when the launcher writes a rank's dump pipe)."""
    return failures_dir(run_dir) / "nccl-flight-recorder"


def nccl_dump_pipe_stem(run_dir: Path) -> Path:
    """TORCH_NCCL_DEBUG_INFO_PIPE_FILE: ProcessGroupNCCL's monitor thread makes the FIFO `<stem><rank>.pipe`
    and dumps NCCL's flight recorder when anything is written to it (without the GIL)."""
    return ranks_dir(run_dir) / "nccl-dump-rank-"


def nccl_dump_pipe(run_dir: Path, rank: int) -> Path:
    return nccl_dump_pipe_stem(run_dir).with_name(f"{nccl_dump_pipe_stem(run_dir).name}{rank}.pipe")


def stacks_path(run_dir: Path, rank: int) -> Path:
    """Where a rank's faulthandler writes every thread's stack at STACKS_SIGNAL (the launcher copies it
    into train/failures/ when it asked for it)."""
    return ranks_dir(run_dir) / f"rank-{rank}.stacks"


class RankProgress:
    """Where the rank's main thread is: `enter(phase, step)` at each phase of the step (dflash.train.rank.step,
    the worker's loop). Plain attribute writes: the heartbeat thread reads them without a lock (one
    tuple, replaced whole). `listeners` (none in a plain run) are called at every phase: the fault
    injection of tests and drills (dflash.train.rank.faults)."""

    def __init__(self) -> None:
        self.current: tuple[int, str, float] = (0, "start", time.time())     # step, phase, since (epoch s)
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self.longest: dict[str, float] = {}          # the longest time spent in each phase so far
        self.listeners: list[PhaseListener] = []
        self.changed = threading.Event()             # set at every mark: the heartbeat thread writes it promptly
        self._step_began: Optional[float] = None

    @property
    def phase(self) -> str:
        return self.current[1]

    @property
    def step(self) -> int:
        return self.current[0]

    def enter(self, phase: str, step: Optional[int] = None) -> None:
        now = time.time()
        old_step, old_phase, since = self.current
        self.longest[old_phase] = max(self.longest.get(old_phase, 0.0), now - since)
        if step is not None and step != old_step:
            if self._step_began is not None:
                self.step_times.append(now - self._step_began)
            self._step_began = now
        self.current = (old_step if step is None else step, phase, now)
        self.changed.set()
        for listener in self.listeners:
            listener(phase, self.current[0])

    def step_s(self) -> Optional[float]:
        """The median of the last steps' durations (None before one has ended)."""
        return statistics.median(self.step_times) if self.step_times else None


class RankHeartbeat:
    """A rank's heartbeat thread (daemon); `start()` writes the record and begins beating."""

    def __init__(self, run_dir: Path, rank: int, timeout_s: float, launcher_pid: Optional[int] = None,
                 stuck_floor_s: Optional[float] = None):
        self.run_dir, self.path = Path(run_dir), ranks_dir(run_dir) / f"rank-{rank}.json"
        self.rank, self.interval, self.launcher_pid = rank, beat_interval(timeout_s, stuck_floor_s), launcher_pid
        # the flight recorder is read (under the GIL) only once the rank has been quiet this long: while it
        # progresses nobody asks how many collectives it entered
        self.recorder_after_s = stuck_floor_s / 2.0 if stuck_floor_s else 0.0
        self.progress = RankProgress()
        self.identity = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                         "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        self._main = threading.main_thread().ident
        self._dumped_for = 0.0
        self._stacks: Optional[TextIO] = None
        self._thread = threading.Thread(target=self._beat, name="rank-heartbeat", daemon=True)

    @classmethod
    def from_env(cls, run_dir: Path, rank: int, timeout_s: float, stuck_floor_s: Optional[float] = None) -> "RankHeartbeat":
        pid = os.environ.get(LAUNCHER_PID_ENV, "")
        return cls(run_dir, rank, timeout_s, int(pid) if pid.isdigit() else None, stuck_floor_s)

    def start(self) -> "RankHeartbeat":
        """Write the record, arm the stack dump (STACKS_SIGNAL) and begin beating."""
        self.write()
        self._stacks = stacks_path(self.run_dir, self.rank).open("w", encoding="utf-8")
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True)
        self._thread.start()
        return self

    def record(self) -> dict[str, Any]:
        """The file's content now (the identity, then the progress)."""
        step, phase, since = self.progress.current
        record: dict[str, Any] = {**self.identity, "step": step, "phase": phase, "since": since,
                                  "beat": time.time(), "interval": self.interval, "step_s": self.progress.step_s(),
                                  "longest": dict(self.progress.longest), "waiting": waiting_in(self._main_frame())}
        if time.time() - since >= self.recorder_after_s:
            record.update(collectives_entered(flight_recorder_entries()))
        return record

    def write(self) -> None:
        try:
            write_quietly(self.path, json.dumps(self.record()).encode())
        except OSError:
            pass                     # a full or vanished directory: the launcher sees a stale beat

    def _main_frame(self) -> Optional[FrameType]:
        return sys._current_frames().get(self._main) if self._main is not None else None

    def _beat(self) -> None:
        """Write the record at every progress mark (at most every MARK_WRITE_S) and every `interval`;
        answer the launcher's dump request within DUMP_POLL_S."""
        from launcher_core.processes import process_alive

        gone_since: Optional[float] = None
        next_beat = 0.0
        while True:
            marked = self.progress.changed.wait(timeout=min(DUMP_POLL_S, self.interval))
            if marked or time.monotonic() >= next_beat:
                self.progress.changed.clear()
                self.write()
                next_beat = time.monotonic() + self.interval
                time.sleep(MARK_WRITE_S)
            if self.launcher_pid is not None and not process_alive(self.launcher_pid):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since >= ORPHAN_GRACE_S:
                    os.kill(os.getpid(), signal.SIGKILL)       # never train on without a launcher
            self._answer_dump_request()

    def _answer_dump_request(self) -> None:
        """The launcher asked for dumps (a newer request than the last answered): stacks, flight recorder."""
        try:
            asked = (ranks_dir(self.run_dir) / DUMP_REQUEST).stat().st_mtime
        except OSError:
            return
        if asked <= self._dumped_for:
            return
        self._dumped_for = asked
        raw = flight_recorder_raw(recorder_backends()[0])
        if raw:
            write_quietly(flight_recorder_dir(self.run_dir) / f"{FLIGHT_RECORDER_PREFIX}{self.rank}", raw)


def write_quietly(path: Path, data: bytes) -> None:
    """Temp file, then rename (no fsync: the files of live state are rewritten every beat)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)


# The frames a rank's main thread waits in when it is inside a collective: torch's c10d entry points
# (all_reduce, reduce_scatter_tensor, barrier, broadcast_object_list, ...), and a wait on one's handle
# (FSDP2 waits for its all-gathers and reductions in functions named wait_*).
C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
TORCH_DISTRIBUTED = os.path.join("torch", "distributed", "")


def waiting_in(frame: Optional[FrameType]) -> str:
    """The collective the innermost frames of a stack wait in ("" when none)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(C10D_FILE):
            return code.co_name
        if TORCH_DISTRIBUTED in code.co_filename and code.co_name.startswith("wait"):
            return code.co_name
        if TORCH_DISTRIBUTED not in code.co_filename and "torch" + os.sep not in code.co_filename:
            return ""                # the project's own code: not inside a collective
        frame = frame.f_back
    return ""


def recorder_backends() -> tuple[str, ...]:
    """The flight recorders this rank's collectives fill, its main one first: NCCL's own (and the generic one, which
    a gloo side group of a NCCL rank fills) where its process group runs on NCCL, else the generic one."""
    dist = sys.modules.get("torch.distributed")
    try:
        nccl = dist is not None and dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
    except (RuntimeError, ValueError):      # the group is being destroyed
        nccl = False
    return ("nccl", "gloo") if nccl else ("gloo",)


def flight_recorder_raw(backend: str = "gloo") -> Optional[bytes]:
    from dflash.torch_private import flight_recorder_dump

    return flight_recorder_dump(backend) if "torch" in sys.modules else None


def flight_recorder_entries() -> list[dict[str, Any]]:
    """The entries of every flight recorder this rank's collectives fill."""
    entries: list[dict[str, Any]] = []
    for backend in recorder_backends():
        raw = flight_recorder_raw(backend)
        if not raw:
            continue
        try:
            entries.extend(pickle.loads(raw).get("entries") or [])
        except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError):
            continue
    return entries


def collectives_entered(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """{"collectives": {process group: the highest collective sequence number entered}, "last_collective":
    the newest entry's name and state} from the flight recorder's entries (empty without any)."""
    if not entries:
        return {}
    entered: dict[str, int] = {}
    for entry in entries:
        if entry.get("is_p2p"):
            continue
        group = str(entry.get("pg_id", ""))
        entered[group] = max(entered.get(group, 0), int(entry.get("collective_seq_id") or 0))
    newest = max(entries, key=lambda e: int(e.get("record_id") or 0))
    return {"collectives": entered,
            "last_collective": f"{newest.get('profiling_name', '?')} ({newest.get('state', '?')})"}


@dataclass(frozen=True)
class RankRecord:
    """train/ranks/rank-R.json: which process is rank R (and on which host), and its last progress."""

    rank: int
    pid: int
    host: str
    attempt: int
    path: Path
    progress: dict[str, Any] = field(default_factory=dict, compare=False)

    def last_beat(self) -> Optional[float]:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None

    @property
    def phase(self) -> str:
        return str(self.progress.get("phase", "start"))

    @property
    def step(self) -> int:
        return int(self.progress.get("step", 0) or 0)

    def where(self) -> str:
        """"its backward at step 3" / "its start (before the first step)"."""
        if self.phase == "start":
            return "its start (before its first step)"
        return f"its {self.phase} at step {self.step}"


def rank_records(run_dir: Path, host: Optional[str] = None) -> list[RankRecord]:
    """The rank records of the run (of `host` only, when given), by rank."""
    records = []
    for path in sorted(ranks_dir(run_dir).glob("rank-*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            record = RankRecord(int(document["rank"]), int(document["pid"]), str(document["host"]),
                                int(document.get("attempt", 0)), path, document)
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if host is None or record.host == host:
            records.append(record)
    return sorted(records, key=lambda r: r.rank)


@dataclass(frozen=True)
class Stall:
    """A rank whose process exists but has not beaten for `silent_s` seconds."""

    rank: int
    pid: int
    silent_s: float
    state: str                  # psutil's status of the process: "stopped", "running", "disk-sleep", ...
    where: str = "an unknown phase"

    def describe(self) -> str:
        why = {"stopped": "its process is stopped (SIGSTOP, Ctrl-Z or a debugger holds it)",
               "tracing-stop": "its process is held by a debugger",
               "disk-sleep": "its process is stuck in the kernel (waiting on a disk or a driver)"}.get(
            self.state, f"its process is {self.state} but its heartbeat thread has not run")
        return (f"rank {self.rank} (pid {self.pid}) stopped responding in {self.where}: no heartbeat for "
                f"{self.silent_s:.0f} s; {why}")


def process_state(pid: int) -> Optional[str]:
    """psutil's status of `pid`; None when it is gone (or a zombie waiting to be reaped)."""
    import psutil

    try:
        state = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return None if state in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else str(state)


def find_stall(run_dir: Path, timeout_s: float, now: Optional[float] = None) -> Optional[Stall]:
    """The first rank of this node whose process lives but whose heartbeat is older than `timeout_s`."""
    now = time.time() if now is None else now
    for record in rank_records(run_dir, socket.gethostname()):
        beat = record.last_beat()
        state = process_state(record.pid)
        if beat is not None and state is not None and now - beat > timeout_s:
            return Stall(record.rank, record.pid, now - beat, state, record.where())
    return None


def live_rank_pids(run_dir: Path) -> list[int]:
    """The pids of this node's rank records whose process still exists (zombies excluded)."""
    return [r.pid for r in rank_records(run_dir, socket.gethostname()) if process_state(r.pid) is not None]
