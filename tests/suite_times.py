"""Per-test wall time and CPU-seconds of the whole process tree, for benchmarks/bench_test_suite.py.

Loaded by tests/conftest.py; it records only where DFLASH_TEST_TIMES names a file (each pytest-xdist worker
appends its lines, one JSON object a test). CPU is user + system of this process, of its live descendants and of
every descendant already reaped (a server a module fixture started is counted by the test during which it ran
or was stopped), so the figure includes the ranks, servers and venv builds a test starts.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

import psutil
import pytest

TIMES_ENV = "DFLASH_TEST_TIMES"


@dataclass
class TestTime:
    nodeid: str
    worker: str
    wall_s: float
    cpu_s: float
    outcome: str


def tree_cpu_seconds() -> float:
    """User + system CPU of this process and its live descendants, their reaped children included."""
    total = 0.0
    me = psutil.Process()
    for process in (me, *me.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.Error:                # ended between the listing and the read: its reaper counts it
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def times_file() -> Optional[str]:
    return os.environ.get(TIMES_ENV) or None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    path = times_file()
    if path is None:
        yield
        return
    wall, cpu = time.perf_counter(), tree_cpu_seconds()
    yield
    reports = getattr(item, "_dflash_outcomes", [])
    outcome = "failed" if "failed" in reports else "skipped" if "skipped" in reports else "passed"
    record = TestTime(item.nodeid, os.environ.get("PYTEST_XDIST_WORKER", "main"),
                      round(time.perf_counter() - wall, 3), round(tree_cpu_seconds() - cpu, 3), outcome)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(asdict(record)) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if times_file() is not None:
        item.__dict__.setdefault("_dflash_outcomes", []).append(report.outcome)
