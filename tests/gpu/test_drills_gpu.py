"""Budget drills under `torch.cuda.set_per_process_memory_fraction` (the calibrate part's workload,
its own calibration first; the cap is a fraction of the device's total memory):

1. cap = (intercept + 4.5 x slope) x reserve ratio / (1 - margin) (the plan counts the allocator's
   reserve in the budget: dflash.memory.reserve): `make_plan` on a one-GPU snapshot whose free
   memory is the cap plans micro-batch 4; two optimizer steps of the global batch (8) through
   `run_step` with `AutoBatch` must see zero OOMs and keep micro-batch 4.
2. the cap is lowered to peak(1) + 0.75 x slope (one sequence fits, two do not) while the plan
   still says 4: the run recovers by reduction at a restart (OOM -> the rank's record and its exit
   -> AutoBatch.start halves -> step redone; the restart is done in this process, the memory
   released as a new process would find it): at least one OOM and one halving, both steps with
   all 8 sequences, finite losses, and the reduced micro-batch persisted in autobatch.json.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import pytest

if TYPE_CHECKING:
    from envcheck.snapshot import Snapshot

pytestmark = pytest.mark.gpu

MIB = 1024 * 1024
DRILL_STEPS = 2
GLOBAL_BATCH = 8


@dataclass
class DrillOutcome:
    planned: int
    final: int
    ooms: int
    halvings: int
    steps_done: int
    sequences_per_step: list[int]
    losses: list[float]
    max_reserved_mib: float
    cap_mib: float
    fraction: float
    persisted: Optional[int]


@dataclass
class Drills:
    bench: Any
    calibration: Any
    model: Any                  # the calibrated PeakModel
    total_mib: float


@pytest.fixture(scope="module")
def drills(workload_profile, scratch, record) -> Drills:
    import torch

    from dflash.measure.gpu_calibration import CALIBRATION_MICRO_BATCHES, apply_allocator_setting, fit, measure, warm_up, worst_case_bench
    from dflash.memory import peak_estimate as memory

    apply_allocator_setting(workload_profile)          # the ranks' allocator (expandable segments), before CUDA memory
    bench = worst_case_bench(workload_profile, scratch / "drills", rows=GLOBAL_BATCH)
    record.figure(flex_error=warm_up(bench), backend=bench.state.backend)
    calibration = fit(bench, measure(bench, CALIBRATION_MICRO_BATCHES))
    total = torch.cuda.get_device_properties(bench.state.device).total_memory / MIB
    record.figure(slope_mib=round(calibration.slope_mib, 1), intercept_mib=round(calibration.intercept_mib, 1),
                  device_total_mib=round(total), device_name=torch.cuda.get_device_name(bench.state.device))
    return Drills(bench, calibration, memory.peak_model(bench.workload, calibration), total)


def emulated_snapshot(cap_mib: float) -> Snapshot:
    """A one-GPU snapshot whose free memory is the cap; the cap is all torch may use, so the
    non-torch overhead is 0 (the allocator's fraction excludes the CUDA context)."""
    from envcheck.snapshot import GpuFacts, Snapshot

    cap = int(cap_mib)
    return Snapshot(gpus=[GpuFacts(index=0, uuid="GPU-emulated-cap", name="emulated", compute_capability="",
                                   memory_total_mib=cap, memory_free_mib=cap, memory_used_mib=0, context_mib=0)])


def planned_micro_batch(drills: Drills, cap_mib: float) -> int:
    from dflash.memory.budget import make_plan

    plan = make_plan(drills.bench.profile, emulated_snapshot(cap_mib), calibration=drills.calibration,
                     cuda_visible_devices=None, world_size=1, shape=drills.bench.workload.target)
    return plan.batch.micro_batch


def run_capped(drills: Drills, cap_mib: float, planned: int, run_dir: Path) -> DrillOutcome:
    """DRILL_STEPS optimizer steps of the global batch under the cap, through run_step and AutoBatch."""
    import shutil

    import torch

    from dflash.memory.budget import batch_plan
    from dflash.train.rank.autobatch import AutoBatch, OomRestart, load_run_state, run_state_path
    from dflash.train.rank.step import run_step

    state, device = drills.bench.state, drills.bench.state.device
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap_mib / drills.total_mib, device)
    torch.cuda.reset_peak_memory_stats(device)
    lines: list[str] = []
    shutil.rmtree(run_dir, ignore_errors=True)
    log = lambda line: (lines.append(line), print(line))  # noqa: E731
    state.autobatch = AutoBatch.start(planned, run_dir, 0, log=log)
    sequences, losses = [], []
    try:
        step = 0
        while step < DRILL_STEPS:
            state.step = step
            try:
                stats = run_step(state, list(range(GLOBAL_BATCH)), 0, batch_plan(GLOBAL_BATCH, 1, state.autobatch.micro_batch))
            except OomRestart:                  # what a restart of the rank does: memory back, the record read
                state.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                state.autobatch = AutoBatch.start(planned, run_dir, 0, log=log)
                continue
            sequences.append(stats.tokens // drills.bench.workload.max_length)
            losses.append(round(stats.loss, 4))
            step += 1
    finally:
        auto, state.autobatch = state.autobatch, None
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    persisted = load_run_state(run_state_path(run_dir))
    return DrillOutcome(planned=planned, final=auto.micro_batch, ooms=sum("out of memory at step" in line for line in lines),
                        halvings=len(auto.reductions), steps_done=len(losses), sequences_per_step=sequences,
                        losses=losses, max_reserved_mib=round(torch.cuda.max_memory_reserved(device) / MIB, 1),
                        cap_mib=round(cap_mib, 1), fraction=round(cap_mib / drills.total_mib, 5),
                        persisted=persisted.micro_batch if persisted else None)


@pytest.fixture(scope="module")
def planned_run(drills, scratch, record) -> DrillOutcome:
    from dflash.memory.reserve import plan_reserve

    ratio = plan_reserve(drills.bench.profile, drills.bench.workload, drills.calibration).ratio
    cap = (drills.model.intercept_mib + 4.5 * drills.model.slope_mib) * ratio / (1 - drills.bench.profile.memory.margin)
    planned = planned_micro_batch(drills, cap)
    assert record.check("plan under the cap", planned >= 2, f"cap {cap:.0f} MiB -> planned micro-batch {planned}")
    outcome = run_capped(drills, cap, planned, scratch / "drill-planned")
    record.figure(drill_planned=asdict(outcome))
    return outcome


def test_a_run_planned_under_the_cap_has_no_oom(planned_run, record):
    o = planned_run
    ok = record.check("planned run: zero OOMs", o.ooms == 0 and o.final == o.planned,
                      f"{o.ooms} OOM(s), micro-batch {o.planned} -> {o.final}, reserved peak "
                      f"{o.max_reserved_mib:.0f} of {o.cap_mib:.0f} MiB (fraction {o.fraction})")
    kept = record.check("planned run: every step ran the global batch",
                        o.sequences_per_step == [GLOBAL_BATCH] * DRILL_STEPS, f"sequences per step {o.sequences_per_step}")
    assert ok and kept


def test_a_cap_lowered_after_planning_is_survived_by_halving(drills, planned_run, scratch, record):
    cap = drills.model.peak_mib(1) + 0.75 * drills.model.slope_mib      # fits one sequence, not two
    o = run_capped(drills, cap, planned_run.planned, scratch / "drill-lowered")
    record.figure(drill_lowered=asdict(o))
    recovered = record.check(
        "lowered cap: recovered by reduction at a restart",
        o.steps_done == DRILL_STEPS and o.ooms >= 1 and o.halvings >= 1 and o.final < o.planned,
        f"{o.ooms} OOM(s), {o.halvings} halving(s), micro-batch {o.planned} -> {o.final}, {o.steps_done}/{DRILL_STEPS} "
        f"steps, reserved peak {o.max_reserved_mib:.0f} of {cap:.0f} MiB")
    kept = record.check("lowered cap: global batch kept and losses finite",
                        o.sequences_per_step == [GLOBAL_BATCH] * DRILL_STEPS and all(map(math.isfinite, o.losses)),
                        f"sequences per step {o.sequences_per_step}, losses {o.losses}")
    persisted = record.check("lowered cap: reduced micro-batch persisted", o.persisted == o.final,
                             f"autobatch.json micro_batch {o.persisted}")
    p = planned_run
    record.set_summary(f"planned m={p.planned} under {p.cap_mib:.0f} MiB ({p.fraction:.4f} of {drills.total_mib:.0f}): "
                       f"{p.ooms} OOM; lowered to {o.cap_mib:.0f} MiB: {o.ooms} OOM, {o.halvings} halving(s) -> "
                       f"m={o.final}, {o.steps_done}/{DRILL_STEPS} steps")
    assert recovered and kept and persisted
