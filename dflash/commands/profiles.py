"""`launcher.py profiles`: list the profiles with their base and description.

A profile that does not load (not TOML, an unknown key, a base it cannot find) does not hide the others:
they are listed, and the broken one is named with its error on stderr (exit 2)."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    from launcher_core.errors import EXIT_OK, EXIT_USAGE
    from launcher_core.profile import list_profiles

    rows = [profile_row(name) for name in list_profiles()]
    good = [row for row in rows if "error" not in row]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif good:
        width = max(len(row["name"]) for row in good)
        for row in good:
            base = f" (extends {row['extends']})" if row["extends"] else ""
            print(f"{row['name']:<{width}}  {row['description']}{base}")
    for row in rows:
        if "error" in row:
            print(f"error: profile {row['name']} does not load: {row['error']}", file=sys.stderr)
    return EXIT_USAGE if len(good) < len(rows) else EXIT_OK


def profile_row(name: str) -> dict[str, Any]:
    """One profile's name, base, device, GPUs and description; its name and error when it does not load."""
    import tomllib

    from launcher_core.errors import LauncherError
    from launcher_core.profile import load_profile, profile_path

    try:
        profile = load_profile(name)
    except LauncherError as error:
        return {"name": name, "error": str(error)}
    with profile_path(name).open("rb") as handle:
        base = tomllib.load(handle).get("extends", "")
    return {"name": name, "extends": base, "device": profile.machine.device, "gpus": profile.machine.gpu_count,
            "description": profile.description}
