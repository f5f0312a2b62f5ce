"""Scratch venvs for bisect candidates: create, install exact pins with `--no-deps`, check.

uv (`python -m uv`, the launcher venv's copy) is the default installer: its shared cache makes
a rebuilt candidate a matter of links. pip is kept for comparison (`benchmarks/bench_bisect.py`).
The command builders are pure and return (argv, env); `build_candidate` runs them.
A candidate whose pins do not satisfy each other's requirements (`uv pip check`) is
inconsistent: the bisect skips it, never blames it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from envcheck.bisect.reqsets import RequirementSet, requirements_text
from core.fileio import write_text_atomic

Command = tuple[list[str], dict[str, str]]


@dataclass(frozen=True)
class InstallerOptions:
    installer: Literal["uv", "pip"] = "uv"
    base_python: str = sys.executable          # the interpreter candidate venvs are made from
    tool_python: str = sys.executable          # the python that runs `-m uv` / `-m pip`
    find_links: tuple[str, ...] = ()
    no_index: bool = False
    offline: bool = False
    cache_dir: Optional[str] = None            # None: the installer's shared default cache
    timeout_s: float = 1800.0


@dataclass
class BuildResult:
    """How building one candidate went: `ok` (installed and consistent) or why not."""

    ok: bool
    stage: str = ""                            # "venv", "install" or "check" when not ok
    message: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def inconsistent(self) -> bool:
        return not self.ok and self.stage == "check"


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.setdefault("UV_NO_PROGRESS", "1")
    return env


def venv_command(options: InstallerOptions, venv_dir: Path) -> Command:
    if options.installer == "uv":
        return [options.tool_python, "-m", "uv", "venv", "--quiet", "--no-project",
                "--python", options.base_python, str(venv_dir)], _env()
    return [options.base_python, "-m", "venv", "--without-pip", str(venv_dir)], _env()


def install_command(options: InstallerOptions, venv_dir: Path, requirements: Path) -> Command:
    sources = [arg for link in options.find_links for arg in ("--find-links", link)]
    sources += ["--no-index"] if options.no_index else []
    target = str(venv_python(venv_dir))
    if options.installer == "uv":
        argv = [options.tool_python, "-m", "uv", "pip", "install", "--quiet", "--python", target,
                "--no-deps", "-r", str(requirements), *sources]
        argv += ["--offline"] if options.offline else []
        argv += ["--cache-dir", options.cache_dir] if options.cache_dir else []
        return argv, _env()
    argv = [options.tool_python, "-m", "pip", "--python", target, "install", "--quiet", "--no-deps",
            "--disable-pip-version-check", "--no-input", "-r", str(requirements), *sources]
    return argv, _env()


def check_command(options: InstallerOptions, venv_dir: Path) -> Command:
    target = str(venv_python(venv_dir))
    if options.installer == "uv":
        argv = [options.tool_python, "-m", "uv", "pip", "check", "--python", target]
        argv += ["--offline"] if options.offline else []
        return argv, _env()
    return [options.tool_python, "-m", "pip", "--python", target, "check", "--disable-pip-version-check"], _env()


def build_candidate(options: InstallerOptions, venv_dir: Path, pins: RequirementSet,
                    requirements: Path) -> BuildResult:
    """A fresh venv at `venv_dir` holding exactly `pins` (written to `requirements`), checked."""
    shutil.rmtree(venv_dir, ignore_errors=True)
    write_text_atomic(requirements, requirements_text(pins))
    result = BuildResult(ok=True)
    steps = (("venv", venv_command(options, venv_dir)),
             ("install", install_command(options, venv_dir, requirements)),
             ("check", check_command(options, venv_dir)))
    for stage, (argv, env) in steps:
        started = time.monotonic()
        completed = _run(argv, env, options.timeout_s)
        result.seconds[stage] = round(time.monotonic() - started, 3)
        if completed.returncode != 0:
            result.ok, result.stage = False, stage
            result.message = _tail(completed.stdout + completed.stderr)
            return result
    return result


def _run(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout_s:.0f} s")


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])
