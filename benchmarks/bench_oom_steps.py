"""Steps lost to out-of-memory before a feasible micro-batch is reached: ours (plan first from the
per-rank budgets, reduce on OOM) against halving from the profile's maximum (accelerate's
find_executable_batch_size approach), on the same emulated budget.

The device is emulated on CPU: the "true" memory of the workload is a peak model (the calibration
fixture, optionally perturbed to emulate a calibration error); the budgets come from recorded node
snapshots; the first rank whose true peak exceeds its budget raises torch.OutOfMemoryError through
dflash.train.autobatch's fault-injection switch (above=N). Both strategies run the real AutoBatch
recovery loop on a small real training step; only the starting micro-batch differs.

    .venv/bin/python benchmarks/bench_oom_steps.py
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "memory"))

from dflash.memory import plan as budget  # noqa: E402
from dflash.memory.calibration import Calibration, load_calibration  # noqa: E402
from dflash.train import autobatch  # noqa: E402
from envcheck.snapshot import Snapshot, load_snapshot  # noqa: E402
from launcher_core.fileio import read_json  # noqa: E402
from launcher_core.profile import load_profile  # noqa: E402

SNAPSHOTS = REPO / "tests" / "fixtures" / "snapshots"
CALIBRATION = REPO / "tests" / "fixtures" / "memory" / "rtx6000-x8-calibration.json"
STEPS = 6


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


def lost_steps(start: int, feasible: int) -> tuple[int, int]:
    """Run STEPS real steps with AutoBatch from `start` on a device allowing `feasible`; (lost, final)."""
    import autobatch_worker as worker

    model, global_batch = worker.build_model(), 16
    optimizer = worker.build_optimizer(model)
    auto = autobatch.AutoBatch(start, 0, injector=autobatch.OomInjector(above=feasible), log=lambda _: None)
    lost = 0
    for step in range(STEPS):
        indices = worker.step_indices(step, global_batch)
        total = float(worker.batch(indices)[2].sum())

        def accumulate(m: int) -> None:
            for first in range(0, global_batch, m):
                auto.inject("forward")
                (worker.weighted_loss_sum(model, indices[first:first + m]) / total).backward()

        lost += auto.run_step(step, accumulate, optimizer).attempts - 1
    return lost, auto.micro_batch


def main() -> None:
    calibration = load_calibration(read_json(CALIBRATION), str(CALIBRATION))
    print(f"{'scenario':58} {'true':>4} | {'ours: start':>11} {'lost':>4} | {'halving: start':>14} {'lost':>4}")
    totals = [0, 0]
    for scenario in SCENARIOS:
        profile = load_profile(scenario.profile)
        snapshot = load_snapshot(SNAPSHOTS / scenario.snapshot)
        feasible = true_feasible(profile, snapshot, calibration, scenario.truth_error)
        planned = budget.make_plan(profile, snapshot, calibration=calibration).batch.micro_batch
        maximum = profile.train.max_micro_batch
        ours, ours_final = lost_steps(planned, feasible)
        halving, halving_final = lost_steps(maximum, feasible)
        assert ours_final <= feasible and halving_final <= feasible
        totals[0] += ours
        totals[1] += halving
        print(f"{scenario.name:58} {feasible:>4} | {planned:>11} {ours:>4} | {maximum:>14} {halving:>4}")
    print(f"steps lost to OOM in total: ours {totals[0]}, halving from the maximum {totals[1]} "
          f"(target: 0 when calibrated)")


if __name__ == "__main__":
    main()
