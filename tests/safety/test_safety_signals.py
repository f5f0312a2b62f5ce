"""What the terminal shows when a rank fails, on 2 real gloo ranks.

The terminal holds the launcher's words and rank 0's lines only: torchrun's own (its logging, tracebacks,
the ChildFailedError report whose "Root Cause" names the rank torchrun looked at first) go to
train/logs/torchrun.log, and the launcher's diagnosis is the last thing printed.
"""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from tests.safety.runs import finish, metrics_steps, start_train, wait_for, wait_for_ranks, wait_until_gone
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
