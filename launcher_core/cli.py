"""Command-line helpers every subcommand shares: the --profile option and its loading."""
from __future__ import annotations

import argparse

from launcher_core.schema import Profile


def add_profile_option(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--profile", required=required, metavar="P",
                        help="profile name in profiles/ (see `launcher.py profiles`) or a path to a TOML file")


def load_profile_arg(args: argparse.Namespace) -> Profile:
    from launcher_core.profile import load_profile

    return load_profile(args.profile)
