"""One run per directory: an OS-level lock on `RUN_DIR/.run.lock`, held for the run's life.

Every command that writes into a run directory holds it: train and pipeline, tokenize and eval (their
profile's run directory), and tokenize, merge and export for an output inside a run directory
(`run_locks_for`), so none of them changes the data or checkpoints of a live run.

`with run_lock(run_dir, "train") as lock:` takes an exclusive `flock` on the file (never waits).
The kernel drops the lock when the last process holding it ends, however it ends (SIGKILL
included), so a lock can never outlive its run. The file itself records the holder (pid, host,
command, start time): a second run on the directory is refused with ConfigError (exit 2) naming
that holder; a file left by a run that was killed is not locked any more, and the next run takes it
over and says so (`lock.previous` names the dead holder).

The lock is re-entrant within one process (the pipeline holds it and its train stage takes it
again), and its descriptor can be handed to a child (`fileno()`, e.g. `subprocess.Popen(pass_fds=)`):
the child then holds the same lock, so the directory stays locked until the child has ended too.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from launcher_core.errors import ConfigError
from launcher_core.fileio import make_run_dir

LOCK_NAME = ".run.lock"


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a run directory's lock."""

    pid: int
    host: str
    command: str
    started: str

    def describe(self) -> str:
        return f"`launcher.py {self.command}` (pid {self.pid} on {self.host}, since {self.started})"


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / LOCK_NAME


def _read_holder(fd: int) -> Optional[LockHolder]:
    try:
        document = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "null")
        return LockHolder(int(document["pid"]), str(document["host"]), str(document["command"]),
                          str(document["started"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


@dataclass
class RunLock:
    """A held lock: its file, its descriptor, and the dead holder it replaced (if any)."""

    path: Path
    fd: int
    holder: LockHolder
    previous: Optional[LockHolder] = None

    def fileno(self) -> int:
        return self.fd

    @classmethod
    def acquire(cls, run_dir: str | Path, command: str) -> "RunLock":
        path = lock_path(run_dir)
        make_run_dir(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(busy_message(path.parent, holder)) from None
        previous = _read_holder(fd)
        holder = LockHolder(os.getpid(), socket.gethostname(), command, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(asdict(holder)) + "\n").encode("utf-8"), 0)
        return cls(path, fd, holder, previous if previous and previous.pid != os.getpid() else None)

    def release(self) -> None:
        """A clean end: the file is emptied (no holder to take over), then unlocked and closed."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


@contextlib.contextmanager
def waiting_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing), waiting for it: for work done once by
    whichever process comes first (a cache build). The kernel drops it with its process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def busy_message(run_dir: Path, holder: Optional[LockHolder]) -> str:
    from launcher_core.processes import process_alive

    who = holder.describe() if holder else "another process"
    if holder is not None and holder.host == socket.gethostname() and not process_alive(holder.pid):
        who += (": that process has ended, and what it started (the torchrun agent) still holds the lock "
                "while it stops its ranks; try again in a few seconds")
    return (f"run directory {run_dir} is in use by {who}; a second command writing there would change the data, "
            f"checkpoints and metrics under it. Wait for it to finish, stop it (kill {holder.pid if holder else 'its pid'}), "
            f"or choose another run directory (--run-dir, or an output outside it)")


_HELD: dict[Path, RunLock] = {}


def say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def run_lock(run_dir: str | Path, command: str, say: Callable[[str], None] = say_stderr) -> Iterator[RunLock]:
    """Hold the run directory's lock for the block (re-entrant in this process); ConfigError if
    another process holds it. Taking over the file of a run that died is said through `say`."""
    path = lock_path(run_dir)
    if path in _HELD:
        yield _HELD[path]
        return
    lock = RunLock.acquire(run_dir, command)
    if lock.previous is not None:
        say(f"note: {path.parent}: took over the lock of {lock.previous.describe()}, which ended without "
            f"releasing it (killed, or its machine went down)")
    _HELD[path] = lock
    try:
        yield lock
    finally:
        del _HELD[path]
        lock.release()


def enclosing_run_dir(path: str | Path) -> Optional[Path]:
    """The run directory `path` lies in (or is): the nearest of it and its parents with a lock file, which
    every run directory a locked command used has (None: it is in none)."""
    resolved = Path(path).resolve()
    return next((folder for folder in (resolved, *resolved.parents) if (folder / LOCK_NAME).is_file()), None)


@contextlib.contextmanager
def run_locks_for(paths: Iterable[str | Path], command: str) -> Iterator[None]:
    """Hold the lock of every run directory one of `paths` lies in, for a command that writes there (tokenize,
    merge, export into a run): a live run there refuses it (ConfigError, as `run_lock`); a path in no run
    directory takes no lock."""
    with contextlib.ExitStack() as stack:
        for run_dir in sorted({folder for path in paths if (folder := enclosing_run_dir(path)) is not None}):
            stack.enter_context(run_lock(run_dir, command))
        yield


def lock_holder(run_dir: str | Path) -> Optional[LockHolder]:
    """The live holder of the run directory's lock, None when no process holds it (read-only)."""
    path = lock_path(run_dir)
    if not path.exists():
        return None
    if path in _HELD:
        return _HELD[path].holder
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd) or LockHolder(0, "?", "?", "?")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
