"""The memory plan drives the run: `train` plans at launch (from a recorded snapshot here), writes
train/plan.json, and every rank starts from its planned micro-batch (real torchrun, gloo)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.memory import peak_estimate as memory
from dflash.memory.launch_plan import plan_for_launch, read_inputs
from dflash.train.supervisor.launch import run_training
from launcher_core.errors import PreflightFailed
from launcher_core.profile import load_profile
from tests.train.conftest import write_profile

REPO = Path(__file__).resolve().parents[2]
CONTEXT_MIB = 100.0
MARGIN = 0.10            # memory.margin default


@pytest.fixture(autouse=True)
def no_saved_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_BASELINE_DIR", str(tmp_path / "baselines"))


def profile_allowing_four(tmp_path, tiny_qwen3_target, tiny_dataset):
    path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "run",
                         max_micro_batch=4, global_batch=8, max_steps=2, save_every_steps=10)
    return path, load_profile(str(path))


def free_for(profile, sequences: float) -> float:
    """Free MiB of a GPU whose budget holds `sequences` worst-case sequences (by the plan's model)."""
    model = memory.peak_model(memory.workload_from_profile(profile, world_size=2))
    whole = int(sequences)
    budget = model.peak_mib(whole) + (sequences - whole) * model.deciding_line(whole).slope_mib
    return (budget + CONTEXT_MIB) / (1 - MARGIN)


def write_snapshot(path: Path, free: list[float]) -> Path:
    """A snapshot file as `launcher.py snapshot --cuda-probe` writes it (the probe's context figures)."""
    from envcheck.snapshot import GpuFacts, Snapshot, save_snapshot

    gpus = [GpuFacts(index=i, uuid=f"GPU-{i:04d}", name="test GPU", compute_capability="12.0",
                     memory_total_mib=int(10 * f), memory_free_mib=int(f), memory_used_mib=int(9 * f),
                     context_mib=int(CONTEXT_MIB)) for i, f in enumerate(free)]
    return save_snapshot(Snapshot(gpus=gpus, cuda_probe_ran=True), path)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


def autobatch_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "train" / "autobatch.json").read_text())


def launch(profile, run_dir: Path, snapshot: Path) -> dict:
    inputs = read_inputs(profile, snapshot)
    assert run_training(profile, run_dir=run_dir, plan=(plan_for_launch(profile, inputs), inputs)) == 0
    return json.loads((run_dir / "train" / "plan.json").read_text())


@pytest.mark.slow
def test_a_plan_of_micro_batch_one_starts_every_rank_at_one_with_no_oom(tmp_path, tiny_qwen3_target, tiny_dataset):
    _, profile = profile_allowing_four(tmp_path, tiny_qwen3_target, tiny_dataset)
    one = free_for(profile, 1.5)
    plan = launch(profile, tmp_path / "run", write_snapshot(tmp_path / "snap.json", [one, one]))
    assert [rank["micro_batch"] for rank in plan["ranks"]] == [1, 1] and plan["micro_batch"] == 1
    assert [line["micro_batch"] for line in metrics(tmp_path / "run")] == [1, 1]
    assert autobatch_state(tmp_path / "run") == {"micro_batch": 1, "reductions": []}


@pytest.mark.slow
def test_a_rank_short_of_headroom_sets_every_rank_before_step_one(tmp_path, tiny_qwen3_target, tiny_dataset):
    _, profile = profile_allowing_four(tmp_path, tiny_qwen3_target, tiny_dataset)
    plan = launch(profile, tmp_path / "run", write_snapshot(tmp_path / "snap.json",
                                                            [free_for(profile, 4.5), free_for(profile, 2.5)]))
    assert [rank["micro_batch"] for rank in plan["ranks"]] == [4, 2]
    lines = metrics(tmp_path / "run")
    assert lines[0]["step"] == 1 and [line["micro_batch"] for line in lines] == [2, 2]
    assert autobatch_state(tmp_path / "run")["reductions"] == []        # agreed at start, not halved after an OOM
    assert lines[0]["predicted_peak_mib"] == pytest.approx(plan["ranks"][0]["predicted_peak_mib"])


def test_a_rank_that_cannot_hold_one_sequence_stops_the_launch_before_anything_starts(
        tmp_path, tiny_qwen3_target, tiny_dataset):
    path, profile = profile_allowing_four(tmp_path, tiny_qwen3_target, tiny_dataset)
    snapshot = write_snapshot(tmp_path / "snap.json", [free_for(profile, 2.5), free_for(profile, 0.5)])
    with pytest.raises(PreflightFailed, match=r"rank 1: one sequence needs \d+ MiB but GPU 1's budget is"):
        plan_for_launch(profile, read_inputs(profile, snapshot))
    done = subprocess.run([sys.executable, "launcher.py", "train", "--profile", str(path), "--snapshot", str(snapshot),
                           "--skip-preflight"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "rank 1: one sequence needs" in done.stderr and not (tmp_path / "run" / "train").exists()


def test_print_command_shows_the_plan_it_would_use(tmp_path, tiny_qwen3_target, tiny_dataset):
    path, profile = profile_allowing_four(tmp_path, tiny_qwen3_target, tiny_dataset)
    snapshot = write_snapshot(tmp_path / "snap.json", [free_for(profile, 4.5), free_for(profile, 2.5)])
    done = subprocess.run([sys.executable, "launcher.py", "train", "--profile", str(path), "--snapshot", str(snapshot),
                           "--print-command"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "memory plan: micro-batch 2 x 2 accumulation steps on 2 ranks" in done.stdout
    assert f"GPUs from {snapshot}" in done.stdout and "rank 0: 4, rank 1: 2" in done.stdout
    assert "analytic model" in done.stdout and "dflash/train/rank/worker.py" in done.stdout
