"""The memory calibration on a GPU (`dflash.measure.gpu_calibration.calibrate`, what `launcher.py calibrate`
runs): the worst-case workload's state built by `build_state`, peaks measured at micro-batch 1 and
2 -> the calibrated line, whose prediction at micro-batch 4 and 8 must be within 10 % of
`torch.cuda.max_memory_allocated` there. The uncalibrated analytic estimate is reported against
the same 10 % (informational). The calibration also measures the allocator's reserve (peak reserved
over peak allocated, across differently shaped micro-batches: unproven until run on a GPU). The
calibration is saved as a baseline document (OUT/calibration_baseline.json, key `memory_calibration`)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROBE_MICRO_BATCHES = (4, 8)
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def calibrated(workload_profile, scratch, gpu_out, record):
    from dflash.measure.gpu_calibration import calibrate, iter_prediction_rows, store_calibration

    run = calibrate(workload_profile, scratch / "calibrate", PROBE_MICRO_BATCHES)
    workload = run.workload
    record.figure(workload={"hidden": workload.target.hidden, "target_layers": workload.target.num_layers,
                            "vocab": workload.target.vocab, "drafter_layers": workload.drafter_layers,
                            "block_size": workload.block_size, "num_anchors": workload.num_anchors,
                            "max_length": workload.max_length, "tap_layers": list(workload.tap_layers),
                            "key": workload.key()},
                  backend=run.backend, warmup_s=round(run.warmup_s, 1),
                  measured_peaks_mib={str(m): round(p, 1) for m, p in run.peaks_mib.items()},
                  slope_mib=round(run.calibration.slope_mib, 1), intercept_mib=round(run.calibration.intercept_mib, 1),
                  reserved_mib=run.calibration.reserved_mib, reserve_ratio=run.calibration.reserve_ratio,
                  expandable_segments=run.calibration.expandable_segments,
                  predictions={str(row["micro_batch"]): row for row in iter_prediction_rows(run)})
    store_calibration(gpu_out / "calibration_baseline.json", run.calibration)
    return run


def test_flex_attention_runs_the_worst_case(calibrated, record):
    assert record.check("flex_attention training steps", not calibrated.flex_error,
                        calibrated.flex_error or f"backend {calibrated.backend}")


def test_calibration_slope_is_positive(calibrated, record):
    cal = calibrated.calibration
    assert record.check("calibration slope is positive", cal.slope_mib > 0,
                        f"slope {cal.slope_mib:.1f} MiB/sequence, intercept {cal.intercept_mib:.1f} MiB")


def test_the_calibration_measures_the_allocators_reserve(calibrated, record):
    from gpu_helpers import torch_allocator_expandable

    cal, parsed = calibrated.calibration, torch_allocator_expandable()
    assert record.check("reserve ratio measured under the profile's allocator setting, as torch parsed it",
                        cal.reserve_ratio is not None and cal.reserved_mib is not None and cal.expandable_segments is True
                        and parsed is not False,
                        f"ratio {cal.reserve_ratio}, reserved {cal.reserved_mib} MiB at micro-batch "
                        f"{cal.micro_batches}, expandable segments recorded {cal.expandable_segments}, torch's allocator "
                        f"settings say {parsed}")


def test_calibrated_line_predicts_larger_micro_batches_within_10_percent(calibrated, record):
    assert [check.micro_batch for check in calibrated.predictions] == list(PROBE_MICRO_BATCHES)
    results = []
    for check in calibrated.predictions:
        results.append(record.check(
            f"calibrated prediction at micro-batch {check.micro_batch} within {TOLERANCE:.0%}",
            abs(check.calibrated_error) <= TOLERANCE, f"predicted {check.calibrated_mib:.0f} MiB, measured "
            f"{check.measured_mib:.0f} MiB ({check.calibrated_error:+.1%})"))
        record.check(f"analytic estimate at micro-batch {check.micro_batch} within {TOLERANCE:.0%}",
                     abs(check.estimate_error) <= TOLERANCE, f"estimate {check.estimate_mib:.0f} MiB vs measured "
                     f"{check.measured_mib:.0f} MiB ({check.estimate_error:+.1%})", required=False)
    errors = ", ".join(f"{c.calibrated_error:+.1%}" for c in calibrated.predictions)
    cal = calibrated.calibration
    record.set_summary(f"slope {cal.slope_mib:.0f} MiB/seq, intercept {cal.intercept_mib:.0f} MiB; calibrated error "
                       f"at m={','.join(map(str, PROBE_MICRO_BATCHES))}: {errors}; estimate at "
                       f"m={PROBE_MICRO_BATCHES[-1]}: {calibrated.predictions[-1].estimate_error:+.1%} "
                       f"({calibrated.backend})")
    assert all(results)


def test_the_calibration_is_stored_in_a_baseline_document(calibrated, gpu_out):
    import json

    from dflash.memory.calibration_record import load_calibration

    path = gpu_out / "calibration_baseline.json"
    stored = load_calibration(json.loads(path.read_text(encoding="utf-8")), str(path))
    assert stored == calibrated.calibration and stored.workload_key == calibrated.workload.key()
