"""Scratch venvs for bisect candidates: create, install exact pins with `--no-deps`, check.

uv (`python -m uv`, the launcher venv's copy) is the default installer: its shared cache makes
a rebuilt candidate a matter of links. pip is kept for comparison (`benchmarks/bench_bisect.py`).
The command builders are pure and return (argv, env); `build_candidate` runs them.
A candidate whose pins do not satisfy each other's requirements (`uv pip check`) is
inconsistent: the bisect never blames it; it merges the groups of the packages the check names
and retries (`check_conflicts` reads uv's and pip's wording), or skips it when it cannot.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from envcheck.bisect.reqsets import RequirementSet, requirements_text
from envcheck.packages import normalize
from launcher_core.fileio import write_text_atomic

Command = tuple[list[str], dict[str, str]]
UV_CONFLICT = re.compile(r"The package `(?P<package>[^`]+)` requires `(?P<requirement>[^`]+)`")
PIP_CONFLICT = re.compile(r"^(?P<package>[A-Za-z0-9._-]+) \S+ (?:has requirement|requires) (?P<requirement>[A-Za-z0-9._-]+)",
                          re.MULTILINE)


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
    conflicts: list[str] = field(default_factory=list)    # the check's lines naming a conflict

    @property
    def inconsistent(self) -> bool:
        return not self.ok and self.stage == "check"


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def installer_env() -> dict[str, str]:
    """The environment installer subprocesses run with (no inherited VIRTUAL_ENV)."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.setdefault("UV_NO_PROGRESS", "1")
    return env


def venv_command(options: InstallerOptions, venv_dir: Path) -> Command:
    if options.installer == "uv":
        return [options.tool_python, "-m", "uv", "venv", "--quiet", "--no-project",
                "--python", options.base_python, str(venv_dir)], installer_env()
    return [options.base_python, "-m", "venv", "--without-pip", str(venv_dir)], installer_env()


def install_command(options: InstallerOptions, venv_dir: Path, requirements: Path) -> Command:
    sources = [arg for link in options.find_links for arg in ("--find-links", link)]
    sources += ["--no-index"] if options.no_index else []
    target = str(venv_python(venv_dir))
    if options.installer == "uv":
        argv = [options.tool_python, "-m", "uv", "pip", "install", "--quiet", "--python", target,
                "--no-deps", "-r", str(requirements), *sources]
        argv += ["--offline"] if options.offline else []
        argv += ["--cache-dir", options.cache_dir] if options.cache_dir else []
        return argv, installer_env()
    argv = [options.tool_python, "-m", "pip", "--python", target, "install", "--quiet", "--no-deps",
            "--disable-pip-version-check", "--no-input", "-r", str(requirements), *sources]
    return argv, installer_env()


def check_command(options: InstallerOptions, venv_dir: Path) -> Command:
    target = str(venv_python(venv_dir))
    if options.installer == "uv":
        argv = [options.tool_python, "-m", "uv", "pip", "check", "--python", target]
        argv += ["--offline"] if options.offline else []
        return argv, installer_env()
    return [options.tool_python, "-m", "pip", "--python", target, "check", "--disable-pip-version-check"], installer_env()


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
            result.conflicts = conflict_lines(completed.stdout + completed.stderr) if stage == "check" else []
            return result
    return result


def conflict_lines(output: str) -> list[str]:
    """The lines of `uv pip check` / `pip check` output that name a conflict."""
    return [line.strip() for line in output.splitlines()
            if UV_CONFLICT.search(line) or PIP_CONFLICT.search(line.strip())]


def check_conflicts(output: str) -> list[tuple[str, str]]:
    """(package, required package) pairs, canonical names, from `uv pip check` or `pip check` output."""
    pairs = [(match["package"], re.split(r"[\s\[<>=!~;@(]", match["requirement"].strip(), maxsplit=1)[0])
             for pattern in (UV_CONFLICT, PIP_CONFLICT) for match in pattern.finditer(output)]
    return list(dict.fromkeys((normalize(a), normalize(b)) for a, b in pairs))


def _run(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout_s:.0f} s")


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])
