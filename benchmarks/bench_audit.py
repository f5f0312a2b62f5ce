"""`launcher.py audit` vs `python -m torch.utils.collect_env`, side by side on this machine.

Both run as fresh processes, alternating, after one warm-up each (the audit's torch facts are
cached after its first run, keyed by the installed torch). Prints the median wall times and
their ratio; the target is audit <= 0.5x collect_env.

    .venv/bin/python benchmarks/bench_audit.py [--repeat 7] [--profile cpu-demo]
    .venv/bin/python benchmarks/bench_audit.py --smoke     (one run each, no warm-up; the target not judged)
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.5
RAN = (0, 1)        # exit codes of a command that ran to its end (the audit's 1: it found a FAIL)


def wall_time(argv: list[str]) -> float:
    start = time.perf_counter()
    code = subprocess.run(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
    if code not in RAN:
        raise SystemExit(f"{' '.join(argv[1:])} exited {code}: it did not run to its end")
    return time.perf_counter() - start


def commands(profile: str) -> dict[str, list[str]]:
    return {"audit": [sys.executable, str(REPO_ROOT / "launcher.py"), "audit", "--profile", profile],
            "collect_env": [sys.executable, "-m", "torch.utils.collect_env"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--profile", default="cpu-demo")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: one run each, no warm-up")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 1
    argvs = commands(args.profile)
    for argv in argvs.values() if not args.smoke else ():
        wall_time(argv)                                   # warm-up (page cache, torch-facts cache)
    times: dict[str, list[float]] = {name: [] for name in argvs}
    for _ in range(args.repeat):
        for name, argv in argvs.items():
            times[name].append(wall_time(argv))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["audit"] / medians["collect_env"]
    for name, values in times.items():
        print(f"{name:<12} median {medians[name]:.3f} s  (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})")
    print(f"ratio audit/collect_env = {ratio:.3f} (target <= {TARGET_RATIO}) -> {'OK' if ratio <= TARGET_RATIO else 'MISSED'}")
    return 0 if ratio <= TARGET_RATIO or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
