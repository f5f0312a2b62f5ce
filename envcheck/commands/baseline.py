"""`launcher.py baseline save --profile P` / `baseline diff [A] [B]`.

`save` stores this machine's snapshot as the profile's baseline for this host; later audits
compare against it. `diff` shows what changed between two snapshots: with one file, between it
and this machine now; with none, between the profile's baseline and this machine now.
"""
from __future__ import annotations

import argparse

from envcheck.commands.audit import DEFAULT_PROFILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    save = actions.add_parser("save", help="store this machine's snapshot as the profile's baseline")
    save.add_argument("--profile", required=True, metavar="P")
    save.add_argument("--cuda-probe", action="store_true", help="include context cost per GPU (recommended on GPU nodes)")
    save.add_argument("--from", dest="source", metavar="FILE", help="store this saved snapshot instead of a live one")
    diff = actions.add_parser("diff", help="what changed between two snapshots")
    diff.add_argument("old", nargs="?", metavar="A", help="older snapshot (default: the profile's baseline)")
    diff.add_argument("new", nargs="?", metavar="B", help="newer snapshot (default: this machine now)")
    diff.add_argument("--profile", default=DEFAULT_PROFILE, metavar="P")
    diff.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    return _save(args) if args.action == "save" else _diff(args)


def _save(args: argparse.Namespace) -> int:
    from envcheck import preflight
    from envcheck.baseline import save_baseline
    from envcheck.snapshot import load_snapshot
    from launcher_core.profile import load_profile

    profile = load_profile(args.profile)
    snapshot = load_snapshot(args.source) if args.source else preflight.live_snapshot(profile, args.cuda_probe)
    kept = _keep_calibration(snapshot, profile.name)
    path = save_baseline(snapshot, profile.name)
    print(f"baseline of profile {profile.name} for host {snapshot.hostname} -> {path}")
    if kept:
        print(f"kept the memory calibration of the previous baseline (measured {kept}; "
              f"re-run `launcher.py calibrate --profile {profile.name}` after a torch or driver change)")
    return 0


def _keep_calibration(snapshot, profile_name: str) -> str:
    """A new baseline keeps the old one's `memory_calibration` (a measurement of the workload, not of
    the machine's free memory). Returns when it was measured ('' when nothing was kept)."""
    from envcheck.baseline import load_baseline

    previous = load_baseline(profile_name, snapshot.hostname or None)
    if snapshot.memory_calibration is not None or previous is None or previous.memory_calibration is None:
        return ""
    snapshot.memory_calibration = previous.memory_calibration
    return str(previous.memory_calibration.get("measured_at") or "at an unknown time")


def _diff(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from envcheck.baseline import diff_snapshots
    from launcher_core.errors import InputError

    old, new = _diff_operands(args)
    if old is None:
        raise InputError(f"no baseline saved for profile {args.profile} on this host; run `launcher.py baseline save --profile {args.profile}` or name two snapshot files")
    changes = diff_snapshots(old, new)
    if args.json:
        print(json.dumps([asdict(c) for c in changes], indent=2))
    else:
        print("\n".join(str(c) for c in changes) if changes else "no changes")
    return 0


def _diff_operands(args: argparse.Namespace):
    from envcheck import preflight
    from envcheck.baseline import load_baseline
    from envcheck.snapshot import load_snapshot
    from launcher_core.profile import load_profile

    if args.old and args.new:
        return load_snapshot(args.old), load_snapshot(args.new)
    profile = load_profile(args.profile)
    live = preflight.live_snapshot(profile)
    old = load_snapshot(args.old) if args.old else load_baseline(profile.name, live.hostname)
    return old, live
