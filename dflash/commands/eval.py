"""`launcher.py eval --profile P [--draft CHECKPOINT] [--prompts FILE] [--bench NAME,...]`: real speculative decoding.

Decodes held-out prompts with the target alone, with the trained DFlash drafter and with prompt
lookup (same block size); prints mean tau and speedup of each and writes `{run_dir}/eval/`
(report.json, report.md, PNG plots).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional

from launcher_core.cli import add_profile_option, load_profile_arg

if TYPE_CHECKING:
    from dflash.eval.report_schema import EvalReport
    from launcher_core.schema import Profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--draft", metavar="CHECKPOINT",
                        help="drafter checkpoint (step-N/ or a checkpoints/ dir); default: the run's latest")
    parser.add_argument("--prompts", metavar="FILE", help="prompts JSONL (default: paths.eval_prompts, "
                        "else the built-in held-out set)")
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: the profile's paths.run_dir)")
    parser.add_argument("--num-prompts", type=int, metavar="N", help="first N prompts (default: eval.num_prompts)")
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="default: eval.max_new_tokens")
    parser.add_argument("--temperature", type=float, metavar="T",
                        help="0: greedy, lossless (default: eval.temperature); > 0: speculative rejection sampling")
    parser.add_argument("--seed", type=int, help="sampling seed (default: eval.seed)")
    parser.add_argument("--engine", choices=("transformers", "sglang", "vllm"),
                        help="transformers: in-process decoding (default on CPU); sglang / vllm: the engine serves "
                             "the target with the drafter on 127.0.0.1 and reports tau (default: eval.engine)")
    parser.add_argument("--bench", metavar="NAME[,NAME...]",
                        help="benchmarks decoded beside the default set, one row each, prompts built and samples "
                             "chosen as z-lab's dflash.benchmark (PyPI dflash 0.1.0) does on each of its paths: the "
                             "rows shuffled by random.Random(42), the first N (--num-prompts, else "
                             "eval.bench_samples, else eval.num_prompts): humaneval, mt-bench, gsm8k, math500, mbpp "
                             "(default: eval.benchmarks)")
    parser.add_argument("--bench-dir", metavar="DIR",
                        help="local copies of gsm8k / math500 / mbpp: DIR/<name>/<split>.jsonl or a datasets "
                             "save_to_disk folder DIR/<name>/ (default: eval.bench_dir, else the hub or its cache)")
    parser.add_argument("--thinking", choices=("on", "off"),
                        help="render the prompts with thinking on or off (default: generate.thinking); refused "
                             "when the drafter's training data was rendered otherwise (its dflash_meta.json)")
    parser.add_argument("--allow-mode-mismatch", action="store_true",
                        help="render the prompts otherwise than the training data (thinking mode, chat template) "
                             "on purpose, to measure what it costs; the report marks every row")


def run(args: argparse.Namespace) -> int:
    from launcher_core.errors import ConfigError
    from launcher_core.profile import expand_path
    from launcher_core.runlock import run_lock

    for flag in ("num_prompts", "max_new_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.temperature is not None and args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    benchmarks = None
    if args.bench is not None:
        from dflash.prompts.benchmarks import parse_bench_names

        benchmarks = parse_bench_names(args.bench)
    profile = load_profile_arg(args)
    if args.draft:
        check_drafter_fits_target(profile, args.draft)      # refused before the run directory is touched
    with run_lock(args.run_dir or expand_path(profile, profile.paths.run_dir), "eval"):   # not into a live run
        return evaluate(profile, args, benchmarks)


def evaluate(profile: Profile, args: argparse.Namespace, benchmarks: Optional[tuple[str, ...]]) -> int:
    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions

    options = EvalOptions(checkpoint=args.draft, prompts_path=args.prompts, num_prompts=args.num_prompts,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          engine=args.engine, benchmarks=benchmarks, bench_dir=args.bench_dir,
                          thinking=None if args.thinking is None else args.thinking == "on",
                          allow_mode_mismatch=args.allow_mode_mismatch)
    summary = run_eval(profile, run_dir=args.run_dir, options=options)
    print(summary_lines(summary.report))
    for path in summary.files:
        print(f"wrote {path}")
    return 0


def check_drafter_fits_target(profile: Profile, draft: str) -> None:
    """`--draft` against the profile's target, from the two config.json files, before either model
    loads: ConfigError (exit 2) "trained for another target" listing what differs."""
    from pathlib import Path

    from dflash.drafter.checkpoint_files import CONFIG, resolve_checkpoint_dir
    from dflash.drafter.verify import target_fit_problems
    from dflash.target_model import resolve_model_path
    from launcher_core.errors import ConfigError
    from launcher_core.fileio import read_json_object

    directory = resolve_checkpoint_dir(Path(draft))
    if not (directory / CONFIG).is_file():
        return                                  # the loader names what is missing
    target = resolve_model_path(profile.model.target)
    problems = target_fit_problems(read_json_object(directory / CONFIG, "a drafter config"),
                                   read_json_object(target / "config.json", "a model config"))
    if problems:
        raise ConfigError(f"--draft {draft}: this drafter was trained for another target, not {target} "
                          f"(model.target of profile {profile.name}):\n" + "\n".join(f"  {p}" for p in problems) +
                          "\nevaluate it with the profile of its own target, or pass the drafter trained for this one")


def summary_lines(report: EvalReport) -> str:
    """One line per method: mean tau, tokens/s, speedup (and losslessness when greedy)."""
    from dflash.eval.options import drafted_figures

    prompt_set = report.context.prompt_set
    lines = [f"eval{' (' + report.engine + ', engine-reported tau)' if report.engine else ''}: "
             f"{report.num_prompts} prompts{' (' + prompt_set + ')' if prompt_set else ''}, block size {report.block_size}, temperature {report.temperature}"]
    if report.context.rendering:
        lines.append(f"  prompts rendered {report.context.rendering}")
    if report.context.mode_mismatch:
        lines.append(f"  {report.context.mode_mismatch}")
    if report.context.engine_deviation:
        lines.append(f"  engine deviation: {report.context.engine_deviation}")
    for name, method in report.methods.items():
        tau = f"tau {method.mean_tau:.2f}  " if name != "target" and method.mean_tau is not None else " " * 11
        same = method.identical_to_target
        note = "" if same is None else ("  identical to target" if same else "  OUTPUT DIFFERS FROM TARGET")
        lines.append(f"  {name:<14} {tau}{method.tokens_per_s:8.1f} tok/s  speedup {method.speedup or 0:.2f}x{note}")
    for extra in report.also_sets:
        what = f"benchmark {extra.benchmark}, {extra.num_prompts} turns" if extra.benchmark else \
            f"also {extra.num_prompts} prompts ({extra.prompt_set})"
        flags = [f"{name} {'identical to target' if m.identical_to_target else 'OUTPUT DIFFERS FROM TARGET'}"
                 for name, m in extra.methods.items() if extra.benchmark and m.identical_to_target is not None]
        lines.append(f"{what}: {drafted_figures(extra.methods)}{'; ' + ', '.join(flags) if flags else ''}  "
                     f"(report: {extra.report})")
    if report.parity:
        from dflash.eval.parity import parity_summary

        lines += parity_summary(report.parity)
    return "\n".join(lines)
