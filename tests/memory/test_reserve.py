"""The allocator's reserve inside each budget (dflash.memory.reserve): the plan fits allocated peak x
reserve ratio into the budget its ranks' allocator is capped at, with the calibration's measured ratio
when it has one for this workload and allocator setting, else the (unproven) default."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_budget import calibration_giving, snapshot, write_profile

from dflash.memory import peak_estimate as memory
from dflash.memory.calibration_record import (
    AllocatorPeaks,
    calibration_as_dict,
    calibration_from_dict,
    fit_calibration,
    load_calibration,
    save_calibration,
)
from dflash.memory.reserve import DEFAULT_RESERVE_RATIO, FIXED_SEGMENTS_RESERVE_RATIO


def _plan(profile, calibration, free=(10_000, 10_000)):
    from dflash.memory.budget import make_plan

    return make_plan(profile, snapshot(list(free), [500] * len(free)), calibration=calibration)


def test_the_micro_batch_shrinks_as_the_reserve_ratio_grows_and_the_reserved_peak_stays_within_the_budget(tmp_path):
    profile = write_profile(tmp_path, "[train]\nglobal_batch = 16\nmax_micro_batch = 8\n")
    workload = memory.workload_from_profile(profile)
    plans = {ratio: _plan(profile, calibration_giving(workload, reserve_ratio=ratio), free=(10_000, 10_000))
             for ratio in (1.0, 1.06, 1.3)}
    # budget 8,500 per rank, allocated peak 2,000 + 1,500 x m: 4 fit at ratio 1 and 1.06 (8,000 x 1.06 = 8,480), 3 at 1.3
    assert [plans[r].batch.micro_batch for r in (1.0, 1.06, 1.3)] == [4, 4, 3]
    assert plans[1.06].reserve.source == "calibration" and plans[1.06].reserve.ratio == pytest.approx(1.06)
    for plan in plans.values():
        reserved = plan.reserve.reserved_mib(plan.peak_model.peak_mib(plan.batch.micro_batch))
        assert all(reserved <= rank.budget.budget_mib for rank in plan.ranks)
    assert plans[1.3].planned_reserve_mib == pytest.approx(0.3 * (2_000 + 1_500 * 3))


def test_without_a_measured_ratio_the_default_for_the_allocator_setting_applies(tmp_path):
    profile = write_profile(tmp_path, "[train]\nglobal_batch = 16\n")
    plan = _plan(profile, calibration_giving(memory.workload_from_profile(profile)))
    assert (plan.reserve.ratio, plan.reserve.source) == (DEFAULT_RESERVE_RATIO, "default")
    assert "unproven" in plan.reserve.detail and "predates reserve measurement" in plan.reserve.detail
    fixed = write_profile(tmp_path, "[train]\nglobal_batch = 16\n[memory]\nexpandable_segments = false\n")
    measured = calibration_giving(memory.workload_from_profile(fixed), reserve_ratio=1.02)   # under expandable segments
    plan = _plan(fixed, measured)
    assert plan.reserve.ratio == FIXED_SEGMENTS_RESERVE_RATIO and "the other allocator setting" in plan.reserve.detail


def test_a_cpu_profile_counts_no_reserve(tmp_path):
    from dflash.memory.budget import make_plan
    from launcher_core.profile import load_profile

    plan = make_plan(load_profile("cpu-demo"))
    assert plan.reserve.ratio == 1.0 and plan.reserve.source == "cpu"


def test_the_ratio_is_the_larger_of_the_worst_case_sizes_and_the_varied_shapes(tmp_path):
    workload = memory.workload_from_profile(write_profile(tmp_path, ""))
    fitted = fit_calibration({1: 1000.0, 2: 2000.0}, workload, {1: 1100.0, 2: 2060.0},
                             AllocatorPeaks(allocated_mib=2000.0, reserved_mib=2300.0), expandable_segments=True)
    assert fitted.reserve_ratio == pytest.approx(1.15) and fitted.reserved_mib == (1100.0, 2060.0)
    alone = fit_calibration({1: 1000.0, 2: 2000.0}, workload, {1: 1100.0, 2: 2060.0})
    assert alone.reserve_ratio == pytest.approx(1.1)
    assert fit_calibration({1: 1000.0, 2: 2000.0}, workload).reserve_ratio is None


def test_the_reserve_round_trips_through_the_baseline_and_an_old_record_without_it_still_loads(tmp_path):
    workload = memory.workload_from_profile(write_profile(tmp_path, ""))
    calibration = calibration_giving(workload, reserve_ratio=1.08)
    path = save_calibration(tmp_path / "baseline.json", calibration)
    assert load_calibration(json.loads(path.read_text()), str(path)) == calibration
    old = {key: value for key, value in calibration_as_dict(calibration).items()
           if key not in ("reserved_mib", "reserve_ratio", "expandable_segments")}
    loaded = calibration_from_dict(old, "old baseline")
    assert (loaded.reserve_ratio, loaded.reserved_mib, loaded.expandable_segments) == (None, None, None)
    assert dataclasses.replace(loaded, reserve_ratio=calibration.reserve_ratio, reserved_mib=calibration.reserved_mib,
                               expandable_segments=True) == calibration


def test_a_malformed_reserve_ratio_names_the_file_and_key(tmp_path):
    from launcher_core.errors import InputError

    calibration = calibration_giving(memory.workload_from_profile(write_profile(tmp_path, "")), reserve_ratio=1.08)
    document = {**calibration_as_dict(calibration), "reserve_ratio": 0.5}
    with pytest.raises(InputError, match="baseline.json: key 'memory_calibration' is malformed .*'reserve_ratio' must be"):
        calibration_from_dict(document, "baseline.json")


def test_plan_json_carries_the_reserve_to_the_ranks_and_an_older_plan_json_still_reads(tmp_path):
    from dflash.memory.launch_plan import PlanInputs, plan_path, read_rank_start, write_plan

    profile = write_profile(tmp_path, "[train]\nglobal_batch = 16\n")
    plan = _plan(profile, calibration_giving(memory.workload_from_profile(profile), reserve_ratio=1.2))
    write_plan(tmp_path, plan, PlanInputs(None, None, None, "test"))
    document = json.loads(plan_path(tmp_path).read_text())
    assert document["reserve"]["ratio"] == pytest.approx(1.2) and document["reserve"]["source"] == "calibration"
    start = read_rank_start(tmp_path, 1)
    assert start.predicted_reserved_mib == pytest.approx(1.2 * start.predicted_peak_mib, abs=0.1)
    assert start.predicted_reserved_mib <= start.budget_mib            # what the allocator's cap holds fits it
    for line in document["ranks"]:
        del line["predicted_reserved_mib"]
    plan_path(tmp_path).write_text(json.dumps(document))
    assert read_rank_start(tmp_path, 1).predicted_reserved_mib is None
