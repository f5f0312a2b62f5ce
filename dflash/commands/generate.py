"""`launcher.py generate --profile P`: completions for the profile's prompts, resumable.

Runs the preflight audit, starts the profile's server (SGLang on GPU, `transformers serve` on CPU)
or uses `--endpoint`s, and writes one completion per prompt id. `--dry-run` prints the server
command and a request body and starts nothing.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from launcher_core.cli import add_profile_option, load_profile_arg

if TYPE_CHECKING:
    from launcher_core.schema import Profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--input", metavar="JSONL", help="prompts JSONL (default: the profile's paths.prompts)")
    parser.add_argument("--output", metavar="JSONL", help="completions JSONL (default: the profile's paths.completions)")
    parser.add_argument("--endpoint", action="append", default=[], metavar="URL",
                        help="an already-running OpenAI-compatible server (repeat to share the load); "
                             "no server is started. A key in it (?api_key=KEY) is sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--api-key", metavar="KEY",
                        help="the key of the --endpoint servers whose URL has no ?api_key=, sent as "
                             "'Authorization: Bearer KEY' (default: the environment's DFLASH_API_KEY, which, unlike "
                             "this flag, no process listing shows)")
    parser.add_argument("--retry-failed", action="store_true", help="send only the prompts in generate/failures.jsonl")
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: the profile's paths.run_dir)")
    parser.add_argument("--limit", type=_positive_int, metavar="N", help="use only the first N prompts of the input")
    parser.add_argument("--force", action="store_true", help="generate even if the preflight audit finds a FAIL")
    parser.add_argument("--skip-preflight", action="store_true", help="do not run the preflight audit first")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--dry-run", action="store_true", help="print the server command and a request; start nothing")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    profile = load_profile_arg(args)
    if args.dry_run:
        return _dry_run(profile, args)
    from dflash.generate import generate_from_profile

    summary = generate_from_profile(
        profile, input_path=args.input, output_path=args.output, endpoints=args.endpoint,
        retry_failed=args.retry_failed, force=args.force, run_dir=args.run_dir, limit=args.limit,
        preflight=not args.skip_preflight, progress=not args.no_progress, api_key=args.api_key)
    for line in summary.lines():
        print(line)
    return 0


def _dry_run(profile: Profile, args: argparse.Namespace) -> int:
    import json

    from dflash.generate.dry_run import generation_plan

    plan = generation_plan(profile, args.input, args.output, args.endpoint, args.run_dir, args.api_key)
    print(json.dumps(plan, indent=2))
    return 0
