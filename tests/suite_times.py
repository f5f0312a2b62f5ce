"""Per-test wall time and CPU-seconds of the whole process tree, for benchmarks/bench_test_suite.py.

Loaded by tests/conftest.py; it records only where DFLASH_TEST_TIMES names a file (each pytest-xdist worker
appends its lines, one JSON object a test). CPU is user + system of the worker and of every process below it,
sampled twice a second while the test runs and once at its start and end (`TreeSampler`): a process is counted
from its first sample to its last, so the ranks a torchrun agent forks (whose forkserver is not waited for by
anyone who reports their time) are in it, and a process that lived less than half a second between samples is
not. A server a module fixture started is counted in the tests during which it ran.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

import psutil
import pytest

TIMES_ENV = "DFLASH_TEST_TIMES"
SAMPLE_EVERY_S = 0.5


@dataclass
class TestTime:
    nodeid: str
    worker: str
    wall_s: float
    cpu_s: float
    outcome: str
    started: float          # seconds since the epoch: when the test began (the workers' timeline)


@dataclass
class TreeSampler:
    """The CPU each process of this process's tree used since the sampler started (its first sample)."""

    first: dict[tuple[int, float], float] = field(default_factory=dict)
    last: dict[tuple[int, float], float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        me = psutil.Process()
        try:
            tree = [me, *me.children(recursive=True)]
        except psutil.Error:
            return
        for process in tree:
            try:
                key, times = (process.pid, process.create_time()), process.cpu_times()
            except psutil.Error:            # ended between the listing and the read
                continue
            with self.lock:
                self.first.setdefault(key, times.user + times.system)
                self.last[key] = times.user + times.system

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            self.sample()

    def total(self) -> float:
        with self.lock:
            return sum(self.last[key] - self.first[key] for key in self.last)


def times_file(config: pytest.Config) -> Optional[str]:
    """Where this run records, if it is the measured run: not a pytest that a test starts (the compatibility
    venvs' runs inherit the variable, and PYTEST_XDIST_WORKER, from the worker that starts them)."""
    inner = "PYTEST_XDIST_WORKER" in os.environ and not hasattr(config, "workerinput")
    return None if inner else os.environ.get(TIMES_ENV) or None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    path = times_file(item.config)
    if path is None:
        yield
        return
    sampler, wall, started = TreeSampler(), time.perf_counter(), time.time()
    sampler.sample()
    thread = threading.Thread(target=sampler.run, name="suite-times", daemon=True)
    thread.start()
    yield
    sampler.stop.set()
    thread.join()
    sampler.sample()
    reports = getattr(item, "_dflash_outcomes", [])
    outcome = "failed" if "failed" in reports else "skipped" if "skipped" in reports else "passed"
    record = TestTime(item.nodeid, os.environ.get("PYTEST_XDIST_WORKER", "main"),
                      round(time.perf_counter() - wall, 3), round(sampler.total(), 3), outcome,
                      round(started, 3))
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(asdict(record)) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if times_file(item.config) is not None:
        item.__dict__.setdefault("_dflash_outcomes", []).append(report.outcome)
