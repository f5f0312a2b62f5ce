"""launcher_core.processes: free loopback ports and ending a child's whole process group."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import psutil

from envcheck.host import nvidia_driver_version
from launcher_core.processes import free_port, stop_group, wait_or_stop

SPAWNS_A_GRANDCHILD = ("import subprocess, sys, time; "
                       "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")


def test_free_port_can_be_bound_on_loopback():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _group_members(pgid: int) -> list[int]:
    """Live members of the group (a killed orphan may stay a zombie until init reaps it)."""
    return [p.pid for p in psutil.process_iter(["pid", "status"])
            if _pgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE]


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def test_stop_group_ends_the_child_and_what_it_started():
    child = subprocess.Popen([sys.executable, "-c", SPAWNS_A_GRANDCHILD], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_group_members(child.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_group_members(child.pid)) == 2
    stop_group(child, grace_s=2.0)
    assert child.returncode is not None
    time.sleep(0.2)
    assert _group_members(child.pid) == []


def test_wait_or_stop_says_whether_it_had_to_stop():
    quick = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    assert wait_or_stop(quick, limit_s=20) is False
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    assert wait_or_stop(slow, limit_s=0.5, grace_s=1.0) is True
    assert slow.returncode is not None


def test_driver_version_read_from_the_proc_file(tmp_path):
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\n")
    assert nvidia_driver_version(proc) == "580.95.05"
    assert nvidia_driver_version(tmp_path / "absent") is None
