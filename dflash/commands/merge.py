"""`launcher.py merge --base A --add B (--output C | --in-place)`: schema check, backup, atomic merge."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, metavar="DATASET", help="the dataset to add to")
    parser.add_argument("--add", required=True, metavar="DATASET", help="the dataset whose rows are appended")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--output", metavar="DATASET", help="write the merged dataset here (a new path)")
    target.add_argument("--in-place", action="store_true", help="replace the base (after a verified backup)")
    parser.add_argument("--dedup", choices=("none", "id", "content"), default="none",
                        help="drop added rows whose id / token content is already present (default: none)")
    parser.add_argument("--backup-dir", metavar="DIR", help="where the in-place backup goes (default: next to the base)")
    parser.add_argument("--shard-rows", type=int, metavar="N", help="rows per shard (default: the base's)")
    parser.add_argument("--force", action="store_true",
                        help="--output: replace an existing merged dataset there (kept as DATASET.backup-<time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from dflash.data.merge import merge_datasets
    from launcher_core.runlock import run_locks_for

    written = [args.base if args.in_place else args.output, *([args.backup_dir] if args.backup_dir else [])]
    with run_locks_for(written, "merge"):            # not into the dataset of a live run
        summary = merge_datasets(args.base, args.add, output=args.output, in_place=args.in_place, dedup=args.dedup,
                                 shard_rows=args.shard_rows, backup_dir=args.backup_dir, progress=not args.no_progress,
                                 force=args.force)
    print(summary.format_text())
    return 0
