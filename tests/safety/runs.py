"""Helpers for the tests that kill a training run's processes: start `launcher.py train` as a real
process (its own session, so a test can always clean up), wait for a moment inside a checkpoint
save (the kernel tells us when the staging directory appears: inotify), and find every process
that belongs to a run."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import psutil

from dflash.train.supervisor.agent import RUN_DIR_ENV

REPO = Path(__file__).resolve().parents[2]
IN_CREATE, IN_MOVED_TO = 0x100, 0x80


def start_train(profile: Path, run_dir: Path, *extra: str, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """`launcher.py train --profile P --run-dir D --skip-preflight ...` in its own session; output to run_dir/../<name>.log."""
    log = (run_dir.parent / f"{run_dir.name}-{len(list(run_dir.parent.glob(run_dir.name + '-*.log')))}.log").open("wb")
    argv = [sys.executable, str(REPO / "launcher.py"), "train", "--profile", str(profile), "--run-dir", str(run_dir),
            "--skip-preflight", *extra]
    process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **(env or {})})
    WATCHED.append(process)
    return process


def finish(process: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    """Wait for a started train; its exit code and its output."""
    try:
        code = process.wait(timeout=timeout)
    finally:
        kill_session(process)
    return code, newest_log(_run_dir_of(process)).read_text(errors="replace")


def newest_log(run_dir: Path) -> Path:
    return max(run_dir.parent.glob(f"{run_dir.name}-*.log"), key=lambda p: p.stat().st_mtime)


def kill_session(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names the run directory (the launcher, the agent,
    the ranks: a forked rank's title names it): what `pgrep -f RUN_DIR` finds, and every process
    started with the run directory in its environment (the agent's forkserver and multiprocessing's
    resource tracker); zombies left out."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if process.info["status"] != psutil.STATUS_ZOMBIE and (
                    str(run_dir) in " ".join(process.info["cmdline"] or [])
                    or process.environ().get(RUN_DIR_ENV) == str(run_dir)):
                found.append(process)
    return found


def role(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    return ("agent" if "dflash.train.supervisor.agent" in command else "rank" if "dflash.train.rank.worker" in command
            else "launcher" if "launcher.py" in command else "other")


def alive(process: psutil.Process) -> bool:
    """Running (a zombie has ended: only its exit status waits to be collected)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until_gone(run_dir: Path, members: list[psutil.Process] = (), timeout: float = 15.0) -> list[psutil.Process]:
    """Wait until no process names the run directory and none of `members` (known before) runs;
    the ones still there after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        left = [*run_processes(run_dir), *(p for p in members if alive(p))]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


WATCHED: list[subprocess.Popen] = []       # the train started last: a wait ends when it exits


def wait_for(predicate, timeout: float = 300.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if WATCHED and WATCHED[-1].poll() is not None:
            raise AssertionError(f"the train exited ({WATCHED[-1].returncode}) before {what}:\n"
                                 + newest_log(_run_dir_of(WATCHED[-1])).read_text(errors="replace")[-3000:])
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.05)


def _run_dir_of(process: subprocess.Popen) -> Path:
    return Path(process.args[process.args.index("--run-dir") + 1])


def wait_for_ranks(run_dir: Path, count: int = 2, timeout: float = 300.0) -> dict[int, int]:
    """rank -> pid, once `count` ranks of the train started last have written their heartbeat
    records (records a previous run left are not theirs)."""
    records: dict[int, int] = {}

    def ready() -> bool:
        records.clear()
        with contextlib.suppress(psutil.Error):
            ours = {child.pid for child in psutil.Process(WATCHED[-1].pid).children(recursive=True)}
            for path in (run_dir / "train" / "ranks").glob("rank-*.json"):
                with contextlib.suppress(OSError, ValueError):
                    document = json.loads(path.read_text())
                    if int(document["pid"]) in ours:
                        records[int(document["rank"])] = int(document["pid"])
        return len(records) >= count

    wait_for(ready, timeout, f"{count} rank records under {run_dir}")
    return dict(records)


def metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "train" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Inotify:
    """The kernel's file-creation events of one directory (Linux inotify through ctypes)."""

    def __init__(self, directory: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_CREATE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {directory}")

    def names(self) -> Iterator[str]:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        offset = 0
        while offset < len(data):
            _wd, _mask, _cookie, length = struct.unpack_from("iIII", data, offset)
            yield data[offset + 16: offset + 16 + length].rstrip(b"\0").decode()
            offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def wait_for_save(checkpoints: Path, step: int, timeout: float = 300.0) -> str:
    """Block until the staging directory of step `step`'s save appears (`.step-N.*.tmp`); its name.
    The caller acts at once: the save is then under way (it writes, then renames the directory)."""
    wait_for(checkpoints.is_dir, timeout, f"{checkpoints} to exist")
    watch = Inotify(checkpoints)
    try:
        prefix = f".step-{step}."
        existing = [p.name for p in checkpoints.glob(f"{prefix}*.tmp")]
        if existing:
            return existing[0]
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            select.select([watch.fd], [], [], left)
            for name in watch.names():
                if name.startswith(prefix) and name.endswith(".tmp"):
                    return name
        raise TimeoutError(f"no save of step {step} under {checkpoints} within {timeout:.0f} s")
    finally:
        watch.close()
