"""`launcher.py audit`: preflight audit of this machine, or of a saved snapshot (another node).

Exit codes: 0 nothing failed, 1 any FAIL, 3 a WARN under --strict, 2 bad input.
"""
from __future__ import annotations

import argparse

DEFAULT_PROFILE = "cpu-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=DEFAULT_PROFILE, metavar="P",
                        help=f"profile name or TOML path (default: {DEFAULT_PROFILE}, the embedded CPU default)")
    parser.add_argument("--snapshot", metavar="FILE", help="audit a saved snapshot instead of this machine")
    parser.add_argument("--baseline", metavar="FILE", help="compare against this snapshot instead of the profile's saved baseline")
    parser.add_argument("--cuda-probe", action="store_true", help="also measure context cost and launch a kernel per GPU (child processes)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--strict", action="store_true", help="exit 3 when a WARN is found (and no FAIL)")


def run(args: argparse.Namespace) -> int:
    import json

    from envcheck import findings_format, preflight
    from envcheck.snapshot import load_snapshot
    from launcher_core.profile import load_profile

    profile = load_profile(args.profile)
    snapshot = load_snapshot(args.snapshot) if args.snapshot else preflight.live_snapshot(profile, args.cuda_probe)
    baseline = load_snapshot(args.baseline) if args.baseline else None
    findings = preflight.audit(profile, snapshot, baseline)
    source = args.snapshot or f"this machine ({snapshot.hostname})"
    if args.json:
        document = findings_format.findings_document(findings, profile=profile.name, source=source)
        print(json.dumps(preflight.scrub_document(document), indent=2))
    else:
        print(preflight.scrub(findings_format.format_table(findings, title=f"audit of {source} against profile {profile.name}")))
    return findings_format.exit_code(findings, strict=args.strict)
