"""A scratch venv with the reference drafter code (PyPI `dflash`, z-lab) and the transformers it
pins, cached under the project cache keyed by the pins. Built with `python -m uv venv --seed`;
torch with pip (a pinned CPU build), transformers and safetensors, then `dflash` without its
dependencies (its model code needs only torch and transformers; the rest serves its benchmark).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REFERENCE_PINS = ("dflash==0.1.0", "transformers==5.15.0", "torch==2.13.0", "safetensors")


def reference_python() -> Path:
    """The venv's python, built on first use; pytest.skip when the package index is unreachable."""
    from launcher_core.paths import cache_dir

    key = "-".join(pin.replace("==", "-") for pin in REFERENCE_PINS)
    root = cache_dir() / "reference-venvs" / key
    python = root / "bin" / "python"
    if (root / ".complete").exists():
        return python
    _require_index()
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    steps = [[sys.executable, "-m", "uv", "venv", "--seed", "-q", "--python", sys.executable, str(root)],
             [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *REFERENCE_PINS[1:]],
             [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", REFERENCE_PINS[0]]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"building the reference venv failed at {' '.join(step)}:\n{done.stderr[-3000:]}")
    (root / ".complete").write_text("\n".join(REFERENCE_PINS) + "\n")
    return python


def _require_index() -> None:
    """Skip (with pip's reason) when the package index cannot be reached."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                                "-d", scratch, REFERENCE_PINS[0]], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"the package index is unreachable, cannot build the reference venv ({REFERENCE_PINS[0]}): {reason}")
