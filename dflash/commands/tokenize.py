"""`launcher.py tokenize --profile P`: completions JSONL -> Arrow training dataset (then inspect)."""
from __future__ import annotations

import argparse

from launcher_core.cli import add_profile_option, load_profile_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--input", nargs="+", metavar="JSONL", help="completions file(s) (default: paths.completions)")
    parser.add_argument("--output", metavar="DATASET", help="dataset directory (default: paths.dataset)")
    parser.add_argument("--workers", type=int, metavar="N", help="worker processes (default: data.num_workers, 0 = one per core)")
    parser.add_argument("--allow-degenerate", action="store_true",
                        help="write the dataset even if more than data.max_degenerate_share of it is rejected or degenerate")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing dataset at the output path (it is kept as DATASET.backup-<time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from dflash.data.inspect import inspect_dataset
    from dflash.data.tokenize import tokenize_completions
    from launcher_core.profile import expand_path
    from launcher_core.runlock import run_lock, run_locks_for

    profile = load_profile_arg(args)
    run_dir = expand_path(profile, profile.paths.run_dir)
    output = args.output or expand_path(profile, profile.paths.dataset)
    with run_lock(run_dir, "tokenize"), run_locks_for([output], "tokenize"):     # not under a live run
        summary = tokenize_completions(profile, args.input, args.output, workers=args.workers,
                                       allow_degenerate=args.allow_degenerate, run_dir=run_dir,
                                       progress=not args.no_progress, force=args.force)
    print(f"tokenized {summary.records:,} records -> {summary.samples:,} samples, {summary.tokens:,} tokens, "
          f"{summary.loss_tokens:,} loss tokens in {summary.seconds:.1f} s -> {summary.output}")
    if summary.backup:
        print(f"  the dataset it replaced is kept at {summary.backup}")
    if summary.rewritten_turns:
        print(f"  {summary.rewritten_turns:,} turns the chat template rewrites later got samples of their own")
    reasons = ", ".join(f"{reason}={count:,}" for reason, count in summary.rejects.items())
    print(f"  rejected {summary.rejected:,} records" + (f" ({reasons}); see {summary.rejects_path}" if reasons else ""))
    print(inspect_dataset(summary.output, verify=False).format_text())
    return 0
