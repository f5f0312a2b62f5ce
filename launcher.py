#!/usr/bin/env python3
"""Single-node GPU launcher with environment guardrails for DFlash drafter training.

A thin CLI: each subcommand lives in its own module (imported only when that subcommand runs,
so `--help`, `profiles`, `plan` and `audit` never import torch), and exceptions map to exit
codes in one place (`launcher_core.errors.exit_code_for`); a fault of the node (a full disk, a read-only
filesystem, permission denied, the host out of memory) is EXIT_NODE (`launcher_core.nodefault`); any other
exception is a crash: its traceback is written to a file and the command exits with EXIT_CRASH
(`launcher_core.crash`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# name -> (module with add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "profiles": ("dflash.commands.profiles", "list the profiles in profiles/"),
    "plan": ("dflash.commands.plan", "print the resolved profile and run plan; starts nothing"),
    "calibrate": ("dflash.commands.calibrate", "measure the memory model on this GPU; store it in the baseline"),
    "audit": ("envcheck.commands.audit", "preflight audit of this machine (or of a saved snapshot)"),
    "snapshot": ("envcheck.commands.snapshot", "save this machine's facts as a JSON snapshot"),
    "baseline": ("envcheck.commands.baseline", "save a profile's baseline / diff two snapshots"),
    "generate": ("dflash.commands.generate", "generate completions with SGLang or transformers serve"),
    "tokenize": ("dflash.commands.tokenize", "completions JSONL -> Arrow training dataset"),
    "inspect": ("dflash.commands.inspect", "statistics and degenerate samples of a dataset"),
    "merge": ("dflash.commands.merge", "merge two datasets safely (backup, schema check, atomic)"),
    "train": ("dflash.commands.train", "online DFlash drafter training with torchrun"),
    "eval": ("dflash.commands.eval", "speculative-decoding evaluation: tau and speedup"),
    "export": ("dflash.commands.export", "write a drafter checkpoint in the format SGLang, vLLM or the reference loads"),
    "pipeline": ("dflash.commands.pipeline", "the whole workflow: audit, generate, tokenize, train, eval"),
    "status": ("dflash.commands.status", "stage-by-stage state of a run directory"),
    "probe": ("envcheck.commands.probe", "memory probe (git bisect run exit codes)"),
    "bisect": ("envcheck.commands.bisect", "find the dependency change behind a memory regression"),
    "engine": ("dflash.commands.engine", "build a serving engine's own venv (engine setup vllm|sglang)"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The top-level parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="launcher.py", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt as error:
        from launcher_core.errors import exit_code_for

        print("interrupted", file=sys.stderr)
        return exit_code_for(error)
    except Exception as error:  # the funnel: the user's or the node's error in one line; anything else is a bug
        return _report(args.command, argv, error)


def _report(command: str, argv: Sequence[str], error: Exception) -> int:
    """A LauncherError, or a fault of the node (a full disk, a read-only filesystem, permission denied, the
    host out of memory: launcher_core.nodefault), in one line and its exit code; anything else is a crash:
    its traceback to a file (secrets masked), one line to stderr, the crash exit code."""
    from launcher_core.crash import crash_exit_code, crash_line, known_exit_code, write_crash_report
    from launcher_core.errors import exit_code_for
    from launcher_core.nodefault import known_error
    from launcher_core.redact import mask_secrets

    known = known_error(error)
    if known is not None:
        print(f"{known.label}: {mask_secrets(str(known) or type(known).__name__)}", file=sys.stderr)
        return known_exit_code(command, exit_code_for(known))
    report = write_crash_report(command, argv, error)
    print(crash_line(command, error, report), file=sys.stderr)
    return crash_exit_code(command)


if __name__ == "__main__":
    sys.exit(main())
