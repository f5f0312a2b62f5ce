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


def test_a_cache_build_waits_for_the_one_under_way_and_then_finds_it_done(tmp_path, monkeypatch):
    """Two processes need the same cache entry: the second waits on cache_build_lock until the first
    has built it (a real child holding the lock), so it never builds it again or sees it half-made."""
    from launcher_core.paths import cache_build_lock

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "cache" / "entry"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from pathlib import Path\n"
        "from launcher_core.paths import cache_build_lock\n"
        "with cache_build_lock('entry'):\n"
        "    print('held', flush=True); time.sleep(1.5); Path(sys.argv[2]).mkdir()\n"),
        str(Path(__file__).resolve().parents[2]), str(built)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")})
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with cache_build_lock("entry"):
        waited = time.monotonic() - started
        assert built.is_dir(), "the lock was taken before the first build finished"
    assert holder.wait(timeout=30) == 0 and waited > 0.5


def test_a_stopped_rank_is_found_and_a_beating_one_is_not(tmp_path):
    """find_stall: a record whose process lives but has not beaten for the timeout; the control, a
    process that beats, and a record whose process is gone, are not stalls."""
    from dflash.train.supervisor.heartbeat import RankHeartbeat, find_stall, ranks_dir

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        beating = RankHeartbeat(tmp_path, 0, timeout_s=2).start()           # this process, beating
        record = ranks_dir(tmp_path) / "rank-1.json"
        record.write_text(json.dumps({"rank": 1, "pid": sleeper.pid, "host": os.uname().nodename, "attempt": 0}))
        assert find_stall(tmp_path, timeout_s=2) is None                     # both fresh
        os.kill(sleeper.pid, signal.SIGSTOP)
        os.utime(record, (time.time() - 30, time.time() - 30))               # its last beat, 30 s ago
        time.sleep(0.5)
        stall = find_stall(tmp_path, timeout_s=2)
        assert stall is not None and (stall.rank, stall.pid, stall.state) == (1, sleeper.pid, "stopped")
        assert stall.describe().startswith(f"rank 1 (pid {sleeper.pid}) stopped responding in its start (before its "
                                           f"first step): no heartbeat for 3")
        assert " s; its process is stopped (SIGSTOP" in stall.describe() and 30 <= stall.silent_s < 40
        assert beating.path.stat().st_mtime > time.time() - 2               # the thread keeps beating
    finally:
        sleeper.kill()
        sleeper.wait()
    assert find_stall(tmp_path, timeout_s=2) is None                         # gone: torchrun's to report


def write_records(failures: Path, records: list[dict], agent: list[dict]) -> None:
    failures.mkdir(parents=True)
    for record in records:
        (failures / f"rank-{record['rank']}.json").write_text(json.dumps({"traceback": "Traceback ...", **record}))
    (failures / "agent.json").write_text(json.dumps({"ranks": agent}))


@pytest.mark.parametrize("records, agent, kind, rank, start", [
    # rank 1 killed -9 (no record of its own); rank 0's "connection closed" is its echo
    ([{"rank": 0, "time": 1.0, "error": "RuntimeError('Connection closed by peer')"}],
     [{"rank": 0, "local_rank": 0, "pid": 10, "exitcode": 1, "signal": "", "message": ""},
      {"rank": 1, "local_rank": 1, "pid": 11, "exitcode": -9, "signal": "SIGKILL", "message": ""}],
     "rank killed", 1, "rank 1 (pid 11) was killed by SIGKILL from outside the run"),
    # the control: two recorded errors, no signal: the earliest is the cause
    ([{"rank": 0, "time": 2.0, "error": "echo"}, {"rank": 1, "time": 1.0, "error": "ValueError('bad row')"}],
     [{"rank": 0, "local_rank": 0, "pid": 10, "exitcode": 1, "signal": "", "message": ""},
      {"rank": 1, "local_rank": 1, "pid": 11, "exitcode": 1, "signal": "", "message": ""}],
     "rank failed", 1, "rank 1 failed first: ValueError('bad row')"),
    # a full disk recorded by rank 0
    ([{"rank": 0, "time": 1.0, "error": "disk full: writing a checkpoint", "kind": "disk_full"}], [],
     "disk full", 0, "rank 0: disk full: writing a checkpoint"),
    # a loss that cannot train, recorded by both ranks alike (dflash.train.rank.loss_check): the earliest names it
    ([{"rank": 0, "time": 2.0, "error": "step 2: the loss is nan", "kind": "loss_unusable"},
      {"rank": 1, "time": 1.0, "error": "step 2: the loss is nan", "kind": "loss_unusable"}], [],
     "loss unusable", 1, "rank 1: step 2: the loss is nan; once the key named is changed, "),
])
def test_the_cause_of_a_failed_run_is_named(tmp_path, records, agent, kind, rank, start):
    from dflash.train.supervisor.failures import RunEnd, failure_cause

    write_records(tmp_path / "train" / "failures", records, agent)
    cause = failure_cause(tmp_path, RunEnd(agent_pid=9, code=1), collective_timeout_s=600)
    assert (cause.kind, cause.rank) == (kind, rank) and cause.message.startswith(start)
    assert "no checkpoint was written yet" in cause.message


@pytest.mark.parametrize("records, code", [
    ([{"rank": 1, "time": 1.0, "error": "ValueError('bad row')"}], 5),
    ([{"rank": 0, "time": 1.0, "error": "disk full: writing a checkpoint", "kind": "disk_full"}], 7),
    ([{"rank": 0, "time": 1.0, "error": "step 2: the loss is nan", "kind": "loss_unusable"}], 4),
])
def test_the_manifest_keeps_the_exit_code_of_the_command_not_torchruns(tmp_path, records, code):
    """torchrun exits 1 whatever failed; the manifest's `exit_code` is the one the command exits with
    (exit_code_for the error it raises), not torchrun's 1."""
    from dflash.train.supervisor.failures import RunEnd
    from dflash.train.supervisor.launch import TrainPaths, _conclude
    from launcher_core.errors import exit_code_for
    from launcher_core.manifest import read_manifest

    write_records(tmp_path / "train" / "failures", records, [])
    with pytest.raises(Exception) as raised:
        _conclude(TrainPaths(tmp_path), RunEnd(agent_pid=9, code=1), collective_timeout_s=600)
    assert exit_code_for(raised.value) == code
    assert read_manifest(tmp_path)["stages"]["train"]["exit_code"] == code


ABORTING_RANK = """
import os

def tear_down_the_group():
    os.abort()          # what C++ `terminate` does to a rank

tear_down_the_group()
"""


@pytest.mark.parametrize("faulthandler", [True, False])
def test_a_rank_aborted_by_a_signal_of_its_own_is_named_with_its_python_stack(tmp_path, faulthandler):
    """A rank that dies by SIGABRT records no error of its own; with the PYTHONFAULTHANDLER the launcher
    sets for its ranks, a real Python's dump in the rank's torchrun log names where it was. The control:
    the same abort without the faulthandler leaves nothing to name."""
    from dflash.train.supervisor.failures import RunEnd, failure_cause

    log = tmp_path / "train" / "logs" / "dflash-x" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1" if faulthandler else ""}
    with log.open("w") as stderr:
        aborted = subprocess.run([sys.executable, "-c", ABORTING_RANK], env=env, stderr=stderr, timeout=60)
    assert aborted.returncode == -signal.SIGABRT
    write_records(tmp_path / "train" / "failures", [],
                  [{"rank": 0, "local_rank": 0, "pid": 10, "exitcode": -15, "signal": "SIGTERM", "message": ""},
                   {"rank": 1, "local_rank": 1, "pid": 11, "exitcode": -6, "signal": "SIGABRT", "message": ""}])
    cause = failure_cause(tmp_path, RunEnd(agent_pid=9, code=1), collective_timeout_s=600)
    assert cause.kind == "rank failed" and "rank 1 (pid 11) was killed by SIGABRT" in cause.message
    if faulthandler:
        assert "Fatal Python error: Aborted" in cause.message and "in tear_down_the_group" in cause.message
        assert str(log) in cause.message and "recording no error" not in cause.message
    else:
        assert "recording no error" in cause.message and "Fatal Python error" not in cause.message


def test_a_killed_agent_is_named_before_any_rank(tmp_path):
    from dflash.train.supervisor.failures import RunEnd, failure_cause

    write_records(tmp_path / "train" / "failures", [{"rank": 0, "time": 1.0, "error": "echo"}], [])
    (tmp_path / "train" / "checkpoints").mkdir(parents=True)
    (tmp_path / "train" / "checkpoints" / "latest").write_text("step-3\n")
    cause = failure_cause(tmp_path, RunEnd(agent_pid=9, code=-9), collective_timeout_s=600)
    assert cause.kind == "agent killed" and cause.message == (
        "the torchrun agent (pid 9) was killed by SIGKILL; its ranks died with it (no process of this run is left); "
        "the last complete checkpoint is step-3: continue from it with --resume")
    signalled = failure_cause(tmp_path, RunEnd(agent_pid=9, code=-15, signalled=True), collective_timeout_s=600)
    assert signalled.kind == "rank failed"                    # we sent it the signal: not a kill from outside


def test_status_says_a_running_stage_whose_launcher_is_gone_was_killed(cli, tmp_path):
    from launcher_core.manifest import update_stage

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    update_stage(tmp_path, "train", "running", launcher_pid=gone.pid)
    result = cli("status", tmp_path)
    assert result.code == 0 and f"note: train says running, but its launcher (pid {gone.pid}) is gone" in result.out
    update_stage(tmp_path, "train", "running", launcher_pid=os.getpid())          # the control: a live launcher
    assert "note:" not in cli("status", tmp_path).out


def test_status_names_the_last_checkpoint_and_the_resume_after_a_run_that_ended_early(cli, tmp_path):
    """A train stage the launcher recorded as failed (a rank killed, Ctrl-C) or stopped (SIGTERM: pending
    again): `status` names the last checkpoint and the `train --resume` that continues from it; before the
    first checkpoint, the `train` that starts it again."""
    from launcher_core.manifest import update_stage

    checkpoints = tmp_path / "train" / "checkpoints"
    update_stage(tmp_path, "train", "failed", ended_by="rank killed", failed_rank=1, exit_code=1)
    result = cli("status", tmp_path)
    assert result.code == 0 and result.out.splitlines()[-1] == (
        f"note: train failed (rank killed) before its first checkpoint; `launcher.py train --profile P --run-dir "
        f"{tmp_path}` starts it again")
    for step in (1, 2, 3):
        (checkpoints / f"step-{step}").mkdir(parents=True)
    (checkpoints / "latest").write_text("step-2\n")         # the newest whole one, as the last save left it
    assert cli("status", tmp_path).out.splitlines()[-1] == (
        f"note: train failed (rank killed); its last checkpoint is step-2: `launcher.py train --profile P "
        f"--run-dir {tmp_path} --resume` continues from it")
    update_stage(tmp_path, "train", "pending", stopped_at_step=3, ended_by="stopped (SIGTERM)")
    (checkpoints / "latest").write_text("step-9\n")         # names nothing there: the newest step instead
    assert cli("status", tmp_path).out.splitlines()[-1] == (
        f"note: train stopped (SIGTERM); its last checkpoint is step-3: `launcher.py train --profile P "
        f"--run-dir {tmp_path} --resume` continues from it")
    (tmp_path / "train" / "profile.json").write_text(json.dumps({"name": "rtx6000-x8"}))   # what train writes
    assert cli("status", tmp_path).out.splitlines()[-1] == (
        f"note: train stopped (SIGTERM); its last checkpoint is step-3: `launcher.py train --profile rtx6000-x8 "
        f"--run-dir {tmp_path} --resume` continues from it")
    update_stage(tmp_path, "train", "running", launcher_pid=os.getpid())   # the controls: running, then done
    assert "note:" not in cli("status", tmp_path).out
    update_stage(tmp_path, "train", "done", steps=10)
    assert "note:" not in cli("status", tmp_path).out


def test_every_command_that_writes_into_a_live_run_is_refused(cli, tmp_path, qwen3_tokenizer_dir, private_cache):
    """A training holds the run directory's lock, so nothing replaces its dataset or writes beside its
    checkpoints: tokenize (its profile's run directory, even with --force, or an output inside a run), merge into the run's dataset, export into the run and eval are refused,
    exit 2 naming the holder, and the dataset is unchanged; a merge whose output is outside the run is not."""
    from tests.data.conftest import build_dataset
    from tests.safety.conftest import tree_digest, write_tokenize_profile

    run_dir = tmp_path / "run"
    dataset, other = build_dataset(run_dir / "dataset", ["a", "b"]), build_dataset(tmp_path / "other", ["c"], seed=1)
    profile = write_tokenize_profile(tmp_path / "p.toml", qwen3_tokenizer_dir, run_dir)
    elsewhere = write_tokenize_profile(tmp_path / "q.toml", qwen3_tokenizer_dir, tmp_path / "run-q")
    before = tree_digest(dataset)
    holder = hold_lock(run_dir, 120)
    try:
        for argv in (["tokenize", "--profile", profile, "--force"],
                     ["tokenize", "--profile", elsewhere, "--output", dataset, "--force"],
                     ["merge", "--base", dataset, "--add", other, "--in-place"],
                     ["merge", "--base", other, "--add", other, "--output", run_dir / "merged"],
                     ["export", run_dir / "train" / "checkpoints" / "step-1", "--for", "vllm", "-o", run_dir / "export"],
                     ["eval", "--profile", profile]):
            result = cli(*argv)
            assert result.code == 2, (argv, result.err)
            assert result.err.startswith(f"error: run directory {run_dir} is in use by `launcher.py train` "
                                         f"(pid {holder.pid} on"), (argv, result.err)
        assert tree_digest(dataset) == before and not (run_dir / "merged").exists()
        assert cli("merge", "--base", other, "--add", dataset, "--output", tmp_path / "merged").code == 0   # outside it
    finally:
        holder.kill()
        holder.wait()
