"""Steps lost to out-of-memory before a feasible micro-batch is reached: ours (plan first from the
per-rank budgets, reduce on OOM) against halving from the profile's maximum (accelerate's
find_executable_batch_size approach), on the same emulated budget.

The device is emulated on CPU: the "true" memory of the workload is a peak model (the calibration
fixture, optionally perturbed to emulate a calibration error); the budgets come from recorded node
snapshots; a forward above the truly feasible micro-batch raises torch.OutOfMemoryError through
the trainer's fault injection (DFLASH_INJECT_OOM's "above=N", dflash.train.rank.faults). Both
strategies train a small real drafter through the trainer's own `build_state` and `run_step`
(its AutoBatch recovery: the OOM's record, a restart at half the micro-batch, the step redone) on a
tiny random Qwen3 target; only the starting micro-batch differs. Each OOM costs a restart of every
rank (the target reloaded, the steps since the last checkpoint redone): "lost" counts them.

    .venv/bin/python benchmarks/bench_oom_steps.py [--steps 6] [--scenarios N]
    .venv/bin/python benchmarks/bench_oom_steps.py --smoke      (the first two scenarios, 2 steps each)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash.memory import budget  # noqa: E402
from dflash.memory.calibration_record import Calibration, load_calibration  # noqa: E402
from envcheck.snapshot import Snapshot, load_snapshot  # noqa: E402
from launcher_core.fileio import read_json  # noqa: E402
from launcher_core.profile import load_profile  # noqa: E402

if TYPE_CHECKING:
    from launcher_core.schema import Profile

SNAPSHOTS = REPO / "tests" / "fixtures" / "snapshots"
CALIBRATION = REPO / "tests" / "fixtures" / "memory" / "rtx6000-x8-calibration.json"
STEPS, GLOBAL_BATCH, ROW_TOKENS = 6, 16, 32


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    profile: str
    snapshot: str
    truth_error: float          # true slope and intercept = calibration x (1 + error)


SCENARIOS = [
    Scenario("rtx6000-x8 baseline, calibrated", "rtx6000-x8", "rtx6000-x8-baseline.json", 0.0),
    Scenario("rtx6000-x8 cu130 upgrade (GPU 6 -200 MiB), calibrated", "rtx6000-x8", "rtx6000-x8-cu130-upgrade.json", 0.0),
    Scenario("b200-x8 (max micro-batch 8), calibrated", "b200-x8", "b200-x8-nvcc128-cu130.json", 0.0),
    Scenario("rtx6000-x8 upgrade, calibration 1% low", "rtx6000-x8", "rtx6000-x8-cu130-upgrade.json", 0.01),
    Scenario("rtx6000-x8 baseline, calibration 2% low", "rtx6000-x8", "rtx6000-x8-baseline.json", 0.02),
]


def true_feasible(profile, snapshot: Snapshot, calibration: Calibration, error: float) -> int:
    """The micro-batch the emulated device really allows: min over ranks of the true model."""
    truth = dataclasses.replace(calibration, peaks_mib=tuple(p * (1 + error) for p in calibration.peaks_mib))
    plan = budget.make_plan(profile, snapshot, calibration=truth)
    return min(r.feasible_micro_batch for r in plan.ranks)


def small_workload(scratch: Path) -> tuple[Path, Path]:
    """A tiny random Qwen3 target and GLOBAL_BATCH seeded rows of its token ids (dflash.data's format)."""
    import numpy as np

    from dflash.data.dataset_io import save_token_rows
    from dflash.target_model import build_tiny_target

    target = build_tiny_target(scratch / "target", None, hidden=64, layers=2)
    rng = np.random.default_rng(0)
    rows = [(rng.integers(100, 30000, ROW_TOKENS).tolist(), [0] * (ROW_TOKENS // 2) + [1] * (ROW_TOKENS // 2))
            for _ in range(GLOBAL_BATCH)]
    return target, save_token_rows(scratch / "dataset", rows)


def training_profile(target: Path, dataset: Path, run_dir: Path, start: int, steps: int) -> Profile:
    """cpu-demo on one process with the small workload: a 1-layer drafter over a 256-token draft
    vocabulary, GLOBAL_BATCH sequences a step (every row trains: none held out for validation),
    starting at micro-batch `start`."""
    base = load_profile("cpu-demo")
    return dataclasses.replace(
        base, machine=dataclasses.replace(base.machine, nproc_per_node=1),
        model=dataclasses.replace(base.model, target=str(target), tokenizer="", dtype="float32"),
        paths=dataclasses.replace(base.paths, dataset=str(dataset), run_dir=str(run_dir)),
        drafter=dataclasses.replace(base.drafter, num_layers=1, target_layer_ids=(1,), init="random",
                                    draft_vocab_size=256, mask_token_id=151669),
        train=dataclasses.replace(base.train, global_batch=GLOBAL_BATCH, max_micro_batch=start, num_anchors=4,
                                  feature_cache=False, max_steps=steps, validation_share=0.0))


def lost_steps(profile: Profile, run_dir: Path, start: int, feasible: int) -> tuple[int, int]:
    """The trainer's steps from micro-batch `start` on a device allowing `feasible`; (lost, final).
    An OOM ends the step with its record (OomRestart), as it ends a rank; the restart's start
    (AutoBatch.start, reading the record) is done in this process, and the step is run again."""
    from dflash.train.rank.autobatch import AutoBatch, OomRestart
    from dflash.train.rank.faults import INJECT_ENV, FaultInjection
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.step import run_next_step

    state = build_state(profile, run_dir, WorkerEnv(0, 1, 0), resume=False, planned_micro_batch=start)
    assert state.autobatch is not None
    state.autobatch.log = lambda line: None
    device = FaultInjection.from_env(0, {INJECT_ENV: f"above={feasible}"})    # the device's limit
    assert device is not None
    device.install(state.progress, state.drafter, lambda: state.micro_batch)
    while state.step < state.total_steps:
        try:
            run_next_step(state)
        except OomRestart:
            state.autobatch = AutoBatch.start(start, run_dir, 0, log=lambda line: None)
    return len(state.autobatch.reductions), state.autobatch.micro_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per strategy and scenario")
    parser.add_argument("--scenarios", type=int, default=len(SCENARIOS), help="the first N scenarios")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: the first two scenarios, 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.scenarios = 2, 2
    return args


def main() -> None:
    import torch

    args = parse_args()
    torch.set_num_threads(1)
    calibration = load_calibration(read_json(CALIBRATION), str(CALIBRATION))
    print(f"{'scenario':58} {'true':>4} | {'ours: start':>11} {'lost':>4} | {'halving: start':>14} {'lost':>4}")
    totals = [0, 0]
    with tempfile.TemporaryDirectory(prefix="bench-oom-") as tmp:
        scratch = Path(tmp)
        target, dataset = small_workload(scratch)
        for index, scenario in enumerate(SCENARIOS[:args.scenarios]):
            totals = run_scenario(scenario, calibration, (target, dataset), scratch / str(index), args.steps, totals)
    print(f"restarts after OOM in total: ours {totals[0]}, halving from the maximum {totals[1]} "
          f"(target: 0 when calibrated)")


def run_scenario(scenario: Scenario, calibration: Calibration, workload: tuple[Path, Path], scratch: Path,
                 steps: int, totals: list[int]) -> list[int]:
    """One scenario's row: both strategies trained from their starting micro-batch."""
    profile = load_profile(scenario.profile)
    snapshot = load_snapshot(SNAPSHOTS / scenario.snapshot)
    feasible = true_feasible(profile, snapshot, calibration, scenario.truth_error)
    planned = budget.make_plan(profile, snapshot, calibration=calibration).batch.micro_batch
    maximum = profile.train.max_micro_batch
    results = {}
    for strategy, start in (("ours", planned), ("halving", maximum)):
        run_dir = scratch / strategy
        results[strategy] = lost_steps(training_profile(*workload, run_dir, start, steps), run_dir, start, feasible)
    (ours, ours_final), (halving, halving_final) = results["ours"], results["halving"]
    assert ours_final <= feasible and halving_final <= feasible
    print(f"{scenario.name:58} {feasible:>4} | {planned:>11} {ours:>4} | {maximum:>14} {halving:>4}", flush=True)
    return [totals[0] + ours, totals[1] + halving]


if __name__ == "__main__":
    main()
