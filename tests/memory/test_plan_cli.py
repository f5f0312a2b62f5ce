"""`launcher.py plan`: the per-rank table from a recorded snapshot, JSON output, nothing heavy imported."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import launcher

SNAPSHOTS = "tests/fixtures/snapshots"
CALIBRATION = "tests/fixtures/memory/rtx6000-x8-calibration.json"


def plan(*args: str) -> subprocess.CompletedProcess:
    """Run `launcher.py plan ...` in a fresh interpreter that fails if torch/transformers got imported."""
    code = ("import sys, launcher; rc = launcher.main(sys.argv[1:]);"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import';"
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "plan", *args], capture_output=True, text=True,
                          cwd=launcher.__file__.rsplit("/", 1)[0], timeout=120)


def plan_json(*args: str) -> dict:
    result = plan(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["plan"]


def test_upgrade_snapshot_makes_rank_6_the_bottleneck_with_a_reduced_micro_batch():
    baseline = plan_json("--profile", "rtx6000-x8", "--snapshot", f"{SNAPSHOTS}/rtx6000-x8-baseline.json",
                         "--baseline", CALIBRATION)
    upgraded = plan_json("--profile", "rtx6000-x8", "--snapshot", f"{SNAPSHOTS}/rtx6000-x8-cu130-upgrade.json",
                         "--baseline", CALIBRATION)
    assert baseline["micro_batch"] == 2 and baseline["bottleneck_ranks"] == []
    assert upgraded["bottleneck_ranks"] == [6]
    assert [r["feasible_micro_batch"] for r in upgraded["ranks"]] == [2, 2, 2, 2, 2, 2, 1, 2]
    assert (upgraded["micro_batch"], upgraded["accum_steps"]) == (1, 8)
    for document in (baseline, upgraded):                   # the profile's global batch, exactly
        assert sum(document["micro_batch_sizes"]) * document["world_size"] == document["global_batch"] == 64
    rank6 = upgraded["ranks"][6]
    assert rank6["overhead_source"] == "probe" and rank6["overhead_mib"] == 636
    assert rank6["budget_mib"] == pytest.approx(97_152 * 0.9 - 636)
    assert upgraded["peak_model"]["source"] == "calibration"
    assert 90 < upgraded["offline_storage"]["terabytes"] < 95


def test_table_names_every_column_marks_rank_6_and_prints_the_storage_comparison():
    result = plan("--profile", "rtx6000-x8", "--snapshot", f"{SNAPSHOTS}/rtx6000-x8-cu130-upgrade.json",
                  "--baseline", CALIBRATION)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "budget MiB" in line)
    for column in ("gpu", "free MiB", "overhead MiB", "static MiB", "peak MiB", "micro", "accum"):
        assert column in header
    rank6 = next(line for line in lines if line.split()[:2] == ["6", "6"])
    assert "97,152" in rank6 and "1 <" in rank6
    assert "global batch per optimizer step: 64 sequences = 8 ranks x 8 micro-batches" in result.stdout
    assert "bottleneck: rank(s) 6" in result.stdout and "92.4 TB" in result.stdout


def test_uncalibrated_estimate_is_used_and_says_so_when_nothing_fits():
    result = plan("--profile", "rtx6000-x8", "--snapshot", f"{SNAPSHOTS}/rtx6000-x8-baseline.json")
    assert result.returncode == 0, result.stderr
    assert "from the estimate" in result.stdout and "NOT FEASIBLE" in result.stdout


def test_cuda_profile_without_snapshot_or_nvml_is_a_usage_error():
    result = plan("--profile", "rtx6000-x8")
    if result.returncode == 0:
        pytest.skip("this machine has NVIDIA GPUs: plan read them through NVML")
    assert result.returncode == 2 and "--snapshot FILE" in result.stderr


def test_missing_snapshot_file_is_named():
    result = plan("--profile", "rtx6000-x8", "--snapshot", "no/such.json")
    assert result.returncode == 2 and "no/such.json: file not found" in result.stderr
