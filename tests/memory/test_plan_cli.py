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
    assert baseline["peak_model"]["source"] == "calibration"
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
    for column in ("gpu", "free MiB", "overhead MiB", "static MiB", "peak MiB", "reserved MiB", "micro", "accum"):
        assert column in header
    assert "planned reserve: allocated peak 76,515 MiB x reserve ratio 1.040 = 79,575 MiB reserved at micro-batch 2" \
        in result.stdout                                # the calibration's measured ratio (synthetic fixture)
    rank6 = next(line for line in lines if line.split()[:2] == ["6", "6"])
    assert "97,152" in rank6 and "2 <" in rank6
    assert "global batch per optimizer step: 64 sequences = 8 ranks x 4 micro-batches" in result.stdout
    assert "drafter sharded over 8 rank(s) by FSDP2" in result.stdout
    assert "supervised slots per target forward: 15,360 per sequence (1024 anchors x 15 slots)" in result.stdout
    assert "bottleneck: rank(s) 6" in result.stdout and "92.4 TB" in result.stdout


def test_flagship_plan_trains_1024_anchors_sharded_and_recomputed_and_says_what_each_part_buys(tmp_path):
    """rtx6000-x8 on the baseline node: the drafter sharded over 8 ranks by FSDP2 (825 MiB of float32
    weights a rank; from the second micro-batch of a step on, 825 MiB of gradient shards alive),
    gathered in bf16, each layer recomputed: 1,024 anchors per 8,192-token sequence at micro-batch 3, whose
    allocated peak (78,737 MiB) times the default reserve ratio (1.05: 82,674 reserved) fits the 87,022 MiB
    budget; micro-batch 4 (86,050 allocated) would fit only with the allocator's reserve left out.
    Without the recomputation one sequence (84,349 allocated, 88,567 reserved) does not fit, 2,048 anchors
    do not either; the recipe's 512 fit even in float32 compute."""
    node = f"{SNAPSHOTS}/rtx6000-x8-baseline.json"
    shipped = plan_json("--profile", "rtx6000-x8", "--snapshot", node)
    assert shipped["workload"]["world_size"] == 8 and shipped["peak_model"]["source"] == "estimate"
    assert shipped["workload"]["num_anchors"] == 1024 and shipped["workload"]["activation_checkpointing"] == "layers"
    assert shipped["peak_model"]["accumulation_mib"] == shipped["estimate_mib"]["drafter_grads"] == pytest.approx(825, abs=1)
    assert [r["feasible_micro_batch"] for r in shipped["ranks"]] == [3] * 8
    reserve = shipped["reserve"]
    assert (reserve["ratio"], reserve["source"]) == (1.05, "default") and "unproven" in reserve["detail"]
    assert reserve["reserved_peak_mib"] == pytest.approx(1.05 * shipped["ranks"][0]["peak_at_agreed_mib"], abs=0.1)
    assert all(reserve["reserved_peak_mib"] <= rank["budget_mib"] for rank in shipped["ranks"])
    (tmp_path / "rtx6000-x8.toml").write_text((REPO / "profiles" / "rtx6000-x8.toml").read_text())
    for name, body, fits in (("no-recompute", 'activation_checkpointing = "none"', 0),
                             ("2048-no-recompute", 'num_anchors = 2048\nactivation_checkpointing = "none"', 0),
                             ("recipe-fp32", 'num_anchors = 512\ncompute_dtype = "float32"\nactivation_checkpointing = "none"', 1)):
        variant = tmp_path / f"rtx-{name}.toml"
        variant.write_text(f'extends = "rtx6000-x8"\n[train]\n{body}\n')
        document = plan_json("--profile", str(variant), "--snapshot", node)
        assert [r["feasible_micro_batch"] for r in document["ranks"]] == [fits] * 8, name
    result = plan("--profile", str(tmp_path / "rtx-2048-no-recompute.toml"), "--snapshot", node)
    assert "NOT FEASIBLE" in result.stdout and "activation checkpointing: none" in result.stdout


def test_b200_and_h200_profiles_are_feasible(tmp_path):
    b200 = plan_json("--profile", "b200-x8", "--snapshot", f"{SNAPSHOTS}/b200-x8-nvcc128-cu130.json")
    assert 1 <= b200["micro_batch"] <= 8                      # 6 with the 32 x 128 drafter (5 with the target-shaped one)
    assert sum(b200["micro_batch_sizes"]) * b200["world_size"] == b200["global_batch"] == 64
    from envcheck.snapshot import GpuFacts, Snapshot, save_snapshot

    h200_gpu = GpuFacts(index=0, uuid="GPU-0f3a", name="NVIDIA H200", compute_capability="9.0",      # as NVML reports it
                    memory_total_mib=143_771, memory_free_mib=143_190, memory_used_mib=581)
    h200_node = save_snapshot(Snapshot(gpus=[h200_gpu]), tmp_path / "h200.json")
    h200 = plan_json("--profile", "h200-x1", "--snapshot", str(h200_node))
    assert h200["workload"]["world_size"] == 1                   # one rank: FSDP2 over a group of one
    assert h200["micro_batch"] >= 1 and sum(h200["micro_batch_sizes"]) == h200["global_batch"] == 8


def test_cuda_profile_without_snapshot_or_nvml_is_a_usage_error():
    result = plan("--profile", "rtx6000-x8")
    if result.returncode == 0:
        pytest.skip("this machine has NVIDIA GPUs: plan read them through NVML")
    assert result.returncode == 2 and "--snapshot FILE" in result.stderr


def test_missing_snapshot_file_is_named():
    result = plan("--profile", "rtx6000-x8", "--snapshot", "no/such.json")
    assert result.returncode == 2 and "no/such.json: file not found" in result.stderr


def test_the_plan_says_what_the_checkpoints_take_and_whether_the_kept_ones_fit_the_run_directory(tmp_path):
    """rtx6000-x8's drafter: 825 MiB of float32 weights and 1,650 of AdamW states on each of 8 ranks, so a
    checkpoint is 8 x (825 + 1,650) of shards, about 19.3 GiB, and the last one also 8 x 825 of model.safetensors;
    keeping 3, at most 5 are on disk at once. On a node with 100 GiB free at the run directory they do not fit."""
    from envcheck.snapshot import load_snapshot, save_snapshot

    node = f"{SNAPSHOTS}/rtx6000-x8-baseline.json"
    shipped = plan_json("--profile", "rtx6000-x8", "--snapshot", node)["checkpoints"]
    weights = shipped["weights_mib"]
    assert weights == pytest.approx(8 * 825, rel=0.01) and shipped["sharded_mib"] == pytest.approx(3 * weights)
    assert shipped["each_mib"] == pytest.approx(3 * weights) and 19 < shipped["each_mib"] / 1024 < 20
    assert (shipped["keep"], shipped["held"], shipped["every_steps"]) == (3, 5, 500)
    assert shipped["need_mib"] == pytest.approx(5 * shipped["each_mib"] + weights) and shipped["fits"] is True
    assert (shipped["every_minutes"], shipped["asynchronous"]) == (60, True)
    text = plan("--profile", "rtx6000-x8", "--snapshot", node).stdout
    assert "at most 5 on disk (train.keep_checkpoints 3, the best by held-out tau, one being written) = 103.1 GiB; " \
           "3,276.8 GiB free at /data/runs/rtx6000-x8" in text
    small = load_snapshot(REPO / node)
    small.host.disks[0].free_mib = 100 * 1024
    small_node = save_snapshot(small, tmp_path / "small.json")
    assert plan_json("--profile", "rtx6000-x8", "--snapshot", str(small_node))["checkpoints"]["fits"] is False
    assert "= 103.1 GiB; 100.0 GiB free at /data/runs/rtx6000-x8 (DOES NOT FIT: train refuses the run)" in \
        plan("--profile", "rtx6000-x8", "--snapshot", str(small_node)).stdout
    assert "DOES NOT FIT" not in text
    (tmp_path / "all.toml").write_text('extends = "rtx6000-x8"\n[train]\nkeep_checkpoints = 0\n')
    every = plan("--profile", str(tmp_path / "all.toml"), "--snapshot", str(small_node)).stdout
    assert "every one kept (train.keep_checkpoints 0); 100.0 GiB free at /data/runs/rtx6000-x8, 5 saves fill it" in every


def test_the_plan_says_what_an_oom_restart_costs(tmp_path):
    """An OOM restarts every rank from the last checkpoint: rtx6000-x8's 8 ranks each reload the 27B target's
    layers up to the deepest tap (the plan's target weights, ~49 GiB a rank), and the run recomputes up to 500
    steps, at most 60 minutes of them (train.save_every_minutes); without the minutes it is not bounded in time."""
    node = f"{SNAPSHOTS}/rtx6000-x8-baseline.json"
    document = plan_json("--profile", "rtx6000-x8", "--snapshot", node)
    restart, target = document["restart"], document["estimate_mib"]["target_weights"]
    assert (restart["ranks"], restart["steps_at_risk"], restart["minutes_at_risk"]) == (8, 500, 60)
    assert 48 * 1024 < restart["target_mib"] < 50 * 1024 and restart["start_s"] is None
    assert restart["target_mib"] == pytest.approx(target)
    text = plan("--profile", "rtx6000-x8", "--snapshot", node).stdout
    assert ("an OOM restart: every rank reloads the target (49.0 GiB a rank, 392.2 GiB read on the node; its load "
            "time not yet measured: `launcher.py calibrate` measures it)\n  and the run recomputes up to 500 steps or "
            "60 minutes of them, whichever is less (train.save_every_minutes) since the last checkpoint") in text
    measured = json.loads((REPO / CALIBRATION).read_text())
    measured["memory_calibration"]["start_s"] = 212.0            # calibrate's build_state: the target loaded and more
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    calibrated = plan_json("--profile", "rtx6000-x8", "--snapshot", node, "--baseline", str(tmp_path / "measured.json"))
    assert calibrated["restart"]["start_s"] == 212.0
    assert "(49.0 GiB a rank, 392.2 GiB read on the node; a rank's start, target load included, 212 s as calibrate " \
           "measured it)" in plan("--profile", "rtx6000-x8", "--snapshot", node, "--baseline",
                                  str(tmp_path / "measured.json")).stdout
    measured["memory_calibration"]["start_s"] = "slow"
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    refused = plan("--profile", "rtx6000-x8", "--snapshot", node, "--baseline", str(tmp_path / "measured.json"))
    assert refused.returncode == 2 and "'start_s' must be a number of seconds" in refused.stderr
    (tmp_path / "steps.toml").write_text('extends = "rtx6000-x8"\n[train]\nsave_every_minutes = 0\nsave_every_steps = 200\n')
    steps_only = plan("--profile", str(tmp_path / "steps.toml"), "--snapshot", node).stdout
    assert "recomputes up to 200 steps (not bounded in time: train.save_every_minutes is 0)" in steps_only


def test_the_plan_says_when_a_stuck_rank_is_named(tmp_path):
    """The stuck bound from the profile (dflash.train.supervisor.watchdog): the floor, the step multiple, the collective
    timeout it beats and the heartbeat timeout; a floor not below the collective timeout is refused (exit 2)."""
    node = f"{SNAPSHOTS}/rtx6000-x8-baseline.json"
    stuck = plan_json("--profile", "rtx6000-x8", "--snapshot", node)["stuck_rank"]
    assert (stuck["floor_s"], stuck["after_steps"], stuck["collective_timeout_s"]) == (120.0, 5.0, 600.0)
    (tmp_path / "fast.toml").write_text('extends = "rtx6000-x8"\n[train]\nstuck_floor_s = 45\nstuck_after_steps = 3\n')
    text = plan("--profile", str(tmp_path / "fast.toml"), "--snapshot", node).stdout
    assert ("stuck rank: named after max(45 s, 3 x the measured step) without progress (train.stuck_floor_s, "
            "train.stuck_after_steps), before the 600 s collective timeout; a rank silent 120 s is named stopped") in text
    (tmp_path / "late.toml").write_text('extends = "rtx6000-x8"\n[train]\nstuck_floor_s = 600\n')
    refused = plan("--profile", str(tmp_path / "late.toml"), "--snapshot", node)
    assert refused.returncode == 2 and "train.stuck_floor_s" in refused.stderr and "collective_timeout_s" in refused.stderr


def test_the_plan_says_the_host_ram_the_node_needs_at_start_and_train_refuses_a_node_without_it(tmp_path):
    """rtx6000-x8: per rank the runtime (512 MiB + a 1,536 MiB CUDA allowance), the largest target tensor on its
    way to the GPU (the 248,320 x 5120 embedding in bf16, 2,425 MiB) and twice the largest drafter init unit
    (fc, 5120 x 25,600 float32, 500 MiB): 8 x 5,473 MiB = 42.8 GiB; the drafter built whole on the host (1.73 B
    float32 parameters, 6,600 MiB a rank) needed 86.5 GiB. The fixture node's 2 TiB hold it, 40 GiB do not."""
    from dflash.memory.budget import make_plan
    from dflash.memory.host_ram import host_ram_at_start
    from dflash.train.supervisor.launch import check_host_ram
    from envcheck.snapshot import load_snapshot, save_snapshot
    from launcher_core.errors import PreflightFailed
    from launcher_core.profile import load_profile

    node = f"{SNAPSHOTS}/rtx6000-x8-baseline.json"
    shipped = plan_json("--profile", "rtx6000-x8", "--snapshot", node)["host_ram_at_start"]
    assert (shipped["ranks"], shipped["runtime_mib"], shipped["target_mib"]) == (8, 2048.0, 2425.0)
    assert shipped["drafter_init_mib"] == 1000.0 and shipped["drafter_shards_mib"] == 0.0
    assert shipped["node_mib"] == 8 * 5473.0 and shipped["fits"] is True
    assert 6500 < shipped["whole_drafter_mib"] < 6700 and shipped["whole_node_mib"] > 2 * shipped["node_mib"]
    text = plan("--profile", "rtx6000-x8", "--snapshot", node).stdout
    assert "host RAM at start: 8 rank(s) x 5.3 GiB = 42.8 GiB of the node's 2,015.5 GiB (per rank: runtime 2.0 GiB" in text
    assert "the drafter built whole on the host would need 86.5 GiB" in text
    small = load_snapshot(REPO / node)
    small.host.ram_total_mib = 40 * 1024
    small_node = save_snapshot(small, tmp_path / "small.json")
    assert plan_json("--profile", "rtx6000-x8", "--snapshot", str(small_node))["host_ram_at_start"]["fits"] is False
    assert "= 42.8 GiB of the node's 40.0 GiB (DOES NOT FIT) (per rank" in plan("--profile", "rtx6000-x8", "--snapshot",
                                                                                  str(small_node)).stdout
    assert "DOES NOT FIT" not in text
    profile = load_profile("rtx6000-x8")
    made = make_plan(profile, small)
    with pytest.raises(PreflightFailed, match="need 42.8 GiB of host RAM at start .* the node has 40.0 GiB"):
        check_host_ram(profile, made, ram_mib=40 * 1024)
    check_host_ram(profile, made, ram_mib=64 * 1024)          # the profile's audit.min_ram_gib holds it now
    assert host_ram_at_start(profile, made).whole_node_mib > 64 * 1024      # and did not hold the order before
