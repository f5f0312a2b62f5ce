"""Subcommand modules. Each defines `add_arguments(parser)` and `run(args) -> int` and keeps
heavy imports inside `run` (or deeper)."""
from __future__ import annotations

import argparse

from envcheck.schema import Profile


def add_profile_option(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--profile", required=required, metavar="P",
                        help="profile name in profiles/ (see `launcher.py profiles`) or a path to a TOML file")


def load_profile_arg(args: argparse.Namespace) -> Profile:
    from envcheck.profile import load_profile

    return load_profile(args.profile)
