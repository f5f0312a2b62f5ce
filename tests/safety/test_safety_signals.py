"""How a training run ends on a signal, and what the terminal shows when a rank fails, on 2 real gloo ranks.

Ctrl-C (SIGINT to the whole process group, as a terminal sends it, or to the launcher alone) and SIGTERM
are one stop: the ranks finish their step and save, the launcher exits 130 and the manifest says
`pending` with what to resume; a second one stops the run at once. The terminal holds the launcher's
words and rank 0's lines only: torchrun's own (its logging, tracebacks, the ChildFailedError report whose
"Root Cause" names the rank torchrun looked at first) go to train/logs/torchrun.log, and the launcher's
diagnosis is the last thing printed.
"""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from dflash.drafter.checkpoint_files import read_weights
from dflash.drafter.verify import verify_checkpoint
from tests.safety.runs import alive, finish, metrics_steps, start_train, wait_for, wait_for_ranks, wait_until_gone
from tests.train.conftest import write_dataset, write_profile

pytestmark = pytest.mark.slow
DATA_VOCAB = {"draft_vocab_size": 50}     # every token of write_dataset's rows: a cheap head


def start(tmp_path: Path, target: Path, env: dict[str, str] | None = None) -> tuple:
    """A run far longer than the test (400 steps, no save on the way) started with `launcher.py train`; once
    both ranks are up and 2 steps are logged: (launcher process, run dir, rank -> pid, every process of the run)."""
    run_dir = tmp_path / "run"
    profile = write_profile(tmp_path / "p.toml", target, write_dataset(tmp_path / "dataset"), run_dir,
                            max_steps=400, save_every_steps=1000, drafter=DATA_VOCAB)
    process = start_train(profile, run_dir, env=env)
    ranks = wait_for_ranks(run_dir)
    members = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    if env is None:
        wait_for(lambda: len(metrics_steps(run_dir)) >= 2, what="2 steps")
    return process, run_dir, ranks, members


def manifest_train(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]


def torchrun_log(run_dir: Path) -> str:
    path = run_dir / "train" / "logs" / "torchrun.log"
    return path.read_text(errors="replace") if path.exists() else ""


def assert_nothing_of_torchruns(out: str) -> None:
    """No traceback, no SignalException, no ChildFailedError report, no line of torch's logging (`E1207 12:00:00...`)."""
    for word in ("Traceback", "SignalException", "Root Cause", "KeyboardInterrupt", "FAILED"):
        assert word not in out, out
    assert not re.search(r"^[IWE]\d{4} \d\d:", out, re.M), out


def assert_stopped_with_a_checkpoint(code: int, out: str, run_dir: Path, by: str) -> int:
    assert code == 130, out
    step = json.loads((run_dir / "train" / "stopped.json").read_text())["step"]
    assert step >= 2 and (run_dir / "train" / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
    assert verify_checkpoint(run_dir / "train" / "checkpoints" / f"step-{step}") == []
    entry = manifest_train(run_dir)
    assert entry["state"] == "pending" and entry["stopped_at_step"] == step and entry["ended_by"] == f"stopped ({by})"
    assert entry["hint"] == f"continue from step-{step} with `launcher.py train --resume`"
    assert out.rstrip().splitlines()[-1] == (f"interrupted: training stopped by {by} after step {step}; "
                                             f"checkpoint step-{step} saved. Continue with --resume.")
    assert_nothing_of_torchruns(out)
    assert not (run_dir / "train" / "failures").exists() or not list((run_dir / "train" / "failures").iterdir())
    return step


def test_ctrl_c_to_the_process_group_finishes_the_step_saves_and_exits_130(tmp_path, tiny_qwen3_target):
    """The launcher, the agent and both ranks get SIGINT at once, as from a terminal."""
    process, run_dir, _, members = start(tmp_path, tiny_qwen3_target)
    os.killpg(process.pid, signal.SIGINT)
    code, out = finish(process)
    step = assert_stopped_with_a_checkpoint(code, out, run_dir, "SIGINT")
    assert f"stopped by SIGINT after step {step}; checkpoint" in out          # rank 0's own line, teed
    assert wait_until_gone(run_dir, members) == []


def test_sigint_to_the_launcher_alone_is_the_same_stop(tmp_path, tiny_qwen3_target):
    process, run_dir, _, members = start(tmp_path, tiny_qwen3_target)
    process.send_signal(signal.SIGINT)
    code, out = finish(process)
    assert_stopped_with_a_checkpoint(code, out, run_dir, "SIGINT")
    assert "SIGTERM: asking the rank processes" in torchrun_log(run_dir)   # passed on by the launcher
    assert wait_until_gone(run_dir, members) == []


def test_sigterm_stops_the_same_way_with_no_traceback_of_torchrun(tmp_path, tiny_qwen3_target):
    process, run_dir, _, members = start(tmp_path, tiny_qwen3_target)
    process.send_signal(signal.SIGTERM)
    code, out = finish(process)
    step = assert_stopped_with_a_checkpoint(code, out, run_dir, "SIGTERM")
    checkpoint = run_dir / "train" / "checkpoints" / f"step-{step}"
    assert not (checkpoint / "model.safetensors").exists() and read_weights(checkpoint)   # weights in dcp/, readable
    assert wait_until_gone(run_dir, members) == []


def test_a_second_ctrl_c_stops_the_run_at_once(tmp_path, tiny_qwen3_target):
    """Rank 0 held (SIGSTOP) cannot finish its step: the second Ctrl-C kills the agent, the ranks die with it."""
    process, run_dir, ranks, members = start(tmp_path, tiny_qwen3_target)
    os.kill(ranks[0], signal.SIGSTOP)
    os.killpg(process.pid, signal.SIGINT)
    wait_for(lambda: "SIGINT:" in torchrun_log(run_dir) and "SIGTERM:" in torchrun_log(run_dir), 60,
             "the agent to have both the Ctrl-C and the launcher's SIGTERM")
    os.killpg(process.pid, signal.SIGINT)
    code, out = finish(process, timeout=60)
    assert code == 130, out
    assert out.rstrip().splitlines()[-1] == ("interrupted: training interrupted by a second SIGINT: stopped at once, "
                                             "without a checkpoint at the stop; no checkpoint was written yet: "
                                             "train again to start over")
    entry = manifest_train(run_dir)
    assert entry["state"] == "pending" and entry["ended_by"] == "interrupted (forced)"
    assert not (run_dir / "train" / "stopped.json").exists()
    assert_nothing_of_torchruns(out)
    assert wait_until_gone(run_dir, members) == []


def assert_the_diagnosis_ends_the_output(out: str, run_dir: Path, first_line: str) -> None:
    """The launcher's message is the last thing on the terminal: its first line `first_line`, its last the logs'
    place; before it, nothing of torchrun's, not a frame of a traceback."""
    lines = out.rstrip().splitlines()
    assert lines[-1].startswith(f"(all rank logs: {run_dir / 'train' / 'logs'}; "), out
    start_at = max(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[start_at].startswith(first_line), out
    before = "\n".join(lines[:start_at])
    assert_nothing_of_torchruns(before)
    assert 'File "' not in before, out
    log = torchrun_log(run_dir)
    assert "Root Cause (first observed failure)" in log and "Traceback (most recent call last)" in log


def test_a_rank_killed_by_sigkill_is_the_last_word_and_torchruns_report_goes_to_the_logs(tmp_path, tiny_qwen3_target):
    process, run_dir, ranks, members = start(tmp_path, tiny_qwen3_target)
    os.kill(ranks[1], signal.SIGKILL)
    code, out = finish(process)
    assert code == 5, out
    assert_the_diagnosis_ends_the_output(out, run_dir, f"error: rank 1 (pid {ranks[1]}) was killed by SIGKILL")
    assert_nothing_of_torchruns(out)
    assert manifest_train(run_dir)["failed_rank"] == 1
    assert wait_until_gone(run_dir, members) == []


def test_a_failing_rank_is_the_last_word_and_torchruns_report_goes_to_the_logs(tmp_path, tiny_qwen3_target):
    process, run_dir, _, members = start(tmp_path, tiny_qwen3_target, env={"DFLASH_FAIL_RANK": "1:3"})
    code, out = finish(process)
    assert code == 5, out
    assert_the_diagnosis_ends_the_output(out, run_dir, "error: rank 1 failed first: RuntimeError('injected failure on "
                                                       "rank 1 at step 3")
    assert "injected failure on rank 1 at step 3" in torchrun_log(run_dir)
    assert manifest_train(run_dir)["failed_rank"] == 1
    assert wait_until_gone(run_dir, members) == []


@pytest.mark.parametrize("to_group", [True, False], ids=["group", "launcher"])
def test_a_second_ctrl_c_soon_after_the_first_stops_the_run_at_once(tmp_path, tiny_qwen3_target, to_group):
    """Two SIGINTs 0.3 s apart, to the whole process group (as a terminal sends them) or to the launcher
    alone, while rank 0 is held 3 s inside step 3 (DFLASH_INJECT_STALL): the ranks are gone well before the hold
    ends and the launcher exits 130 with the forced message; the ranks never reach the stop's save (no stopped.json, no step-3) and
    `latest` still names a whole checkpoint. The launcher kills the forked ranks right after the agent: they hold
    the forkserver's pipe, so they would outlive the agent, and the straggler grace (5 s) would leave them time to
    finish a shorter step and save at the stop (`stopped by SIGINT ... saved`)."""
    import time

    run_dir = tmp_path / "run"
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "dataset"), run_dir,
                            max_steps=400, save_every_steps=1, async_save=False, drafter=DATA_VOCAB)
    process = start_train(profile, run_dir, env={"DFLASH_INJECT_STALL": "rank=0,step=3,phase=forward,seconds=3"})
    ranks = [psutil.Process(pid) for pid in wait_for_ranks(run_dir).values()]
    members = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    wait_for(lambda: in_phase(run_dir, 0, 3, "forward"), what="rank 0 held in step 3")
    send = (lambda: os.killpg(process.pid, signal.SIGINT)) if to_group else (lambda: process.send_signal(signal.SIGINT))
    send()
    time.sleep(0.3)
    send()
    second = time.monotonic()
    while any(alive(rank) for rank in ranks) and time.monotonic() - second < 10:
        time.sleep(0.02)
    ranks_lived_s = time.monotonic() - second
    code, out = finish(process, timeout=60)
    assert code == 130, out
    assert ranks_lived_s < 2.0, f"the ranks lived {ranks_lived_s:.1f} s after the second SIGINT\n{out}"
    assert out.rstrip().splitlines()[-1] == ("interrupted: training interrupted by a second SIGINT: stopped at once, "
                                             "without a checkpoint at the stop; the last complete checkpoint is "
                                             "step-2: continue from it with --resume"), out
    checkpoints = run_dir / "train" / "checkpoints"
    assert not (run_dir / "train" / "stopped.json").exists() and not (checkpoints / "step-3").exists()
    assert (checkpoints / "latest").read_text().strip() == "step-2" and verify_checkpoint(checkpoints / "step-2") == []
    assert manifest_train(run_dir)["ended_by"] == "interrupted (forced)"
    assert_nothing_of_torchruns(out)
    assert wait_until_gone(run_dir, members) == []


def in_phase(run_dir: Path, rank: int, step: int, phase: str) -> bool:
    """The rank's heartbeat record (rewritten at every phase mark) says it is in `phase` of `step`."""
    try:
        document = json.loads((run_dir / "train" / "ranks" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return False
    return document.get("step") == step and document.get("phase") == phase
