"""`launcher.py snapshot -o FILE`: save this machine's facts as a versioned JSON snapshot."""
from __future__ import annotations

import argparse

from envcheck.commands.audit import DEFAULT_PROFILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE", help="write the snapshot here (default: print it)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, metavar="P",
                        help="profile whose output paths get a free-disk figure (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace an existing snapshot file at -o")
    parser.add_argument("--cuda-probe", action="store_true", help="measure context cost and launch a kernel per GPU (child processes)")


def run(args: argparse.Namespace) -> int:
    import json

    from envcheck import preflight
    from envcheck.snapshot import save_snapshot
    from launcher_core.outputs import SNAPSHOT, prepare_output
    from launcher_core.profile import load_profile

    if args.output:  # checked before the snapshot is collected (seconds with --cuda-probe)
        prepare_output(args.output, SNAPSHOT, force=args.force, flag="-o")
    snapshot = preflight.live_snapshot(load_profile(args.profile), cuda_probe=args.cuda_probe)
    if args.output:
        path = save_snapshot(snapshot, args.output)
        print(f"snapshot of {snapshot.hostname}: {len(snapshot.gpus)} GPU(s), {len(snapshot.packages)} packages -> {path}")
    else:
        print(json.dumps(preflight.scrub_document(snapshot.to_dict()), indent=2, sort_keys=True))
    return 0
