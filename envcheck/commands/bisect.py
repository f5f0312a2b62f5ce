"""`launcher.py bisect --good GOOD --bad BAD [--probe CMD]`: find the dependency change behind a
memory regression by binary search over candidate environments built with uv.
`--plan` prints the groups (and why each is one) and the probe bound, building nothing."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher_core.cli import add_profile_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--good", required=True, type=Path,
                        help="requirement set that works: pinned requirements file, `pip freeze` output or snapshot JSON")
    parser.add_argument("--bad", required=True, type=Path, help="requirement set with the regression (same formats)")
    parser.add_argument("--probe", default=None, metavar="CMD",
                        help="probe command (git bisect run exit codes); {python} {venv} {out} are expanded; "
                             "default: `{python} launcher.py probe` judged against GOOD's probe")
    add_profile_option(parser, required=False)
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="scratch venvs, step logs and the report (default: {run_dir}/bisect, runs/bisect without a profile)")
    parser.add_argument("--log", type=Path, default=None, help="resumable JSON-lines log (default: WORK_DIR/log.jsonl)")
    parser.add_argument("--fresh", action="store_true", help="discard an existing log instead of resuming it")
    parser.add_argument("--group", action="append", default=[], metavar="A,B",
                        help="packages that must move together (besides what their metadata couples)")
    parser.add_argument("--no-metadata", action="store_true",
                        help="do not read Requires-Dist; group by the hard-coded torch / flashinfer families only")
    parser.add_argument("--verify-bad", action="store_true", help="also probe BAD itself (one more probe)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after N new steps; rerun to resume")
    parser.add_argument("--installer", choices=("uv", "pip"), default="uv")
    parser.add_argument("--python", default=sys.executable, help="interpreter the candidate venvs are made from")
    parser.add_argument("--find-links", action="append", default=[], metavar="DIR_OR_URL", help="extra wheel source")
    parser.add_argument("--no-index", action="store_true", help="install only from --find-links")
    parser.add_argument("--offline", action="store_true", help="uv: never touch the network (cache and --find-links only)")
    parser.add_argument("--cache-dir", default=None, help="installer cache (default: uv's shared cache)")
    parser.add_argument("--keep-venvs", action="store_true", help="keep each candidate venv after its probe")
    parser.add_argument("--probe-timeout", type=float, default=1800.0, help="seconds per probe before it counts as skip")
    parser.add_argument("--plan", action="store_true",
                        help="print the groups, why each is a group, their order and the probe bound; builds nothing")
    parser.add_argument("--list-groups", action="store_true", help="same as --plan")
    parser.add_argument("--json", action="store_true", help="print the report (or the plan) as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from envcheck.bisect.bisect_report import build_plan_report, build_report, format_plan, format_report, save_report
    from envcheck.bisect.runner import plan_bisect, run_bisect

    config = _config_from_args(args)
    if args.plan or args.list_groups:
        plan_report = build_plan_report(plan_bisect(config))
        print(json.dumps(plan_report, indent=2) if args.json else format_plan(plan_report))
        return 0
    plan, log, complete = run_bisect(config)
    report = build_report(plan, log, complete)
    save_report(report, config.work_dir)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _config_from_args(args: argparse.Namespace):
    from envcheck.bisect.runner import DEFAULT_PROBE, BisectConfig
    from envcheck.bisect.venvs import InstallerOptions

    work_dir = args.work_dir or _default_work_dir(args)
    installer = InstallerOptions(installer=args.installer, base_python=args.python,
                                 find_links=tuple(args.find_links), no_index=args.no_index,
                                 offline=args.offline, cache_dir=args.cache_dir)
    return BisectConfig(good=args.good, bad=args.bad, work_dir=work_dir,
                        log_path=args.log or work_dir / "log.jsonl", probe=args.probe or _default_probe(args, DEFAULT_PROBE),
                        installer=installer, extra_groups=args.group, verify_bad=args.verify_bad,
                        max_steps=args.max_steps, fresh=args.fresh, keep_venvs=args.keep_venvs,
                        probe_timeout_s=args.probe_timeout, use_metadata=not args.no_metadata)


def _default_work_dir(args: argparse.Namespace) -> Path:
    if not args.profile:
        return Path("runs") / "bisect"
    from launcher_core.cli import load_profile_arg
    from launcher_core.profile import expand_path

    return expand_path(load_profile_arg(args), "{run_dir}/bisect")


def _default_probe(args: argparse.Namespace, default: str) -> str:
    """`launcher.py probe`, with the bisect's profile when one is given."""
    import shlex

    return f"{default} --profile {shlex.quote(args.profile)}" if args.profile else default
