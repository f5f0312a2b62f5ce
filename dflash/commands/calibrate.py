"""`launcher.py calibrate --profile P [--baseline FILE] [--target-override DIR] [--check 4,8] [--json]`:
measure the profile's worst-case training step on this GPU at micro-batch 1 and 2 and store the
fitted line in the profile's baseline (key `memory_calibration`), where `plan` reads it, with the
allocator's reserve ratio (peak reserved over peak allocated, across differently shaped
micro-batches), measured under the allocator setting the profile's ranks run with.

The baseline is the file `launcher.py baseline save --profile P` writes for this host; when
there is none yet, this machine's snapshot is saved there first (as `baseline save` would).
Exit 2 for a CPU profile, 125 where there is no CUDA device (see dflash.measure.gpu_calibration).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from launcher_core.cli import add_profile_option, load_profile_arg

if TYPE_CHECKING:
    from dflash.measure.gpu_calibration import CalibrationRun
    from launcher_core.schema import Profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--baseline", metavar="FILE", type=Path,
                        help="write the calibration into this baseline file (default: the profile's baseline "
                             "for this host, where `baseline save --profile P` writes it)")
    parser.add_argument("--target-override", metavar="DIR",
                        help="measure with this target directory instead of the profile's model.target "
                             "(the calibration is keyed by the target's shape, so it must be the same model)")
    parser.add_argument("--check", metavar="M,M", default="",
                        help="also measure these micro-batches and compare with the calibrated line (e.g. 4,8)")
    parser.add_argument("--scratch", metavar="DIR", type=Path,
                        help="keep the worst-case dataset and run directory here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    from dflash.measure.gpu_calibration import calibrate, require_cuda, store_calibration

    profile = with_target_override(load_profile_arg(args), args.target_override)
    require_cuda(profile)
    baseline = args.baseline or default_baseline(profile)
    run_result = calibrate(profile, args.scratch, parse_micro_batches(args.check))
    path = store_calibration(baseline, run_result.calibration)
    if args.json:
        print(json.dumps(result_document(run_result, path), indent=2))
    else:
        print("\n".join(describe(run_result, path)))
    return 0


def with_target_override(profile: Profile, target: str | None) -> Profile:
    import dataclasses

    if not target:
        return profile
    return dataclasses.replace(profile, model=dataclasses.replace(profile.model, target=str(Path(target).resolve())))


def parse_micro_batches(text: str) -> tuple[int, ...]:
    from launcher_core.errors import ConfigError

    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--check {text!r}: expected comma-separated micro-batch sizes, e.g. 4,8") from None
    if any(value < 1 for value in values):
        raise ConfigError(f"--check {text!r}: micro-batch sizes must be >= 1")
    return values


def default_baseline(profile: Profile) -> Path:
    """The profile's baseline for this host; a live snapshot is saved there first when it is missing
    (taken before this process touches CUDA, so the free memory is the node's own)."""
    from envcheck import preflight
    from envcheck.baseline import baseline_path, save_baseline

    path = baseline_path(profile.name)
    if not path.exists():
        saved = save_baseline(preflight.live_snapshot(profile), profile.name)
        print(f"no baseline of profile {profile.name} on this host: saved this machine's snapshot to {saved}")
    return path


def result_document(run_result, baseline: Path) -> dict:
    from dflash.measure.gpu_calibration import iter_prediction_rows
    from dflash.memory.calibration_record import calibration_as_dict

    return {"baseline": str(baseline), "calibration": calibration_as_dict(run_result.calibration),
            "peaks_mib": {str(m): round(p, 1) for m, p in run_result.peaks_mib.items()},
            "backend": run_result.backend, "flex_error": run_result.flex_error,
            "warmup_s": round(run_result.warmup_s, 1), "reserve_ratio": run_result.calibration.reserve_ratio,
            "predictions": list(iter_prediction_rows(run_result))}


def describe(run_result: CalibrationRun, baseline: Path) -> list[str]:
    cal, workload = run_result.calibration, run_result.workload
    lines = [f"worst case: {workload.max_length} tokens, {workload.anchors} anchors x {workload.block_size} block "
             f"tokens per sequence; drafter sharded over {cal.world_size} measuring rank(s) (the plan corrects its "
             f"estimate for {workload.world_size}); backend {run_result.backend}"
             + (f" (flex_attention failed: {run_result.flex_error})" if run_result.flex_error else ""),
             "measured peak allocated: " + ", ".join(f"micro-batch {m}: {p:,.0f} MiB"
                                                      for m, p in run_result.peaks_mib.items()),
             f"calibration: peak = {cal.intercept_mib:,.0f} + {cal.slope_mib:,.0f} x micro-batch MiB, each step "
             f"{cal.micro_batches_per_step} micro-batches ({cal.device_name}, torch {cal.torch_version}; workload key "
             f"{cal.workload_key})",
             f"allocator reserve: reserved / allocated {cal.reserve_ratio or 1.0:.3f} across differently shaped "
             f"micro-batches ({'with' if cal.expandable_segments else 'without'} expandable segments; reserved "
             + ", ".join(f"{r:,.0f}" for r in cal.reserved_mib or ()) + " MiB at micro-batch "
             + ", ".join(map(str, cal.micro_batches)) + "); the plan counts it inside each budget"]
    for check in run_result.predictions:
        lines.append(f"micro-batch {check.micro_batch}: measured {check.measured_mib:,.0f} MiB, calibrated "
                     f"{check.calibrated_mib:,.0f} ({check.calibrated_error:+.1%}), analytic estimate "
                     f"{check.estimate_mib:,.0f} ({check.estimate_error:+.1%})")
    lines.append(f"written to {baseline} (key memory_calibration); `launcher.py plan --profile ...` uses it")
    return lines
