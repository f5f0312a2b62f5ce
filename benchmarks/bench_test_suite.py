#!/usr/bin/env python3
"""Where the test suite's time goes: per test and per module, CPU-seconds and wall time, sorted.

Runs the README's test command (`bash scripts/setup.sh && .venv/bin/python -m pytest -q tests`, its
pytest-xdist workers as pyproject's addopts set them) with DFLASH_TEST_TIMES set, so that tests/suite_times.py
records each test's wall time and the CPU of its worker's whole process tree (ranks, servers and venv builds it
starts), then prints the tables: the suite's wall and CPU, each module's, and the most expensive tests with the
first sentence of their docstring (what each proves).

    .venv/bin/python benchmarks/bench_test_suite.py [--out FILE.md] [--times FILE.jsonl] [--top 20] [PYTEST ARGS...]
    .venv/bin/python benchmarks/bench_test_suite.py --from FILE.jsonl [--out FILE.md]    (tables of an earlier run; FILE.jsonl.gz too)
    .venv/bin/python benchmarks/bench_test_suite.py --smoke      (two small modules without setup.sh, the tables printed)

Where the two cores were idle for part of the run, the `busy` column (CPU / wall) says so.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
SMOKE_TESTS = ("tests/test_profile.py", "tests/test_manifest.py")


@dataclass
class TestRow:
    nodeid: str
    wall_s: float
    cpu_s: float
    outcome: str
    worker: str = ""
    started: float = 0.0


@dataclass
class ModuleRow:
    module: str
    tests: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    worker: str = ""


@dataclass
class SuiteRun:
    wall_s: float
    cpu_s: float
    exit_code: int
    peak_gib: float
    tests: list[TestRow] = field(default_factory=list)


def read_times(path: Path) -> list[TestRow]:
    """The records, the last of each test id kept (records written before tests/suite_times.py left out the
    pytest runs that a test starts held those runs' tests too, before the suite's own run of them)."""
    rows: dict[str, TestRow] = {}
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            rows[record["nodeid"]] = TestRow(record["nodeid"], float(record["wall_s"]), float(record["cpu_s"]),
                                             record["outcome"], record.get("worker", ""),
                                             float(record.get("started", 0.0)))
        except (ValueError, KeyError) as error:
            raise SystemExit(f"{path}:{number}: not a test-time record ({error})")
    return list(rows.values())


def by_module(rows: list[TestRow]) -> list[ModuleRow]:
    modules: dict[str, ModuleRow] = {}
    for row in rows:
        name = row.nodeid.split("::")[0]
        module = modules.setdefault(name, ModuleRow(name, worker=row.worker))
        module.tests += 1
        module.wall_s += row.wall_s
        module.cpu_s += row.cpu_s
    return sorted(modules.values(), key=lambda module: -module.cpu_s)


def what_it_proves(nodeid: str, root: Path = REPO) -> str:
    """The first sentence of the test function's docstring, else its name in words."""
    path, _, name = nodeid.partition("::")
    name = name.split("[")[0].split("::")[-1]
    try:
        tree = ast.parse((root / path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return name.replace("_", " ")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            doc = ast.get_docstring(node)
            if doc:
                sentence = " ".join(doc.split())
                cut = sentence.find(". ")
                return sentence if cut < 0 else sentence[:cut + 1]
            break
    return name.removeprefix("test_").replace("_", " ")


def machine_busy_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq,
    steal); 0 where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text(encoding="utf-8").splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def machine_used_gib() -> float:
    """The machine's memory in use now (MemTotal - MemAvailable), GiB; 0 where there is no /proc/meminfo."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines())
        return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) / 2**20
    except (OSError, KeyError, ValueError):
        return 0.0


@dataclass
class MemoryPeak:
    """The machine's peak memory in use while a run goes on, sampled every second."""

    peak_gib: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.peak_gib = max(self.peak_gib, machine_used_gib())


def run_suite(times: Path, pytest_args: list[str], setup: bool = True) -> SuiteRun:
    """The README's test command (without scripts/setup.sh where `setup` is False), timed; its children's CPU
    from the kernel's accounting."""
    times.unlink(missing_ok=True)
    env = {**os.environ, "DFLASH_TEST_TIMES": str(times)}
    started, busy, memory = time.perf_counter(), machine_busy_seconds(), MemoryPeak()
    threading.Thread(target=memory.run, name="memory-peak", daemon=True).start()
    code = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env).returncode if setup else 0
    if code == 0:
        code = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "pytest", "-q", *pytest_args],
                              cwd=REPO, env=env).returncode
    memory.stop.set()
    return SuiteRun(time.perf_counter() - started, machine_busy_seconds() - busy, code, memory.peak_gib, read_times(times) if times.exists() else [])


def worker_totals(rows: list[TestRow]) -> dict[str, tuple[float, float, float]]:
    """Each worker's summed wall and CPU, and when its last test ended (seconds after the first test began
    on any worker; 0 where the records carry no start times)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    begun = min((row.started for row in rows if row.started), default=0.0)
    for row in rows:
        totals[row.worker][0] += row.wall_s
        totals[row.worker][1] += row.cpu_s
        if row.started:
            totals[row.worker][2] = max(totals[row.worker][2], row.started + row.wall_s - begun)
    return {worker: (wall, cpu, end) for worker, (wall, cpu, end) in sorted(totals.items())}


def render(rows: list[TestRow], top: int, suite: Optional[SuiteRun]) -> str:
    lines = []
    outcomes: dict[str, int] = defaultdict(int)
    for row in rows:
        outcomes[row.outcome] += 1
    counted = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
    total_cpu, total_wall = sum(row.cpu_s for row in rows), sum(row.wall_s for row in rows)
    if suite is not None:
        lines += [f"The test command: exit {suite.exit_code}, wall **{suite.wall_s:,.0f} s**, "
                  f"CPU {suite.cpu_s:,.0f} s (the machine's busy CPU-seconds meanwhile: idle machine, the run's own; setup "
                  f"included), "
                  f"busy {suite.cpu_s / max(suite.wall_s, 1e-9):.2f} cores on average; the machine's memory in use at most "
                  f"{suite.peak_gib:.1f} GiB.", ""]
    lines += [f"{len(rows)} tests ({counted}); summed over tests: CPU {total_cpu:,.0f} s, wall {total_wall:,.0f} s "
              "(per worker below; its last test's end, counted from the first test's start, shows a worker idle at the "
              "end).", "", "| worker | tests' wall (s) | tests' CPU (s) | last test ended at (s) |", "|---|---|---|---|"]
    lines += [f"| {worker} | {wall:,.0f} | {cpu:,.0f} | {end:,.0f} |" if end else f"| {worker} | {wall:,.0f} | {cpu:,.0f} | - |"
              for worker, (wall, cpu, end) in worker_totals(rows).items()]
    lines += ["", "| module | worker | tests | CPU (s) | wall (s) | share of CPU |", "|---|---|---|---|---|---|"]
    for module in by_module(rows):
        lines.append(f"| {module.module} | {module.worker} | {module.tests} | {module.cpu_s:,.1f} | {module.wall_s:,.1f} | "
                     f"{module.cpu_s / max(total_cpu, 1e-9):.1%} |")
    lines += ["", f"The {top} most expensive tests (CPU of the worker's process tree during the test, its module's "
              "fixtures included where it built them):", "", "| test | CPU (s) | wall (s) | what it proves |",
              "|---|---|---|---|"]
    for row in sorted(rows, key=lambda row: -row.cpu_s)[:top]:
        lines.append(f"| `{row.nodeid}` | {row.cpu_s:,.1f} | {row.wall_s:,.1f} | {what_it_proves(row.nodeid)} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="from_file", type=Path, help="tables of an earlier run's records")
    parser.add_argument("--times", type=Path, help="where the per-test records go (default: a temp file)")
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE_TESTS)}")
    args, pytest_args = parser.parse_known_args(argv)
    suite = None
    if args.from_file is not None:
        times = args.from_file
        rows = read_times(times)
    else:
        times = args.times or Path(tempfile.mkdtemp(prefix="suite-times-")) / "times.jsonl"
        if args.smoke:
            pytest_args = [*SMOKE_TESTS, "-n", "2"]
        suite = run_suite(times, pytest_args or ["tests"], setup=not args.smoke)
        rows = suite.tests
        print(f"per-test records: {times}")
    if not rows:
        print("no test-time records: did the suite run?", file=sys.stderr)
        return 1
    text = render(rows, args.top, suite)
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0 if suite is None or suite.exit_code == 0 else suite.exit_code


if __name__ == "__main__":
    sys.exit(main())
