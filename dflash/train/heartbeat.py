"""Rank heartbeats: every rank shows that its process runs; the launcher names one that stopped.

Each rank writes `train/ranks/rank-R.json` once ({rank, pid, host, attempt}) and touches it from a
daemon thread every `beat_interval(train.heartbeat_timeout_s)` seconds. The thread keeps beating
while the rank computes or waits in a collective (both release the GIL); it stops only when the
process does: SIGSTOP, a debugger, a kill. The launcher (`find_stall`) reads the files of its own
node every second: a rank whose process still exists but whose file is older than
`train.heartbeat_timeout_s` has stopped, and the launcher ends the run naming that rank, where the
others would otherwise wait in their next collective for the process group's timeout
(`train.collective_timeout_s`).

The files also tell the launcher which processes are the run's ranks (`rank_records`), so it
can make sure none outlives the run. The thread is also the ranks' last guard against outliving
their launcher: when the launcher's pid (`LAUNCHER_PID_ENV`) has been gone for `ORPHAN_GRACE_S`,
the rank kills itself (the agent normally stops it first: dflash.train.agent).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RANKS_DIR = "ranks"
LAUNCHER_PID_ENV = "DFLASH_LAUNCHER_PID"
ORPHAN_GRACE_S = 10.0


def beat_interval(timeout_s: float) -> float:
    """How often a rank beats: several beats per timeout, at most every 5 s, at least every 0.2 s."""
    return max(0.2, min(5.0, timeout_s / 6.0))


def ranks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "train" / RANKS_DIR


@dataclass(frozen=True)
class RankRecord:
    """train/ranks/rank-R.json: which process is rank R (and on which host)."""

    rank: int
    pid: int
    host: str
    attempt: int
    path: Path

    def last_beat(self) -> Optional[float]:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None


class RankHeartbeat:
    """A rank's heartbeat thread (daemon); `start()` writes the record and begins beating."""

    def __init__(self, run_dir: Path, rank: int, timeout_s: float, launcher_pid: Optional[int] = None):
        self.path = ranks_dir(run_dir) / f"rank-{rank}.json"
        self.rank, self.interval, self.launcher_pid = rank, beat_interval(timeout_s), launcher_pid
        self._thread = threading.Thread(target=self._beat, name="rank-heartbeat", daemon=True)

    @classmethod
    def from_env(cls, run_dir: Path, rank: int, timeout_s: float) -> "RankHeartbeat":
        pid = os.environ.get(LAUNCHER_PID_ENV, "")
        return cls(run_dir, rank, timeout_s, int(pid) if pid.isdigit() else None)

    def start(self) -> "RankHeartbeat":
        from launcher_core.fileio import write_json_atomic

        write_json_atomic(self.path, {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                                      "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
        self._thread.start()
        return self

    def _beat(self) -> None:
        from launcher_core.processes import process_alive

        gone_since: Optional[float] = None
        while True:
            try:
                os.utime(self.path)
            except OSError:
                pass                     # a full or vanished directory: the launcher sees a stale beat
            if self.launcher_pid is not None and not process_alive(self.launcher_pid):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since >= ORPHAN_GRACE_S:
                    os.kill(os.getpid(), signal.SIGKILL)       # never train on without a launcher
            time.sleep(self.interval)


def rank_records(run_dir: Path, host: Optional[str] = None) -> list[RankRecord]:
    """The rank records of the run (of `host` only, when given), by rank."""
    records = []
    for path in sorted(ranks_dir(run_dir).glob("rank-*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            record = RankRecord(int(document["rank"]), int(document["pid"]), str(document["host"]),
                                int(document.get("attempt", 0)), path)
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

    def describe(self) -> str:
        why = {"stopped": "its process is stopped (SIGSTOP, Ctrl-Z or a debugger holds it)",
               "tracing-stop": "its process is held by a debugger",
               "disk-sleep": "its process is stuck in the kernel (waiting on a disk or a driver)"}.get(
            self.state, f"its process is {self.state} but its heartbeat thread has not run")
        return f"rank {self.rank} (pid {self.pid}) stopped responding: no heartbeat for {self.silent_s:.0f} s; {why}"


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
            return Stall(record.rank, record.pid, now - beat, state)
    return None


def live_rank_pids(run_dir: Path) -> list[int]:
    """The pids of this node's rank records whose process still exists (zombies excluded)."""
    return [r.pid for r in rank_records(run_dir, socket.gethostname()) if process_state(r.pid) is not None]
