"""The agreed micro-batch and recovery by restart (dflash.train.rank.autobatch): the fault-injection
switch, the OOM record a rank writes before it exits, the halving every rank takes from the
records at its start (real torchrun gloo ranks for the agreement), and the launcher's decision to
restart. The whole recovery, in each phase of the real trainer's step, is in tests/train/test_torchrun.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.train.rank import autobatch
from dflash.train.rank.faults import INJECT_ENV
from launcher_core.errors import RunFailed

HERE = Path(__file__).resolve().parent


# --- the record, the exit, the start after it -------------------------------------------------

def test_an_oom_inside_a_step_is_recorded_with_its_phase_and_ends_the_rank_for_a_restart(tmp_path):
    import torch

    from dflash.train.supervisor.heartbeat import RankProgress

    auto = autobatch.AutoBatch(4, rank=1, run_dir=tmp_path, log=lambda _: None)
    progress = RankProgress()
    with pytest.raises(autobatch.OomRestart) as ended:
        with auto.guard(7, lambda: progress.phase):
            progress.enter("forward", 7)
            progress.enter("backward")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert ended.value.code == autobatch.OOM_EXIT_CODE
    assert autobatch.read_oom_records(tmp_path) == [autobatch.OomRecord(1, 7, 4, "backward", "CUDA out of memory. "
                                                                         "Tried to allocate 2.00 GiB")]
    with auto.guard(8, lambda: progress.phase):             # anything else passes through unchanged
        pass
    with pytest.raises(ValueError):
        with auto.guard(8, lambda: progress.phase):
            raise ValueError("not an OOM")


def test_the_start_after_an_oom_halves_persists_the_reduction_and_clears_the_records(tmp_path):
    autobatch.write_oom_record(tmp_path, autobatch.OomRecord(1, 3, 4, "backward", ""))
    autobatch.save_run_state(autobatch.run_state_path(tmp_path), autobatch.RunState(4))
    auto = autobatch.AutoBatch.start(8, tmp_path, rank=0, log=lambda _: None)
    assert auto.micro_batch == 2
    saved = autobatch.load_run_state(autobatch.run_state_path(tmp_path))
    assert saved.micro_batch == 2 and saved.reductions[0] == {**saved.reductions[0], "step": 3, "from": 4, "to": 2,
                                                                "failed_ranks": 1, "phase": "backward"}
    assert autobatch.read_oom_records(tmp_path) == []
    again = autobatch.AutoBatch.start(8, tmp_path, rank=0, log=lambda _: None)
    assert again.micro_batch == 2 and len(autobatch.load_run_state(autobatch.run_state_path(tmp_path)).reductions) == 1


def test_an_oom_at_micro_batch_one_fails_the_restart_with_what_to_change(tmp_path):
    autobatch.write_oom_record(tmp_path, autobatch.OomRecord(0, 5, 1, "forward", ""))
    with pytest.raises(RunFailed, match="micro-batch 1 .forward.: one sequence does not fit.*activation_checkpointing"):
        autobatch.AutoBatch.start(1, tmp_path, rank=0, log=lambda _: None)
    autobatch.clear_oom_records(tmp_path)
    autobatch.write_oom_record(tmp_path, autobatch.OomRecord(0, 5, 1, "optimizer", ""))
    with pytest.raises(RunFailed, match="AdamW's states.*memory.margin"):
        autobatch.AutoBatch.start(1, tmp_path, rank=0, log=lambda _: None)


def test_the_launcher_restarts_only_after_a_recorded_oom_and_never_for_micro_batch_one(tmp_path):
    import dataclasses

    from dflash.train.supervisor.launch import TrainPaths, oom_restart_limit, restart_after_oom
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    paths = TrainPaths(tmp_path)
    assert not restart_after_oom(profile, paths, 0)                       # no record: an ordinary failure
    autobatch.write_oom_record(tmp_path, autobatch.OomRecord(1, 3, 4, "sync", ""))
    assert restart_after_oom(profile, paths, 0)
    with pytest.raises(RunFailed, match="out of memory again after 3"):
        restart_after_oom(profile, paths, oom_restart_limit(profile))
    assert oom_restart_limit(dataclasses.replace(profile, train=dataclasses.replace(profile.train, max_micro_batch=16))) == 5
    autobatch.clear_oom_records(tmp_path)
    autobatch.write_oom_record(tmp_path, autobatch.OomRecord(1, 3, 1, "forward", ""))
    with pytest.raises(RunFailed, match="micro-batch 1"):
        restart_after_oom(profile, paths, 0)


# --- real ranks: torchrun, gloo, 2 processes ----------------------------------------------

def torchrun(tmp_path: Path, planned: str, run_dir: Path) -> dict[int, dict]:
    env = {k: v for k, v in os.environ.items() if k != INJECT_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--log-dir", str(tmp_path / "torchrun-logs"),      # not a torchelastic_* folder in /tmp
               str(HERE / "autobatch_worker.py"), "--out", str(out), "--run-dir", str(run_dir),
               "--planned-by-rank", planned]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("torchrun hung (ranks killed)")
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.slow
def test_a_smaller_plan_on_rank_1_or_its_oom_record_sets_both_ranks(tmp_path):
    ranks = torchrun(tmp_path / "a", "4,2", tmp_path / "run")
    assert [ranks[r]["agreed"] for r in (0, 1)] == [2, 2]
    autobatch.write_oom_record(tmp_path / "run", autobatch.OomRecord(1, 9, 2, "forward", ""))   # rank 1 alone
    ranks = torchrun(tmp_path / "b", "4,4", tmp_path / "run")
    assert [ranks[r]["agreed"] for r in (0, 1)] == [1, 1]                                    # both halve
    assert any("restarted after an OOM on 1 rank(s) at step 9" in line for line in ranks[0]["log"])
    assert autobatch.read_oom_records(tmp_path / "run") == []
