"""`launcher.py plan --profile P`: the resolved profile (and, later, the run plan). Starts nothing."""
from __future__ import annotations

import argparse

from envcheck.commands import add_profile_option, load_profile_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    from envcheck.profile import profile_as_dict

    profile = load_profile_arg(args)
    document = {"profile": profile_as_dict(profile)}
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(f"profile {profile.name}: {profile.description}")
    for section, values in document["profile"].items():
        if isinstance(values, dict):
            print(f"[{section}]")
            for key, value in values.items():
                print(f"  {key} = {value!r}")
    return 0
