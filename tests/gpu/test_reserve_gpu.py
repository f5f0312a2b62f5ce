"""The allocator's reserve inside the cap, on a GPU (UNPROVEN until a GPU machine runs it).

The calibrate part's workload (4096 tokens, 512 anchors x block 16, two draft layers, bf16, flex), in a
process whose allocator runs as the profile's ranks do (`apply_allocator_setting`: expandable segments by
default). Its own calibration first, reserve included: peak allocated and reserved at micro-batch 1 and 2,
and over steps of differently shaped micro-batches (`measure_reserve`: 1/4, 3/4 and 1/2 of max_length, then
the worst case). Then the plan on a one-GPU snapshot sized so that micro-batch 3 fits with the measured
reserve ratio (allocated peak x ratio <= budget), the allocator capped at that budget as a rank caps it
(`set_per_process_memory_fraction(budget / total)`), and two rounds of the varied-length steps at the
planned micro-batch: no OOM, torch's peak reserved within the cap, the allocator's segments expandable.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MIB = 1024 * 1024
PLANNED = 3                 # the cap is sized for this micro-batch
ROUNDS = 2


@dataclass
class Reserved:
    bench: Any
    calibration: Any
    expandable: bool


@pytest.fixture(scope="module")
def reserved(workload_profile, scratch, record) -> Reserved:
    from dflash.measure.gpu_calibration import CALIBRATION_MICRO_BATCHES, MICRO_BATCHES_PER_STEP, apply_allocator_setting, measure_reserve, measure_steps, warm_up, worst_case_bench
    from dflash.memory.calibration_record import fit_calibration

    allocator = apply_allocator_setting(workload_profile)          # before this process allocates CUDA memory
    bench = worst_case_bench(workload_profile, scratch / "reserve", rows=MICRO_BATCHES_PER_STEP * (PLANNED + 1))
    record.figure(flex_error=warm_up(bench), backend=bench.state.backend)
    steps = measure_steps(bench, CALIBRATION_MICRO_BATCHES)
    varied = measure_reserve(bench, CALIBRATION_MICRO_BATCHES[-1])
    expandable = allocator.expandable
    calibration = fit_calibration({m: p.allocated_mib for m, p in steps.items()}, bench.workload,
                                  {m: p.reserved_mib for m, p in steps.items()}, varied, world_size=1,
                                  micro_batches_per_step=MICRO_BATCHES_PER_STEP, expandable_segments=expandable)
    record.figure(steps={str(m): dataclasses.asdict(p) for m, p in steps.items()}, varied=dataclasses.asdict(varied),
                  reserve_ratio=calibration.reserve_ratio, expandable_segments=expandable)
    return Reserved(bench, calibration, expandable)


def test_the_calibration_measures_the_reserve_ratio_under_expandable_segments(reserved, record):
    from gpu_helpers import torch_allocator_expandable

    ratio, parsed = reserved.calibration.reserve_ratio, torch_allocator_expandable()
    assert record.check("reserve ratio measured with torch's allocator parsing expandable segments",
                        ratio is not None and parsed is not False and reserved.expandable,
                        f"ratio {ratio}, reserved {reserved.calibration.reserved_mib} MiB at micro-batch 1, 2; torch's "
                        f"allocator settings ask for expandable segments: {parsed}")


def capped_plan(reserved: Reserved):
    """The one-GPU plan whose budget holds micro-batch PLANNED at the measured ratio, not PLANNED + 1."""
    from test_drills_gpu import emulated_snapshot

    from dflash.memory.budget import make_plan

    bench, calibration = reserved.bench, reserved.calibration
    probe = make_plan(bench.profile, emulated_snapshot(1e9), calibration=calibration, world_size=1,
                      shape=bench.workload.target)
    model, ratio = probe.peak_model, probe.reserve.ratio
    budget = ratio * (model.peak_mib(PLANNED) + model.peak_mib(PLANNED + 1)) / 2
    free = budget / (1 - bench.profile.memory.margin)
    return make_plan(bench.profile, emulated_snapshot(free), calibration=calibration, world_size=1,
                     shape=bench.workload.target)


def expandable_segments_in_use() -> bool | None:
    """Whether the allocator's segments are expandable (None: this torch's snapshot does not say)."""
    import torch

    segments = torch.cuda.memory._snapshot()["segments"]
    flags = [segment.get("is_expandable") for segment in segments if "is_expandable" in segment]
    return any(flags) if flags else None


def test_varied_lengths_at_the_planned_micro_batch_stay_within_the_cap(reserved, record):
    import torch

    from dflash.measure.gpu_calibration import run_varied_shapes

    plan = capped_plan(reserved)
    budget, device = plan.ranks[0].budget.budget_mib, reserved.bench.state.device
    total = torch.cuda.get_device_properties(device).total_memory / MIB
    assert record.check("plan under the cap", plan.batch.micro_batch == PLANNED,
                        f"budget {budget:.0f} MiB, ratio {plan.reserve.ratio:.3f} ({plan.reserve.source}) -> "
                        f"micro-batch {plan.batch.micro_batch}")
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    torch.cuda.reset_peak_memory_stats(device)
    ooms = 0
    try:
        for _ in range(ROUNDS):
            try:
                run_varied_shapes(reserved.bench, PLANNED)
            except torch.OutOfMemoryError:
                ooms += 1
                reserved.bench.state.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        peak_reserved = torch.cuda.max_memory_reserved(device) / MIB
        peak_allocated = torch.cuda.max_memory_allocated(device) / MIB
        expandable = expandable_segments_in_use()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    predicted = plan.reserve.reserved_mib(plan.peak_model.peak_mib(PLANNED))
    record.figure(capped={"budget_mib": round(budget, 1), "planned": plan.batch.micro_batch, "ooms": ooms,
                          "peak_reserved_mib": round(peak_reserved, 1), "peak_allocated_mib": round(peak_allocated, 1),
                          "predicted_reserved_mib": round(predicted, 1), "expandable_segments": expandable})
    fits = record.check("varied lengths at the planned micro-batch under the cap: no OOM", ooms == 0,
                        f"{ooms} OOM(s), reserved peak {peak_reserved:.0f} of {budget:.0f} MiB (allocated "
                        f"{peak_allocated:.0f}; the plan's reserved peak {predicted:.0f})")
    segments = record.check("the allocator's segments are expandable", expandable is True,
                            f"segments expandable (torch's memory snapshot): {expandable}; allocator variables ask "
                            f"for it: {reserved.expandable}")
    record.set_summary(f"ratio {plan.reserve.ratio:.3f}; m={PLANNED} under {budget:.0f} MiB: {ooms} OOM, reserved "
                       f"{peak_reserved:.0f} MiB (allocated {peak_allocated:.0f}), expandable {expandable}")
    assert fits and segments
