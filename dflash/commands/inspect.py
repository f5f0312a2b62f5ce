"""`launcher.py inspect DATASET`: samples, tokens, loss-token histogram, degenerate samples by reason."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", metavar="DATASET", help="a dataset directory written by tokenize or merge")
    parser.add_argument("--min-loss-tokens", type=int, metavar="N",
                        help="fewer loss tokens is degenerate (default: the value recorded at tokenize time)")
    parser.add_argument("--tool-call-repeat-limit", type=int, metavar="N",
                        help="an identical <tool_call> repeated this often in a turn is degenerate")
    parser.add_argument("--examples", type=int, default=5, metavar="K", help="example ids shown per reason")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    from dflash.data.inspect import inspect_dataset

    report = inspect_dataset(args.dataset, args.min_loss_tokens, args.tool_call_repeat_limit, args.examples)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.format_text())
    return 0
