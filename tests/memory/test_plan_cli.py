"""`launcher.py plan`: the per-rank table from a recorded snapshot, JSON output, nothing heavy imported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

REPO = Path(launcher.__file__).resolve().parent
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
    assert baseline["micro_batch"] == 3 and baseline["bottleneck_ranks"] == []
    assert baseline["micro_batch_sizes"] == [3, 3, 2]
    assert upgraded["bottleneck_ranks"] == [6]
    assert [r["feasible_micro_batch"] for r in upgraded["ranks"]] == [3, 3, 3, 3, 3, 3, 2, 3]
    assert (upgraded["micro_batch"], upgraded["accum_steps"]) == (2, 4)
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
    assert "97,152" in rank6 and "2 <" in rank6
    assert "global batch per optimizer step: 64 sequences = 8 ranks x 4 micro-batches" in result.stdout
    assert "AdamW states sharded over 8 ranks (zero1)" in result.stdout
    assert "bottleneck: rank(s) 6" in result.stdout and "92.4 TB" in result.stdout


def test_flagship_plan_counts_the_accumulated_gradients_and_zero1_decides_a_shorter_worst_case(tmp_path):
    """rtx6000-x8 at the recipe's 512 anchors (8192 tokens): from the second of its 8 micro-batches
    on, the first ones' 6,600 MiB of float32 gradients are alive in the forward/backward (the traced
    step shows it), so one sequence does not fit a 96 GB card; the profile's 384 anchors fit. At 256
    anchors it fits with the AdamW states sharded over 8 ranks (1,680 MiB a rank) and not with them
    replicated (13,200 MiB)."""
    node = f"{SNAPSHOTS}/rtx6000-x8-baseline.json"
    shipped = plan_json("--profile", "rtx6000-x8", "--snapshot", node)
    assert shipped["workload"]["optimizer_shards"] == 8 and shipped["peak_model"]["source"] == "estimate"
    assert shipped["peak_model"]["accumulation_mib"] == shipped["estimate_mib"]["drafter_grads"] == pytest.approx(6600, abs=1)
    assert [r["feasible_micro_batch"] for r in shipped["ranks"]] == [1] * 8
    (tmp_path / "rtx6000-x8.toml").write_text((REPO / "profiles" / "rtx6000-x8.toml").read_text())
    recipe = tmp_path / "rtx-512.toml"
    recipe.write_text('extends = "rtx6000-x8"\n[train]\nnum_anchors = 512\n')
    rank = plan_json("--profile", str(recipe), "--snapshot", node)["ranks"][0]
    assert rank["feasible_micro_batch"] == 0 and rank["peak_at_agreed_mib"] > rank["budget_mib"]
    for sharding, fits in (("zero1", [1] * 8), ("none", [0] * 8)):
        variant = tmp_path / f"rtx-{sharding}.toml"
        variant.write_text(f'extends = "rtx6000-x8"\n[train]\nnum_anchors = 256\noptimizer_sharding = "{sharding}"\n')
        document = plan_json("--profile", str(variant), "--snapshot", node)
        assert [r["feasible_micro_batch"] for r in document["ranks"]] == fits, sharding
    result = plan("--profile", str(tmp_path / "rtx-none.toml"), "--snapshot", node)
    assert "NOT FEASIBLE" in result.stdout and "AdamW states on every rank" in result.stdout


def test_b200_and_h200_profiles_are_feasible(tmp_path):
    b200 = plan_json("--profile", "b200-x8", "--snapshot", f"{SNAPSHOTS}/b200-x8-nvcc128-cu130.json")
    assert 1 <= b200["micro_batch"] <= 8                      # 6 with the 32 x 128 drafter (5 with the target-shaped one)
    assert sum(b200["micro_batch_sizes"]) * b200["world_size"] == b200["global_batch"] == 64
    from envcheck.snapshot import GpuFacts, Snapshot, save_snapshot

    h200_gpu = GpuFacts(index=0, uuid="GPU-0f3a", name="NVIDIA H200", compute_capability="9.0",      # as NVML reports it
                    memory_total_mib=143_771, memory_free_mib=143_190, memory_used_mib=581)
    h200_node = save_snapshot(Snapshot(gpus=[h200_gpu]), tmp_path / "h200.json")
    h200 = plan_json("--profile", "h200-x1", "--snapshot", str(h200_node))
    assert h200["workload"]["optimizer_shards"] == 1             # one rank: nothing to shard over
    assert h200["micro_batch"] >= 1 and sum(h200["micro_batch_sizes"]) == h200["global_batch"] == 8


def test_cuda_profile_without_snapshot_or_nvml_is_a_usage_error():
    result = plan("--profile", "rtx6000-x8")
    if result.returncode == 0:
        pytest.skip("this machine has NVIDIA GPUs: plan read them through NVML")
    assert result.returncode == 2 and "--snapshot FILE" in result.stderr


def test_missing_snapshot_file_is_named():
    result = plan("--profile", "rtx6000-x8", "--snapshot", "no/such.json")
    assert result.returncode == 2 and "no/such.json: file not found" in result.stderr
