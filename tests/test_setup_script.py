"""scripts/setup.sh's choice of interpreter for a new .venv (`choose_python`), run by bash itself."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
BASH = shutil.which("bash") or "/bin/bash"


def choose_python(env: dict[str, str], distribution: str = "/usr/bin/python3.11") -> str:
    """What setup.sh's choose_python prints under `env` with the distribution's interpreter at
    `distribution` (the function alone, nothing installed)."""
    function = re.search(r"^choose_python\(\) \{\n.*?^\}\n", SETUP.read_text(encoding="utf-8"), re.S | re.M)
    assert function is not None, "scripts/setup.sh defines no choose_python"
    done = subprocess.run([BASH, "-c", f"distribution_python={distribution}\n{function.group(0)}\nchoose_python"], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def without_python() -> dict[str, str]:
    """This environment without PYTHON (setup.sh's override)."""
    return {key: value for key, value in os.environ.items() if key != "PYTHON"}


def test_python_from_the_environment_wins():
    assert choose_python({**os.environ, "PYTHON": "/opt/my/python3.11"}) == "/opt/my/python3.11"


def test_the_distributions_python_is_preferred_where_it_makes_venvs():
    env = without_python()
    distribution = Path("/usr/bin/python3.11")
    has_venv = distribution.exists() and subprocess.run(
        [str(distribution), "-c", "import ensurepip, venv"], capture_output=True).returncode == 0
    if not has_venv:
        pytest.skip("no /usr/bin/python3.11 with venv here")
    assert choose_python(env) == str(distribution)


def test_without_the_distributions_python_it_takes_python3_11_on_path_then_python3(tmp_path):
    env = without_python()
    assert choose_python({**env, "PATH": str(tmp_path)}, distribution=str(tmp_path / "absent")) == "python3"
    (tmp_path / "python3.11").write_text("#!/bin/sh\n")
    (tmp_path / "python3.11").chmod(0o755)
    assert choose_python({**env, "PATH": str(tmp_path)}, distribution=str(tmp_path / "absent")) == "python3.11"
    # a distribution python without venv (Debian without python3.11-venv) is passed over
    (tmp_path / "novenv").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "novenv").chmod(0o755)
    assert choose_python({**env, "PATH": str(tmp_path)}, distribution=str(tmp_path / "novenv")) == "python3.11"
