"""The pieces a run's process safety rests on, each with the control that shows it can fail:
a child that asked for the parent-death signal dies with its parent (one that did not outlives
it); the run-directory lock refuses a second holder, is taken over from a dead one (and says so),
and is still held while a child that inherited it lives."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher_core.errors import ConfigError
from launcher_core.runlock import lock_holder, lock_path, run_lock

REPO = Path(__file__).resolve().parents[2]


def spawn_pair(tmp_path: Path, ask: bool) -> tuple[subprocess.Popen, int]:
    """A parent process that starts a sleeping child (asking for SIGKILL on its parent's death when
    `ask`); returns the parent and the child's pid."""
    child = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); "
             "from launcher_core.processes import die_with_parent; "
             f"{'die_with_parent(signal.SIGKILL, int(sys.argv[2]))' if ask else 'pass'}; "
             "open(sys.argv[3], 'w').write(str(os.getpid())); time.sleep(120)")
    marker = tmp_path / f"child-{ask}.pid"
    parent = ("import os, subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {child!r}, {str(REPO)!r}, str(os.getpid()), {str(marker)!r}]); "
              "time.sleep(120)")
    process = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60
    while not (marker.exists() and marker.read_text()):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    return process, int(marker.read_text())


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_asked_dies_with_its_parent_and_one_that_did_not_outlives_it(tmp_path):
    for ask in (True, False):
        parent, child = spawn_pair(tmp_path, ask)
        parent.kill()
        parent.wait()
        try:
            assert gone(child) is ask, f"ask={ask}: the child {'outlived' if ask else 'died with'} its parent"
        finally:
            if not ask:
                os.kill(child, signal.SIGKILL)


HOLD = ("import sys, time; sys.path.insert(0, sys.argv[1]); from launcher_core.runlock import run_lock\n"
        "with run_lock(sys.argv[2], 'train'):\n    print('held', flush=True); time.sleep(float(sys.argv[3]))")


def hold_lock(run_dir: Path, seconds: float) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(REPO), str(run_dir), str(seconds)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    holder = hold_lock(tmp_path / "run", 60)
    try:
        with pytest.raises(ConfigError) as refused:
            with run_lock(tmp_path / "run", "train"):
                pass
        message = str(refused.value)
        assert f"run directory {tmp_path / 'run'} is in use by `launcher.py train` (pid {holder.pid} on" in message
        assert f"stop it (kill {holder.pid})" in message
        assert lock_holder(tmp_path / "run").pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_holder_is_taken_over_and_said(tmp_path):
    holder = hold_lock(tmp_path / "run", 60)
    holder.kill()                                   # SIGKILL: no clean release, the file still names it
    holder.wait()
    assert json.loads(lock_path(tmp_path / "run").read_text())["pid"] == holder.pid
    assert lock_holder(tmp_path / "run") is None    # the kernel dropped the lock with the process
    said: list[str] = []
    with run_lock(tmp_path / "run", "train", say=said.append) as lock:
        assert lock.previous is not None and lock.previous.pid == holder.pid
        assert said == [f"note: {tmp_path / 'run'}: took over the lock of `launcher.py train` (pid {holder.pid} on "
                        f"{lock.previous.host}, since {lock.previous.started}), which ended without releasing it "
                        f"(killed, or its machine went down)"]
        with run_lock(tmp_path / "run", "train") as again:        # re-entrant in one process
            assert again is lock
    assert lock_path(tmp_path / "run").read_text() == ""          # a clean end leaves no holder to take over
    with run_lock(tmp_path / "run", "train", say=said.append) as lock:
        assert lock.previous is None and len(said) == 1


def test_a_child_that_inherited_the_lock_keeps_the_directory_locked(tmp_path):
    """The launcher hands its lock to the torchrun agent: killing the launcher leaves it held until
    the agent, too, has ended."""
    script = ("import os, sys, subprocess, time; sys.path.insert(0, sys.argv[1]); "
              "from launcher_core.runlock import RunLock\n"
              "lock = RunLock.acquire(sys.argv[2], 'train')\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3)'], pass_fds=(lock.fileno(),))\n"
              "print(child.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(REPO), str(tmp_path / "run")],
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    with pytest.raises(ConfigError, match="that process has ended, and what it started"):
        with run_lock(tmp_path / "run", "train"):
            pass
    assert gone(child, timeout=10)
    with run_lock(tmp_path / "run", "train") as lock:
        assert lock.previous is not None and lock.previous.pid == launcher.pid
