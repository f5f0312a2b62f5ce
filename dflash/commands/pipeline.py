"""`launcher.py pipeline --profile P`: audit -> generate -> tokenize -> train -> eval in one run dir.

Rerun it to resume: finished stages are skipped (see dflash.stages). At the end it prints the
drafter's tau and speedup next to prompt lookup's, then a table of both, in-process and served by
`eval.serve_engine` side by side, and how each side's plain decoding (the speedup's baseline) ran,
then one row per benchmark of `eval.benchmarks` and method (tau, speedup, lossless, acceptance per
block position).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from launcher_core.cli import add_profile_option, load_profile_arg
from launcher_core.manifest import STAGES

if TYPE_CHECKING:
    from dflash.eval.report_schema import EvalReport, MethodFigures, SetBrief
    from launcher_core.schema import Profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: the profile's paths.run_dir)")
    parser.add_argument("--force", action="store_true", help="go on when the preflight audit FAILs")
    parser.add_argument("--redo", choices=STAGES, metavar="STAGE",
                        help=f"run STAGE and every later stage again even if done ({', '.join(STAGES)})")
    parser.add_argument("--stop-after", choices=STAGES, metavar="STAGE", help="stop after this stage")


def run(args: argparse.Namespace) -> int:
    import time

    from dflash.stages import run_pipeline, with_run_dir
    from launcher_core.profile import expand_path
    from launcher_core.runlock import run_lock

    profile = load_profile_arg(args)
    started = time.perf_counter()
    placed = with_run_dir(profile, args.run_dir)
    run_dir = expand_path(placed, placed.paths.run_dir)
    with run_lock(run_dir, "pipeline"):           # one run per directory (its train stage takes it again)
        outcomes = run_pipeline(profile, run_dir=args.run_dir, force_audit=args.force, redo=args.redo,
                                stop_after=args.stop_after)
    print(f"\npipeline ({profile.name}), {time.perf_counter() - started:.0f} s:")
    for outcome in outcomes:
        took = f"{outcome.wall_s:6.0f} s" if outcome.action == "ran" else "skipped "
        print(f"  {outcome.name:<9} {took}  {outcome.detail}")
    print(final_figures(profile, args.run_dir))
    return 0


def final_figures(profile: Profile, run_dir: str | None) -> str:
    """tau and speedup of the drafter beside prompt lookup's, from the manifest."""
    from dflash.stages import with_run_dir
    from launcher_core.manifest import read_manifest
    from launcher_core.profile import expand_path

    profile = with_run_dir(profile, run_dir)
    directory = expand_path(profile, profile.paths.run_dir)
    entry = read_manifest(directory)["stages"].get("eval", {})
    if entry.get("state") != "done":
        return f"run directory: {directory} (no eval yet)"
    on = f" on {entry.get('prompts')} prompts, {entry['prompt_set']}" if entry.get("prompt_set") else ""
    also = "".join(f"tau on {extra.num_prompts} prompts, {extra.prompt_set}: DFlash "
                   f"{_rounded(extra.methods, 'dflash')} vs prompt lookup {_rounded(extra.methods, 'prompt_lookup')}\n"
                   for extra in _also_sets(directory) if not extra.benchmark)
    table = "".join(f"{line}\n" for line in side_by_side(directory, profile.eval.serve_engine))
    served = profile.eval.serve_engine or ("" if profile.eval.engine == "transformers" else profile.eval.engine)
    benchmarks = "".join(f"{line}\n" for line in benchmark_rows(directory, served))
    return (f"tau{on}: DFlash {entry.get('dflash_tau')} vs prompt lookup {entry.get('prompt_lookup_tau')}; "
            f"speedup: DFlash {entry.get('dflash_speedup')}x vs prompt lookup {entry.get('prompt_lookup_speedup')}x\n"
            f"{also}{table}{benchmarks}"
            f"run directory: {directory} (report: {directory / 'eval' / 'report.md'}; "
            f"`launcher.py status {directory}`)")


SIDE_BY_SIDE_METHODS = (("dflash", "DFlash"), ("prompt_lookup", "prompt lookup"), ("target", "target alone"))


def side_by_side(run_dir: Path, engine: str) -> list[str]:
    """The main prompt set's tau and speedup of each method in-process and served by `engine`
    (eval/engine-ENGINE.json, when the pipeline served it), and how each side's target alone ran."""
    from dflash.eval.report_schema import read_report
    from launcher_core.errors import InputError

    try:
        inprocess = read_report(run_dir / "eval" / "report.json")
    except InputError:
        return []
    served = None
    if engine and (run_dir / "eval" / f"engine-{engine}.json").exists():
        try:
            served = read_report(run_dir / "eval" / f"engine-{engine}.json")
        except InputError:
            served = None
    header = f"  {'method':<14} {'in-process tau':>14} {'speedup':>8}"
    header += f"   {('served (' + engine + ') tau'):>18} {'speedup':>8}" if served else ""
    lines = [f"in-process{' and served' if served else ''}, {inprocess.num_prompts} prompts, "
             f"{inprocess.context.prompt_set or inprocess.context.prompts_file}:", header]
    for name, label in SIDE_BY_SIDE_METHODS:
        row = f"  {label:<14} {_figures(inprocess.methods, name)}"
        lines.append(row + (f"   {_figures(served.methods, name, width=18)}" if served else ""))
    lines += [f"  in-process: {inprocess.context.baseline}"] if inprocess.context.baseline else []
    lines += [f"  served: {served.context.baseline}"] if served and served.context.baseline else []
    return lines


def benchmark_rows(run_dir: Path, engine: str) -> list[str]:
    """One row per benchmark (eval.benchmarks) and drafting method, DFlash beside prompt lookup: tau, speedup,
    whether every output equals the target's, acceptance at each block position; in-process (every turn),
    then served by `engine` (first turns) where the eval decoded them there."""
    named = [("in-process", "report.json")] + ([(f"served ({engine})", f"engine-{engine}.json")] if engine else [])
    reports = [(label, _report_or_none(run_dir / "eval" / name)) for label, name in named]
    sides = [(label, report) for label, report in reports if report and any(s.benchmark for s in report.also_sets)]
    if not sides:
        return []
    lines = ["benchmarks (z-lab's prompts; in-process: every turn, served: first turns):",
             f"  {'benchmark':<10} {'decoded':<14} {'turns':>5}  {'method':<14} {'tau':>6} {'speedup':>8}  "
             f"{'lossless':<8}  acceptance at positions 1..{sides[0][1].block_size - 1}"]
    for label, report in sides:
        lines += [_benchmark_row(extra, label, name, title) for extra in report.also_sets if extra.benchmark
                  for name, title in SIDE_BY_SIDE_METHODS[:2] if name in extra.methods]
    return lines


def _report_or_none(path: Path) -> Optional[EvalReport]:
    from dflash.eval.report_schema import read_report
    from launcher_core.errors import InputError

    try:
        return read_report(path) if path.exists() else None
    except InputError:
        return None


def _benchmark_row(extra: SetBrief, side: str, name: str, title: str) -> str:
    from dflash.eval.report_writer import acceptance_cell

    method = extra.methods[name]
    tau = "-" if method.mean_tau is None else f"{method.mean_tau:.3f}"
    speedup = "-" if method.speedup is None else f"{method.speedup:.2f}x"
    lossless = {True: "yes", False: "NO", None: "-"}[method.identical_to_target]
    return (f"  {extra.benchmark or '':<10} {side:<14} {extra.num_prompts:>5}  {title:<14} {tau:>6} {speedup:>8}  "
            f"{lossless:<8}  {acceptance_cell(method.position_acceptance) or '-'}")


def _figures(methods: dict[str, MethodFigures], name: str, width: int = 14) -> str:
    method = methods.get(name)
    if method is None:
        return f"{'-':>{width}} {'-':>8}"
    tau = "-" if name == "target" or method.mean_tau is None else f"{method.mean_tau:.3f}"
    speedup = "-" if method.speedup is None else f"{method.speedup:.2f}x"
    rate = f" ({method.tokens_per_s:.1f} tok/s)" if name == "target" else ""
    return f"{tau:>{width}} {speedup:>8}{rate}"


def _also_sets(run_dir) -> list[SetBrief]:
    """The extra prompt sets the eval measured (`eval.also_prompts`), from its report."""
    from dflash.eval.report_schema import read_report
    from launcher_core.errors import InputError

    try:
        return read_report(run_dir / "eval" / "report.json").also_sets
    except InputError:
        return []


def _rounded(methods: dict[str, MethodFigures], name: str) -> str:
    tau = methods[name].mean_tau if name in methods else None
    return f"{tau:.3f}" if tau is not None else "-"
