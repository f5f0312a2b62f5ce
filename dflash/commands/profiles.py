"""`launcher.py profiles`: list the profiles with their base and description."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json
    import tomllib

    from launcher_core.profile import list_profiles, load_profile, profile_path

    rows = []
    for name in list_profiles():
        profile = load_profile(name)
        with profile_path(name).open("rb") as handle:
            base = tomllib.load(handle).get("extends", "")
        rows.append({"name": name, "extends": base, "device": profile.machine.device,
                     "gpus": profile.machine.gpu_count, "description": profile.description})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        base = f" (extends {row['extends']})" if row["extends"] else ""
        print(f"{row['name']:<{width}}  {row['description']}{base}")
    return 0
