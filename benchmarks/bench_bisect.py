"""Bisect benchmark: probes used against the number of changed groups, coupled wheelhouses
(families only and skips, against groups learned from the check, against groups read
from metadata), and the wall time of one candidate step (venv + install + consistency check)
with uv and a warm cache against pip.

    .venv/bin/python benchmarks/bench_bisect.py [--sizes 4 8 16 32] [--repeats 5] [--culprits core opt]
        [--modes before check metadata]
    .venv/bin/python benchmarks/bench_bisect.py --smoke     (one coupled bisect: culprit foo, metadata groups;
                                                             one real bisect of 2 groups; one candidate build each)

Everything is local: the wheelhouses are written by `envcheck.bisect.demo`, installs use
`--no-index --find-links`, probes are real `launcher.py probe` runs in each candidate venv.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from envcheck.bisect.bisect_report import build_report  # noqa: E402
from envcheck.bisect.demo import (  # noqa: E402
    COUPLED_CHANGED,
    COUPLED_IMPORTED,
    DemoPackage,
    build_coupled_demo,
    build_demo,
    build_wheel,
    demo_probe,
)
from envcheck.bisect.runner import BisectConfig, run_bisect  # noqa: E402
from envcheck.bisect.search import next_candidate, probe_bound  # noqa: E402
from envcheck.bisect.venvs import InstallerOptions, build_candidate  # noqa: E402
from launcher_core.fileio import write_text_atomic  # noqa: E402

PROBE = f"{{python}} {REPO_ROOT / 'launcher.py'} probe --import memhog"
COUPLED_PROBE = demo_probe(COUPLED_IMPORTED).replace("launcher.py", str(REPO_ROOT / "launcher.py"))
MODES = {"before": dict(use_metadata=False, learn_conflicts=False),     # families only, skip inconsistent
         "check": dict(use_metadata=False, learn_conflicts=True),       # couplings learned from the check
         "metadata": dict(use_metadata=True, learn_conflicts=True)}     # couplings read from Requires-Dist


def pure_search_probes(groups: int) -> tuple[int, float]:
    """(worst, mean) probes over every culprit position, without skips."""
    counts = []
    for culprit in range(1, groups + 1):
        outcomes: dict = {}
        while (k := next_candidate(groups, outcomes)) is not None:
            outcomes[k] = "bad" if k >= culprit else "good"
        counts.append(len(outcomes))
    return max(counts), statistics.mean(counts)


def sized_demo(root: Path, groups: int) -> tuple[Path, Path, Path]:
    """GOOD/BAD with `groups` changed packages, memhog (10 -> 200 MB) at about two thirds."""
    names = [f"pkg{index:02d}" for index in range(groups - 1)]
    names.insert(2 * groups // 3, "memhog")
    wheelhouse = root / "wheelhouse"
    good_lines, bad_lines = [], []
    for name in names:
        old, new = (DemoPackage(name, "1.0", 10), DemoPackage(name, "2.0", 200)) if name == "memhog" else \
            (DemoPackage(name, "1.0"), DemoPackage(name, "1.1"))
        build_wheel(wheelhouse, old)
        build_wheel(wheelhouse, new)
        good_lines.append(f"{name}==1.0\n")
        bad_lines.append(f"{name}=={new.version}\n")
    good = write_text_atomic(root / "good.txt", "".join(good_lines))
    bad = write_text_atomic(root / "bad.txt", "".join(bad_lines))
    return wheelhouse, good, bad


def real_bisect(root: Path, groups: int, cache: Path) -> dict:
    wheelhouse, good, bad = sized_demo(root, groups)
    installer = InstallerOptions(find_links=(str(wheelhouse),), no_index=True, offline=True, cache_dir=str(cache))
    config = BisectConfig(good=good, bad=bad, work_dir=root / "work", log_path=root / "work" / "log.jsonl",
                          probe=PROBE, installer=installer)
    started = time.monotonic()
    report = build_report(*run_bisect(config))
    report["wall_s"] = time.monotonic() - started
    return report


def coupled_bisect(root: Path, culprit: str, mode: str, cache: Path) -> dict:
    demo = build_coupled_demo(root / "demo", culprit)
    installer = InstallerOptions(find_links=(str(demo.wheelhouse),), no_index=True, offline=True, cache_dir=str(cache))
    work = root / mode
    config = BisectConfig(good=demo.good, bad=demo.bad, work_dir=work, log_path=work / "log.jsonl",
                          probe=COUPLED_PROBE, installer=installer, **MODES[mode])
    started = time.monotonic()
    report = build_report(*run_bisect(config))
    report["wall_s"] = time.monotonic() - started
    return report


def true_group(culprit: str) -> set[str]:
    """The culprit's group under the metadata grouping: what a correct answer names."""
    return {"core": {"core", "plug"}, "plug": {"core", "plug"}, "app": {"app", "lib"}, "lib": {"app", "lib"}}.get(
        culprit, {culprit})


def print_coupled(root: Path, culprits: list[str], modes: list[str], cache: Path) -> None:
    print("\ncoupled wheelhouse (10 changes: two-way pins, a chain, a one-way pair, an added and a removed package)")
    print(f"{'culprit':>8} {'mode':>9} {'groups':>7} {'probes':>7} {'bound':>6} {'skipped':>8} {'regrouped':>10} "
          f"{'innocent':>9} {'exact':>6} {'wall s':>7}  answer")
    totals: dict[str, list[int]] = {mode: [0, 0, 0] for mode in modes}
    for culprit in culprits:
        for mode in modes:
            report = coupled_bisect(root / f"{culprit}", culprit, mode, cache)
            named = set(report["culprit"]["packages"])
            innocent = len(named - true_group(culprit))
            totals[mode] = [a + b for a, b in zip(totals[mode], (report["skipped"], innocent, report["probes_used"]))]
            print(f"{culprit:>8} {mode:>9} {len(report['groups']):>7} {report['probes_used']:>7} {report['probe_bound']:>6} "
                  f"{report['skipped']:>8} {report['regrouped']:>10} {innocent:>9} {str(report['culprit']['exact']):>6} "
                  f"{report['wall_s']:>7.1f}  {','.join(report['culprit']['groups'])}")
    for mode, (skipped, innocent, probes) in totals.items():
        print(f"total {mode:>9}: skipped {skipped}, innocent packages named {innocent}, probes {probes}")


def step_times(root: Path, installer: str, repeats: int, cache: Path) -> list[float]:
    """Wall seconds of building the demo's GOOD candidate (8 packages), `repeats` times."""
    from envcheck.bisect.reqsets import load_requirement_set

    demo = build_demo(root / "demo")
    pins = load_requirement_set(demo.good)
    options = InstallerOptions(installer=installer, find_links=(str(demo.wheelhouse),), no_index=True,
                               offline=installer == "uv", cache_dir=str(cache) if installer == "uv" else None)
    times = []
    for attempt in range(repeats + 1):                      # attempt 0 warms the cache
        started = time.monotonic()
        result = build_candidate(options, root / f"venv-{installer}", pins, root / f"{installer}.txt")
        assert result.ok, result.message
        if attempt:
            times.append(time.monotonic() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--culprits", nargs="+", default=list(COUPLED_CHANGED), choices=COUPLED_CHANGED)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="groupings of the coupled bisects")
    parser.add_argument("--skip-uniform", action="store_true", help="only the coupled wheelhouses")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: culprit foo, metadata groups, "
                        "2 groups, one candidate build per installer")
    args = parser.parse_args()
    if args.smoke:
        args.culprits, args.modes, args.sizes, args.repeats = ["foo"], ["metadata"], [2], 1
    with tempfile.TemporaryDirectory(prefix="bench-bisect-") as tmp:
        root = Path(tmp)
        print("probes used vs changed groups (pure search, every culprit position; bound = ceil(log2 n) + 1)")
        print(f"{'groups':>7} {'worst':>6} {'mean':>6} {'bound':>6}")
        for groups in (2, 4, 8, 16, 32, 64, 128):
            worst, mean = pure_search_probes(groups)
            print(f"{groups:>7} {worst:>6} {mean:>6.2f} {probe_bound(groups):>6}")
        print_coupled(root / "coupled", args.culprits, args.modes, root / "uv-cache")
        if args.skip_uniform:
            return 0
        print("\nreal bisects (uv venvs from a local wheelhouse, launcher.py probe in each)")
        print(f"{'groups':>7} {'probes':>7} {'bound':>6} {'culprit':>8} {'delta MiB':>10} {'wall s':>7} {'s/step':>7}")
        for groups in args.sizes:
            report = real_bisect(root / f"n{groups}", groups, root / "uv-cache")
            culprit = report["culprit"]
            steps = len(report["steps"])
            print(f"{groups:>7} {report['probes_used']:>7} {report['probe_bound']:>6} {','.join(culprit['groups']):>8} "
                  f"{culprit['memory_delta_mib']:>10.1f} {report['wall_s']:>7.1f} {report['wall_s'] / steps:>7.2f}")
        print(f"\ncandidate build (venv + install 8 wheels --no-deps + check), median of {args.repeats}, warm cache")
        for installer in ("uv", "pip"):
            times = step_times(root / installer, installer, args.repeats, root / "uv-cache-steps")
            print(f"{installer:>4}: median {statistics.median(times):.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
