#!/usr/bin/env python3
"""setup.sh's installer: the project's requirements into the venv that runs this file.

    .venv/bin/python scripts/install_requirements.py REQUIREMENTS NO_DEPS_REQUIREMENTS

uv (pinned in REQUIREMENTS, installed first with pip) resolves and installs the pins from its cache;
pip took 21 s of a fresh setup on 2 cores where uv takes 3-7 s (benchmarks/results/setup-uv_cpu-2core_2026-12-06.md).
uv reads none of pip's configuration, so a pin with a wheel of that version in pip's find-links (the
CPU torch build kept on disk) is installed from that file, the wheel pip itself takes. The packages'
bytecode is left to setup.sh's compile on every core. Where uv cannot do the install (no uv wheel,
an index only pip's configuration names), pip installs the same files, as setup.sh did before uv,
after saying why. Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from envcheck.bisect.venvs import installer_env  # noqa: E402  (standard library only)
from envcheck.packages import read_pins, requirement_lines  # noqa: E402
from envcheck.wheels import local_wheel, pip_find_links  # noqa: E402

# A plain `name==version` pin: one with extras (`transformers[serving]==...`) stays a pin, since a wheel's
# path would drop the extras.
PLAIN_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\[]+)$")
PIP_QUIET = ["--quiet", "--disable-pip-version-check"]


def with_local_wheels(lines: Sequence[str], links: Sequence[str]) -> list[str]:
    """Each `name==version` pin with a wheel of that version in `links` replaced by that wheel's path."""
    resolved = []
    for line in lines:
        pin = PLAIN_PIN.match(line)
        wheel = local_wheel(pin.group(1), pin.group(2), list(links)) if pin else None
        resolved.append(str(wheel) if wheel is not None else line)
    return resolved


def uv_commands(python: str, lines: Sequence[str], no_deps_lines: Sequence[str]) -> list[list[str]]:
    """The uv installs: pip itself brought up to date beside the pins, then the no-deps pins."""
    uv = [python, "-m", "uv", "pip", "install", "--quiet", "--python", python]
    commands = [[*uv, "--upgrade-package", "pip", "pip", *lines]]
    if no_deps_lines:
        commands.append([*uv, "--no-deps", *no_deps_lines])
    return commands


def pip_commands(python: str, requirements: Path, no_deps: Path) -> list[list[str]]:
    """The pip installs (pip reads its own configuration, find-links included)."""
    pip = [python, "-m", "pip", "install", *PIP_QUIET]
    return [[*pip, "--upgrade", "pip"], [*pip, "--no-compile", "-r", str(requirements)],
            [*pip, "--no-compile", "--no-deps", "-r", str(no_deps)]]


def run_all(commands: Sequence[Sequence[str]]) -> int:
    """Run the commands in order; the exit code of the first that fails, else 0."""
    for argv in commands:
        env = {**installer_env(), "UV_PYTHON_DOWNLOADS": "never"}      # the bisect's, and no Python downloads
        code = subprocess.run(list(argv), env=env, check=False).returncode
        if code != 0:
            return code
    return 0


def install_with_uv(python: str, requirements: Path, no_deps: Path) -> Optional[str]:
    """Install with uv; None when done, else why uv could not."""
    uv_version = read_pins(requirements).get("uv")
    if uv_version is None:
        return f"{requirements.name} pins no uv"
    pin = f"uv=={uv_version}"
    if run_all([[python, "-m", "pip", "install", *PIP_QUIET, "--no-compile", pin]]) != 0:
        return f"pip could not install {pin}"
    links = pip_find_links()
    code = run_all(uv_commands(python, with_local_wheels(requirement_lines(requirements), links),
                               with_local_wheels(requirement_lines(no_deps), links)))
    return None if code == 0 else f"uv pip install exited with code {code} (its output is above)"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: install_requirements.py REQUIREMENTS NO_DEPS_REQUIREMENTS", file=sys.stderr)
        return 2
    requirements, no_deps = (Path(name) for name in argv)
    for path in (requirements, no_deps):
        if not path.is_file():
            print(f"setup: {path} not found", file=sys.stderr)
            return 2
    why_not = install_with_uv(sys.executable, requirements, no_deps)
    if why_not is None:
        return 0
    print(f"setup: {why_not}; installing with pip instead", file=sys.stderr)
    return run_all(pip_commands(sys.executable, requirements, no_deps))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
