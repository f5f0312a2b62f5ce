"""Child processes and their ports: the one place that picks a free loopback port, ends a
process group (a server, a rank, a probe child and whatever it started) and gives a child a
temporary folder of its own (`child_tempdir`)."""
from __future__ import annotations

import getpass
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

KILL_GRACE_S = 10.0


TEMPDIR_PREFIX = "dflash-"


def inductor_cache_dir() -> str:
    """TORCHINDUCTOR_CACHE_DIR, else where torch 2.13's inductor keeps its cache (and Triton's) by default:
    `torchinductor_<user>` in the system temporary folder (torch/_inductor/runtime/cache_dir_utils.py)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def child_tempdir(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder of a child and everything it starts (a server; a torchrun agent, its
    forkserver and ranks), to be removed (`cleanup()`, or the `with` block's end) once they have
    ended. With `child_tempdir_env` as TMPDIR it takes what they write to the system temporary folder
    and never remove when stopped or killed (torchrun's and multiprocessing's error files and
    folders, vLLM's IPC sockets and distributed-init files)."""
    return tempfile.TemporaryDirectory(prefix=f"{TEMPDIR_PREFIX}{kind}-", ignore_cleanup_errors=True)


def child_tempdir_env(folder: str) -> dict[str, str]:
    """TMPDIR for a child's own folder; the compile caches stay where they were (inductor's folder by name)."""
    return {"TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, on `host` (loopback by default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (ours or another user's)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; False when the group is gone already."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_group(process: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """End a child started with `start_new_session=True` and its whole group: SIGTERM, up to
    `grace_s` to exit, then SIGKILL. Members that outlive the leader's clean exit go too."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not signal_group(process.pid, sig):
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    signal_group(process.pid, signal.SIGKILL)
    process.wait()


def wait_or_stop(process: subprocess.Popen, limit_s: float, grace_s: float = KILL_GRACE_S) -> bool:
    """Wait up to `limit_s` for the child; on overrun stop its group. True: it had to be stopped."""
    try:
        process.wait(timeout=limit_s)
        return False
    except subprocess.TimeoutExpired:
        stop_group(process, grace_s)
        return True


PR_SET_PDEATHSIG = 1          # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that started it ends (Linux
    `prctl(PR_SET_PDEATHSIG)`, kept across exec). `parent_pid`: the parent this process was started
    by; when it has ended already (before the request took effect), `sig` is sent at once.
    False where the kernel offers no such request."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def parent_of(pid: int) -> int | None:
    """The parent pid of process `pid` (/proc/PID/stat), None when it has ended or cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()      # after the command name, which may hold spaces
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def exit_without_finalization(code: int) -> NoReturn:
    """End a rank whose work is done (its results written, its files closed, its process group
    destroyed) with `code`, stdout and stderr flushed, without the interpreter's finalization. A gloo
    rank past destroy_process_group has died there of SIGABRT ("terminate called without an active
    exception", its main thread with no Python frame left) after a complete run, so that the launcher
    reported a finished training as failed: in some full test runs, under load (last in
    tests/train/test_torchrun.py's OOM drill, its last restart). pytorch/pytorch#179291 describes the
    same teardown: gloo's C++ threads taking the GIL while the interpreter is torn down."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def signal_name(code: int) -> str:
    """`-9` (a Popen return code) or `9` -> "SIGKILL"; "signal N" for an unknown number."""
    try:
        return signal.Signals(abs(code)).name
    except ValueError:
        return f"signal {abs(code)}"
