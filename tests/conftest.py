"""Shared fixtures: the real Qwen3 tokenizer, a tiny random Qwen3 target, the SmolLM2 target.

Nothing is downloaded: HF_HUB_OFFLINE is set before transformers is imported anywhere.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

# Per-test wall and CPU-seconds where DFLASH_TEST_TIMES names a file (benchmarks/bench_test_suite.py).
pytest_plugins = ("suite_times",)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per process unless the caller says otherwise (set before torch is imported in any
# worker; ranks, servers and scripts started by tests inherit it where nothing sets their own). The suite
# runs 3 pytest-xdist workers on 2 cores, and each of them starts ranks and servers: with torch's default
# (a thread per core) every process's threads spin at each barrier while the others hold the cores.
# Measured: two 10-step drafter trainings side by side take 60 s and 58 CPU-s each with 2 threads, 24 s
# and 24 CPU-s with 1 (alone: 19 s and 28 CPU-s with 2). benchmarks/results/test-suite-cpu_cpu-2core_2026-12-05.md.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    from dflash.target_model import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir, local_files_only=True)


@pytest.fixture(scope="session")
def tiny_qwen3_target(tmp_path_factory, qwen3_tokenizer_dir) -> Path:
    """A random-weight Qwen3 (hidden 64, 4 layers) with the real Qwen3 tokenizer, on disk."""
    from dflash.target_model import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("targets") / "tiny-qwen3", qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors (converted once from the shipped GGUF)."""
    from dflash.target_model import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def flagship_twin_target() -> Path:
    """A random-weight model of the flagship's architecture (Qwen3.5/3.6: Gated DeltaNet + gated
    attention every 4th layer, partial rotary, M-RoPE, vision tower, MTP weights, 248,320 rows)
    with the real Qwen3 tokenizer, on disk: `builtin:flagship-twin`, built once into the cache under
    its lock (`dflash.target_model.flagship_twin_dir`), as the flagship-twin profile's runs read it, not
    once per xdist worker (7 CPU s and 135 MB each). No test writes into it."""
    from dflash.target_model import flagship_twin_dir

    return flagship_twin_dir()


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """A per-test DFLASH_CACHE (crash reports, baselines), not the user's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_CACHE", str(cache))
    return cache


@pytest.fixture
def cli(capsys) -> Callable[..., CliResult]:
    """`launcher.main(argv)` in this process: its exit code, stdout and stderr."""
    import launcher

    def run(*argv: object) -> CliResult:
        capsys.readouterr()
        code = launcher.main([str(arg) for arg in argv])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM engine's python (`launcher.py engine setup vllm`), built here if it can be (a venv built
    before the setup wrote its bytecode gets it, once); the test is skipped, with the reason, only where
    the venv cannot be built (no local CPU torch wheel, no index)."""
    from dflash.generate.engine_env import setup_engine_env
    from launcher_core.errors import LauncherError

    try:
        return setup_engine_env("vllm").python
    except LauncherError as error:
        pytest.skip(f"the vLLM engine venv cannot be built here: {error}")


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that built a training state in this process (FSDP2 needs a process group, so one of a
    single rank is made: dflash.train.rank.parallel.single_process_group) leaves none behind for the next
    (the memory trace makes its own fake one)."""
    yield
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()



# Queued first under pytest-xdist: the real engines' modules (minutes of shared fixtures each), then the
# compatibility venvs (other transformers, other torch), then the modules that start servers or ranks, then the rest.
QUEUE_BY_MARKER = ("engine", "compat", "slow")
# Within a kind, these go first, longest first (CPU seconds of a whole run:
# benchmarks/results/test-suite-cpu_cpu-2core_2026-12-05.md), so that the run does not end on one worker running one of
# them while the others have finished:
# in collection order the torchrun module (286 CPU s, 3.5 minutes on its worker) started last and ran its
# last 90 s alone. The torch compatibility lane, where it runs in the suite (DFLASH_TORCH_COMPAT=1; `.ci/run` runs
# it apart, tests/compat/torch_lane.py), is 5-7.5 minutes on its worker.
LONGEST_FIRST = ("tests/compat/test_torch_compat.py", "tests/train/test_torchrun.py", "tests/benchmarks/test_benchmarks.py",
                 "tests/measure/test_trace.py", "tests/pipeline/test_flagship_twin.py", "tests/safety/test_safety_run.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The README's test command runs pytest-xdist workers (pyproject's addopts: `-n 3 --dist loadfile`,
    a module's tests on one worker, in order, so its module fixtures are built once), and hands the
    modules out in this order: the longest kind first (engine, compat, slow, the rest), in each kind
    LONGEST_FIRST's modules first, then collection order. A module keeps its own test order and stays
    whole (the order of a run without workers too)."""
    module_rank: dict[str, int] = {}
    for item in items:
        _mark_long_kinds_slow(item)
        module = item.nodeid.split("::")[0]
        module_rank[module] = min(module_rank.get(module, len(QUEUE_BY_MARKER)), _queue_rank(item))
    items.sort(key=lambda item: _module_order(item.nodeid.split("::")[0], module_rank))     # stable


def _mark_long_kinds_slow(item: pytest.Item) -> None:
    """The engine and compat kinds take minutes: they are `slow` too, so that the development lane,
    `pytest -m "not slow"`, leaves out every kind that starts a server, a rank or a venv."""
    if item.get_closest_marker("slow") is None and any(item.get_closest_marker(m) for m in ("engine", "compat")):
        item.add_marker(pytest.mark.slow)


def _module_order(module: str, module_rank: dict[str, int]) -> tuple[int, int]:
    longest = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
    return module_rank[module], longest


def _queue_rank(item: pytest.Item) -> int:
    for rank, marker in enumerate(QUEUE_BY_MARKER):
        if item.get_closest_marker(marker) is not None:
            return rank
    return len(QUEUE_BY_MARKER)
