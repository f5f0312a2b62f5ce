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


def load_installer():
    """scripts/install_requirements.py, setup.sh's installer, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("install_requirements", SETUP.parent / "install_requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pin_with_a_wheel_of_its_version_in_find_links_is_installed_from_that_file(tmp_path):
    import sys

    installer = load_installer()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheel = tmp_path / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    lines = ["torch==2.13.0", "numpy==2.4.6", "torch-other==2.13.0", "torch[opt]==2.13.0"]
    assert installer.with_local_wheels(lines, [str(tmp_path)]) == [str(wheel), "numpy==2.4.6", "torch-other==2.13.0",
                                                                   "torch[opt]==2.13.0"]      # extras stay a pin
    # another version, or no find-links, leaves the pin to the index
    assert installer.with_local_wheels(["torch==2.12.0"], [str(tmp_path)]) == ["torch==2.12.0"]
    assert installer.with_local_wheels(["torch==2.13.0"], []) == ["torch==2.13.0"]


def test_the_installer_falls_back_to_pip_where_the_requirements_pin_no_uv(tmp_path):
    from envcheck.packages import read_pins, requirement_lines

    installer = load_installer()
    assert "uv" in read_pins(SETUP.parents[1] / "requirements-cpu.txt")       # what setup.sh installs uv from
    no_uv = tmp_path / "requirements.txt"
    no_uv.write_text("uvicorn==0.54.0\nnumpy==2.4.6  # a comment\n\n", encoding="utf-8")
    assert requirement_lines(no_uv) == ["uvicorn==0.54.0", "numpy==2.4.6"]
    why_not = installer.install_with_uv("/nonexistent/python", no_uv, no_uv)
    assert why_not == "requirements.txt pins no uv"
    commands = installer.pip_commands("/venv/bin/python", no_uv, no_uv)
    assert [command[:4] for command in commands] == [["/venv/bin/python", "-m", "pip", "install"]] * 3
    assert commands[-1][-3:] == ["--no-deps", "-r", str(no_uv)]
