"""The probe command builder and the reading of its exit codes (git bisect run's)."""
from __future__ import annotations

import pytest

from envcheck.bisect.runner import _outcome, probe_command
from launcher_core.errors import RunFailed


def test_probe_command_runs_the_candidate_python_with_report_paths_in_env(tmp_path):
    venv = tmp_path / "venvs" / "k003"
    argv, env = probe_command("python launcher.py probe --out {out} --tag {venv}", venv, tmp_path / "k003.json",
                              baseline=str(tmp_path / "k000.json"))
    assert argv == [str(venv / "bin" / "python"), "launcher.py", "probe", "--out", str(tmp_path / "k003.json"),
                    "--tag", str(venv)]
    assert env["PATH"].split(":")[0] == str(venv / "bin") and env["VIRTUAL_ENV"] == str(venv)
    assert env["ENVCHECK_PROBE_BASELINE"] == str(tmp_path / "k000.json")
    _, good_env = probe_command("{python} x.py", venv, tmp_path / "k000.json", baseline=None)
    assert "ENVCHECK_PROBE_BASELINE" not in good_env
    assert [_outcome(code, argv) for code in (0, 1, 2, 125, 127)] == ["good", "bad", "bad", "skip", "bad"]
    with pytest.raises(RunFailed, match="exited with -9"):
        _outcome(-9, argv)
