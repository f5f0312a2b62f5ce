"""`launcher.py calibrate` and where its result goes: the baseline (still a valid snapshot, kept by a
new `baseline save`), read by `plan` by default, which says which memory model it used. The
worst-case bench is built through the trainer's `build_state` (a real step runs on the CPU; the
measurement itself needs a GPU: tests/gpu/test_calibrate_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

REPO = Path(launcher.__file__).resolve().parent
SNAPSHOT = REPO / "tests/fixtures/snapshots/rtx6000-x8-baseline.json"
CALIBRATION = REPO / "tests/fixtures/memory/rtx6000-x8-calibration.json"


def run_launcher(*args: str, baselines: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_BASELINE_DIR": str(baselines)}
    return subprocess.run([sys.executable, str(REPO / "launcher.py"), *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def fixture_calibration():
    from dflash.memory.calibration_record import load_calibration

    return load_calibration(json.loads(CALIBRATION.read_text()), str(CALIBRATION))


@pytest.fixture
def calibrated_baseline(tmp_path) -> Path:
    """`baseline save --from` the recorded node, then the calibration written into it."""
    from dflash.measure.gpu_calibration import store_calibration

    saved = run_launcher("baseline", "save", "--profile", "rtx6000-x8", "--from", str(SNAPSHOT), baselines=tmp_path)
    assert saved.returncode == 0, saved.stderr
    path = tmp_path / "rtx6000-x8" / "gpu-node-07.json"
    store_calibration(path, fixture_calibration())
    return path


def test_the_calibration_lands_in_the_baseline_which_stays_a_valid_snapshot(calibrated_baseline):
    from envcheck.snapshot import load_snapshot

    document = json.loads(calibrated_baseline.read_text())
    assert document["memory_calibration"]["slope_mib"] == fixture_calibration().slope_mib == 7015.0
    assert document["hostname"] == "gpu-node-07" and document["gpus"]          # the snapshot is intact
    assert load_snapshot(calibrated_baseline).memory_calibration["workload_key"] == fixture_calibration().workload_key


def test_a_new_baseline_save_keeps_the_calibration(calibrated_baseline):
    again = run_launcher("baseline", "save", "--profile", "rtx6000-x8", "--from", str(SNAPSHOT),
                         baselines=calibrated_baseline.parent.parent)
    assert again.returncode == 0, again.stderr
    assert "kept the memory calibration" in again.stdout
    assert json.loads(calibrated_baseline.read_text())["memory_calibration"]["intercept_mib"] == fixture_calibration().intercept_mib


def test_audit_reads_a_calibrated_baseline(calibrated_baseline):
    done = run_launcher("audit", "--profile", "rtx6000-x8", "--snapshot", str(SNAPSHOT), "--json",
                        baselines=calibrated_baseline.parent.parent)
    assert done.returncode in (0, 1, 3), done.stderr
    assert "counts" in json.loads(done.stdout)


def test_plan_uses_the_saved_baseline_by_default_and_names_it(calibrated_baseline):
    done = run_launcher("plan", "--profile", "rtx6000-x8", "--snapshot", str(SNAPSHOT),
                        baselines=calibrated_baseline.parent.parent)
    assert done.returncode == 0, done.stderr
    assert f"memory model: calibration from {calibrated_baseline}" in done.stdout
    assert "x 3 micro-batches" in done.stdout           # the calibrated line plans 3


def test_plan_says_when_it_uses_the_analytic_model(tmp_path):
    done = run_launcher("plan", "--profile", "rtx6000-x8", "--snapshot", str(SNAPSHOT), "--json", baselines=tmp_path)
    plan = json.loads(done.stdout)["plan"]
    assert plan["peak_model"]["source"] == "estimate" and plan["model_source"].startswith("analytic model (no baseline")


def test_plan_rejects_a_calibration_of_another_workload_and_says_so(tmp_path):
    variant = tmp_path / "longer.toml"
    variant.write_text('extends = "rtx6000-x8"\n[data]\nmax_length = 4096\n')
    done = run_launcher("plan", "--profile", str(variant), "--snapshot", str(SNAPSHOT), "--baseline", str(CALIBRATION),
                        baselines=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "memory model: analytic model: the calibration in" in done.stdout and "another workload" in done.stdout


def test_calibrate_refuses_a_cpu_profile_with_a_usage_error(tmp_path):
    done = run_launcher("calibrate", "--profile", "cpu-demo", baselines=tmp_path)
    assert done.returncode == 2 and "machine.device" in done.stderr
    assert not any(tmp_path.iterdir())                  # nothing written


def test_calibrate_without_a_cuda_device_cannot_test(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = run_launcher("calibrate", "--profile", "h200-x1", baselines=tmp_path)
    assert done.returncode == 125 and "no CUDA device" in done.stderr
    assert not any(tmp_path.iterdir())


def test_worst_case_bench_builds_through_build_state_and_steps_two_micro_batches(tmp_path, tiny_qwen3_target):
    """On the CPU: every row at max_length with the full anchors, the state from build_state (the
    drafter sharded by FSDP2 over the measuring process), a real step of two micro-batches of 2."""
    from dflash.measure.gpu_calibration import MICRO_BATCHES_PER_STEP, step_at, worst_case_bench
    from dflash.train.rank.parallel import is_sharded

    profile = tiny_worst_case_profile(tiny_qwen3_target, nproc=4)
    bench = worst_case_bench(profile, tmp_path, rows=MICRO_BATCHES_PER_STEP * 2)
    batch = bench.state.data.collate([0, 1], 0)
    assert batch.input_ids.shape == (2, 48) and bool(batch.anchor_valid.all()) and batch.anchors.shape[1] == 8
    assert bench.state.autobatch is None and bench.workload.world_size == 4 and bench.ranks == 1
    assert is_sharded(bench.state.drafter)
    assert 0 < bench.start_s < 120                      # build_state timed: what a restart pays again (plan)
    stats = step_at(bench, 2)
    assert stats.tokens == 4 * 48 and stats.loss > 0


def test_the_reserve_is_measured_over_differently_shaped_micro_batches(tmp_path, tiny_qwen3_target):
    """The bench's dataset holds, after the worst-case rows, rows of 1/4, 3/4 and 1/2 of max_length, and
    measure_reserve's run steps through each shape then the worst case: real steps on the CPU here (the
    allocator's peaks themselves need CUDA: tests/gpu/test_calibrate_gpu.py)."""
    from dflash.measure.gpu_calibration import run_varied_shapes, varied_lengths, varied_row_range, worst_case_bench

    profile = tiny_worst_case_profile(tiny_qwen3_target, nproc=4)
    bench = worst_case_bench(profile, tmp_path, rows=4)
    assert varied_lengths(48) == (12, 36, 24)
    for shape, length in enumerate(varied_lengths(48)):
        batch = bench.state.data.collate(varied_row_range(4, 4, shape)[:2], 0)
        assert batch.input_ids.shape == (2, length), shape
    steps = run_varied_shapes(bench, 2)                 # three shorter shapes, then the worst case
    assert [stats.tokens for stats in steps] == [4 * 12, 4 * 36, 4 * 24, 4 * 48]
    assert all(stats.loss > 0 for stats in steps)


def test_a_multi_rank_profile_is_calibrated_on_2_ranks_only_where_2_gpus_exist():
    from dflash.measure.gpu_calibration import calibration_ranks
    from launcher_core.profile import load_profile

    rtx, h200 = load_profile("rtx6000-x8"), load_profile("h200-x1")
    assert [calibration_ranks(rtx, gpus) for gpus in (0, 1, 2, 8)] == [1, 1, 2, 2]
    assert calibration_ranks(h200, 8) == 1


def test_the_stored_calibration_says_on_how_many_ranks_and_micro_batches_it_measured(tmp_path):
    import dataclasses

    from dflash.memory.calibration_record import load_calibration, save_calibration

    calibration = fixture_calibration()
    assert (calibration.world_size, calibration.micro_batches_per_step) == (2, 2)
    path = save_calibration(tmp_path / "baseline.json", dataclasses.replace(calibration, world_size=1))
    document = json.loads(path.read_text())
    assert document["memory_calibration"]["world_size"] == 1
    assert load_calibration(document, str(path)).world_size == 1
    older = {key: value for key, value in document["memory_calibration"].items()
             if key not in ("world_size", "micro_batches_per_step")}                  # recorded before the fields
    assert (load_calibration({"memory_calibration": older}, "old").world_size,
            load_calibration({"memory_calibration": older}, "old").micro_batches_per_step) == (1, 1)


def tiny_worst_case_profile(tiny_qwen3_target, nproc: int, backend: str = "gloo"):
    import dataclasses

    from launcher_core.profile import load_profile

    base = load_profile("cpu-demo")
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, target=str(tiny_qwen3_target), dtype="float32"),
        machine=dataclasses.replace(base.machine, nproc_per_node=nproc, backend=backend),
        data=dataclasses.replace(base.data, max_length=48),
        drafter=dataclasses.replace(base.drafter, num_layers=1, block_size=4, mask_token_id=151669, init="random",
                                    target_layer_ids=(), draft_vocab_size=0),
        train=dataclasses.replace(base.train, num_anchors=8, decay_gamma=3.0, feature_cache=False))


def step_and_report(bench) -> dict:
    """A calibration rank's hook on the CPU: one real step at micro-batch 2, its gradients and weights."""
    from dflash.measure.gpu_calibration import step_at

    stats = step_at(bench, 2)
    grads = [p.grad.full_tensor().double().norm().item() for p in bench.state.drafter.parameters() if p.grad is not None]
    return {"loss": stats.loss, "grad_norms": grads, "ranks": bench.ranks,
            "weights": sum(p.full_tensor().double().sum().item() for p in bench.state.drafter.parameters())}


@pytest.mark.slow
def test_on_2_ranks_the_calibration_step_is_the_trainers_with_fsdp2_between_them(tmp_path, tiny_qwen3_target):
    """2 gloo ranks (CPU) through the calibration's own rank entry point: the bench at world size 2,
    the drafter sharded over both, both ranks on the same worst-case rows. Each rank's loss is
    divided by the global weight (twice its own), so only the reduce-scatter's sum gives the
    one-process gradient; both ranks see the same whole weights."""
    import torch.multiprocessing as mp

    from dflash.measure.gpu_calibration import calibration_rank, free_port, worst_case_bench

    profile = tiny_worst_case_profile(tiny_qwen3_target, nproc=4)
    alone = step_and_report(worst_case_bench(profile, tmp_path / "one", rows=4))
    work = tmp_path / "two"
    work.mkdir()
    mp.spawn(calibration_rank, args=(2, free_port(), profile, str(work), 4, (), step_and_report), nprocs=2, join=True)
    r0, r1 = (json.loads((work / f"calibration-rank-{r}.json").read_text()) for r in (0, 1))
    assert r0["ranks"] == r1["ranks"] == 2 and alone["ranks"] == 1
    assert r0["grad_norms"] == pytest.approx(alone["grad_norms"], rel=1e-5)     # without the sum: half of it
    assert r0["grad_norms"] == r1["grad_norms"] and r0["weights"] == r1["weights"]
    assert r0["loss"] == pytest.approx(alone["loss"], rel=1e-5)
