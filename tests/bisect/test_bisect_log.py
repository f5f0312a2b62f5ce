"""The resumable log: a torn last line is dropped, another bisect's log is refused."""
from __future__ import annotations

import json

import pytest

from envcheck.bisect.log import BisectLog, StepRecord
from launcher_core.errors import ConfigError

HEADER = {"kind": "bisect", "fingerprint": "abc"}


def test_steps_survive_reopen_and_a_torn_line_is_dropped(tmp_path):
    path = tmp_path / "log.jsonl"
    log = BisectLog.open(path, HEADER)
    log.append(StepRecord(step=1, k=0, groups=[], result="good", exit_code=0, memory_mib=28.0))
    log.append(StepRecord(step=2, k=4, groups=["a"], result="skip", reason="inconsistent"))
    with path.open("a") as handle:
        handle.write('{"kind": "step", "step": 3, "k"')          # killed mid-write
    resumed = BisectLog.open(path, HEADER)
    assert [(step.k, step.result) for step in resumed.steps] == [(0, "good"), (4, "skip")]
    assert path.read_text().endswith("}\n") and len(path.read_text().splitlines()) == 3
    resumed.append(StepRecord(step=3, k=2, groups=["a"], result="bad", exit_code=1))
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["bisect", "step", "step", "step"]


def test_a_log_of_another_bisect_is_refused_unless_fresh(tmp_path):
    path = tmp_path / "log.jsonl"
    BisectLog.open(path, HEADER).append(StepRecord(step=1, k=0, groups=[], result="good"))
    with pytest.raises(ConfigError, match="another bisect"):
        BisectLog.open(path, {"kind": "bisect", "fingerprint": "other"})
    assert BisectLog.open(path, {"kind": "bisect", "fingerprint": "other"}, fresh=True).steps == []
