"""`launcher.py probe`: measure this environment's memory; judge it against a baseline.

Exit codes follow `git bisect run`: 0 good, 1 bad (a stage grew beyond the tolerance against
`--against`, or a rank ran out of memory), 125 cannot test. Standard library only, so it runs
with any environment's python (the bisect runs it inside each candidate venv).
"""
from __future__ import annotations

import argparse
import os

from launcher_core.cli import add_profile_option

BASELINE_ENV = "ENVCHECK_PROBE_BASELINE"   # set by `launcher.py bisect` for each candidate
OUT_ENV = "ENVCHECK_PROBE_OUT"
DEFAULT_TOLERANCE_MIB = 64.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser, required=False)
    parser.add_argument("--against", metavar="BASELINE", default=os.environ.get(BASELINE_ENV),
                        help=f"a saved probe report to judge this one against (default: ${BASELINE_ENV})")
    parser.add_argument("--out", metavar="FILE", default=os.environ.get(OUT_ENV),
                        help=f"write the probe report (JSON) here (default: ${OUT_ENV}, else not written)")
    parser.add_argument("--tolerance-mib", type=float, default=None,
                        help="growth allowed per rank and stage (default: the profile's "
                             f"audit.baseline_context_tolerance_mib, else {DEFAULT_TOLERANCE_MIB:.0f})")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE[,MODULE]",
                        help="also import these modules before measuring (e.g. sglang,flashinfer)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: the profile's machine.nproc_per_node, else one per visible GPU, 1 on CPU)")
    parser.add_argument("--steps", type=int, default=3, help="training steps for the peak (default 3)")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the probe's random model")
    parser.add_argument("--layers", type=int, default=8, help="blocks of the probe's random model")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the probe gives up (125)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from envcheck.memprobe import compare_reports, format_report, load_report, run_probe
    from launcher_core.errors import EXIT_FAIL, EXIT_OK, CannotTest
    from launcher_core.fileio import write_json_atomic

    options, tolerance = _options_from_args(args)
    baseline = load_report(args.against) if args.against else None
    report = run_probe(options)
    if args.out:
        write_json_atomic(args.out, report.to_json())
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    if baseline is None:
        return EXIT_OK
    comparison = compare_reports(baseline, report, tolerance)
    print(_verdict_text(comparison))
    if comparison.verdict == "cannot_test":
        raise CannotTest("; ".join(comparison.notes))
    return EXIT_FAIL if comparison.verdict == "bad" else EXIT_OK


def _options_from_args(args: argparse.Namespace):
    from envcheck.memprobe import ProbeOptions

    profile = None
    if args.profile:
        from launcher_core.cli import load_profile_arg

        profile = load_profile_arg(args)
    nproc = args.nproc if args.nproc is not None else (profile.machine.nproc_per_node if profile else 0)
    device = args.device if args.device != "auto" or profile is None else profile.machine.device
    imports = [name.strip() for item in args.imports for name in item.split(",") if name.strip()]
    options = ProbeOptions(imports=imports, device=device, nproc=nproc, steps=args.steps,
                           hidden=args.hidden, layers=args.layers, timeout_s=args.timeout)
    tolerance = args.tolerance_mib
    if tolerance is None:
        tolerance = float(profile.audit.baseline_context_tolerance_mib) if profile else DEFAULT_TOLERANCE_MIB
    return options, tolerance


def _verdict_text(comparison) -> str:
    where = f" (worst: {comparison.worst_where} {comparison.worst_delta_mib:+.1f} MiB)" if comparison.worst_where else ""
    lines = [f"verdict: {comparison.verdict.upper()} against the baseline, tolerance "
             f"{comparison.tolerance_mib:.0f} MiB{where}"]
    lines += [f"  note: {note}" for note in comparison.notes]
    return "\n".join(lines)
