"""`launcher.py probe`: real child ranks (gloo on CPU), judged against baselines."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envcheck.memprobe import (
    PROBE_STAGES,
    ProbeOptions,
    ProbeReport,
    RankMemory,
    compare_reports,
    default_world_size,
    rank_command,
    report_from_json,
)
from launcher_core.errors import EXIT_CANNOT_TEST, EXIT_FAIL

LAUNCHER = str(Path(__file__).resolve().parents[2] / "launcher.py")
SMALL = ["--hidden", "128", "--layers", "2", "--steps", "2"]


def _report(figures: list[dict], kind: str = "cpu", oom: bool = False, switches: dict | None = None) -> ProbeReport:
    ranks = [RankMemory(rank=index, device=kind, stages=dict(stages), oom=oom) for index, stages in enumerate(figures)]
    return ProbeReport(kind=kind, ranks=ranks, versions={"torch": "2.13.0"}, switches=switches or {},
                       imports=[], packages={})


def test_growth_beyond_tolerance_on_any_rank_is_bad():
    baseline = _report([{"init": 500.0, "train_peak": 900.0}, {"init": 500.0, "train_peak": 900.0}])
    within = _report([{"init": 550.0, "train_peak": 950.0}, {"init": 500.0, "train_peak": 900.0}])
    beyond = _report([{"init": 500.0, "train_peak": 900.0}, {"init": 700.0, "train_peak": 905.0}])
    assert compare_reports(baseline, within, tolerance_mib=64).verdict == "good"
    verdict = compare_reports(baseline, beyond, tolerance_mib=64)
    assert (verdict.verdict, verdict.worst_where, verdict.worst_delta_mib) == ("bad", "rank 1 init", 200.0)


def test_oom_is_bad_and_switch_changes_are_reported():
    baseline = _report([{"init": 500.0}], switches={"NCCL_CUMEM_ENABLE": None})
    current = _report([{"init": 490.0}], oom=True, switches={"NCCL_CUMEM_ENABLE": "1"})
    verdict = compare_reports(baseline, current, tolerance_mib=64)
    assert verdict.verdict == "bad"
    assert "NCCL_CUMEM_ENABLE: None -> '1'" in verdict.notes


def test_other_memory_kind_or_no_common_stage_cannot_be_tested():
    assert compare_reports(_report([{"init": 1.0}], "cuda"), _report([{"init": 1.0}]), 64).verdict == "cannot_test"
    assert compare_reports(_report([{"init": 1.0}]), _report([{"model": 1.0}]), 64).verdict == "cannot_test"


def test_rank_command_follows_the_torchrun_contract(tmp_path):
    options = ProbeOptions(imports=["memhog"], python="/venv/bin/python")
    argv, env = rank_command(options, rank=1, world=2, port=29511, out_dir=tmp_path, base_env={"PATH": "/bin"})
    assert argv[:3] == ["/venv/bin/python", "-m", "envcheck.memprobe"] and argv[-2:] == ["--import", "memhog"]
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == \
        ("1", "1", "2", "127.0.0.1", "29511")


def test_ranks_default_to_the_visible_gpus_and_one_on_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3,5")
    assert default_world_size(ProbeOptions()) == 3
    assert default_world_size(ProbeOptions(device="cpu")) == 1
    assert default_world_size(ProbeOptions(nproc=2, device="cpu")) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert default_world_size(ProbeOptions()) == 1


def _probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, LAUNCHER, "probe", *SMALL, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_probe_measures_every_stage_on_two_gloo_ranks_and_judges_against_a_baseline(tmp_path):
    lean = _report([dict.fromkeys(PROBE_STAGES, 50.0), dict.fromkeys(PROBE_STAGES, 50.0)])   # far below torch's own cost
    (tmp_path / "lean.json").write_text(json.dumps(lean.to_json()))
    result = _probe("--nproc", "2", "--against", str(tmp_path / "lean.json"), "--out", str(tmp_path / "probe.json"))
    assert result.returncode == EXIT_FAIL and "verdict: BAD" in result.stdout, result.stdout + result.stderr
    report = report_from_json(json.loads((tmp_path / "probe.json").read_text()))
    assert report.kind == "cpu" and [rank.rank for rank in report.ranks] == [0, 1]
    for rank in report.ranks:
        assert rank.stages["train_peak"] >= rank.stages["model"] >= rank.stages["init"] > 100, rank  # torch imported
        assert rank.stages["collective"] and not rank.oom
    assert report.versions["torch"] and "torch" in {name.lower() for name in report.packages}
    assert set(report.switches) == {"CUDA_MODULE_LOADING", "NCCL_CUMEM_ENABLE", "CUBLAS_WORKSPACE_CONFIG",
                                    "PYTORCH_CUDA_ALLOC_CONF"}
    assert compare_reports(report, report, tolerance_mib=0).verdict == "good"


def test_probe_that_cannot_import_its_modules_says_cannot_test(tmp_path):
    result = _probe("--import", "no_such_module_here", "--device", "cpu")
    assert result.returncode == EXIT_CANNOT_TEST
    assert "No module named 'no_such_module_here'" in result.stderr
