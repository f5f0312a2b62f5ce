"""SGLang's own venv (`launcher.py engine setup sglang`) as far as a machine without a GPU goes.

Real here: the steps the setup runs for SGLang (their argv, built by the code the command runs); the
snapshot's record of built engine venvs, read by the real collection from venv folders laid out as
the setup leaves them (a stamp and dist-info folders: stand-ins for the 8.7 GB of packages); the audit's
engine.sglang check on those records; and, with the package index reachable (marked `engine`), uv
resolving `requirements-engine-sglang-cu130.txt` to exactly its pins, and finding a wheel of every
package for Linux x86_64 and the Pythons the project runs on.

Not here: a whole build. It downloads about 6.5 GB, from two indexes besides PyPI (cuda-tile from
pypi.nvidia.com, FlashInfer's kernel wheels from flashinfer.ai); run it with DFLASH_TEST_SGLANG_SETUP=1
(test_the_real_setup_builds_a_venv_that_imports_sglang). Serving from it needs a GPU:
tests/gpu/test_engine_eval_gpu.py.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envcheck.checks import CheckInput, check_sglang_serves_the_drafter
from envcheck.engine_venvs import ENGINE_SPECS, STAMP, collect, engine_env_dir
from envcheck.snapshot import EngineVenvFacts, load_snapshot
from launcher_core.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
SPEC = ENGINE_SPECS["sglang"]


def test_setup_installs_the_index_wheels_first_then_the_pinned_file_then_imports_the_server(tmp_path):
    from dflash.generate.engine_env import build_steps
    from envcheck.engine_venvs import install_lines

    steps = build_steps(SPEC, tmp_path / "venv", install_lines(SPEC))
    installs = [argv for _, argv in steps if argv[3:5] == ["pip", "install"]]
    assert [argv[argv.index("--index-url") + 1:] for argv in installs[:3]] == [
        ["https://pypi.nvidia.com", "cuda-tile==1.6.0rc5"], ["https://flashinfer.ai/whl", "flashinfer-cubin==0.6.18"],
        ["https://flashinfer.ai/whl/cu130", "flashinfer-jit-cache==0.6.18+cu130"]]
    assert all("--no-deps" in argv for argv in installs[:3])
    pins = install_lines(SPEC)
    assert installs[3][-len(pins):] == pins and "sglang==0.5.19" in pins and len(pins) > 200   # the file, every pin
    assert [what.split(" ")[0] for what, _ in steps] == ["creating", "installing", "installing", "installing",
                                                         "installing", "checking"]      # nothing removed after
    assert steps[-1][1][-2:] == ["sglang.launch_server", "sglang"]   # the server's module, sglang compiled first


def venv_as_built(folder: Path, packages: dict[str, str]) -> Path:
    """A venv folder as the setup leaves it: python, dist-info folders, its stamp (written last)."""
    site = folder / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    (folder / "bin").mkdir()
    (folder / "bin" / "python").write_text("")
    for name, version in packages.items():
        (site / f"{name.replace('-', '_')}-{version}.dist-info").mkdir()
    (folder / STAMP).write_text(folder.name + "\n")
    return folder


def test_the_snapshot_records_the_built_engine_venvs_and_which_serves(private_cache):
    assert collect() == []                                      # a node before any `engine setup`
    current = venv_as_built(engine_env_dir("sglang"), {"sglang": "0.5.19", "torch": "2.13.0"})
    older = venv_as_built(private_cache / "engines" / "sglang-000000000000", {"sglang": "0.5.18"})
    (private_cache / "engines" / ".sglang-111111111111.build-42").mkdir()       # a build under way: not a venv yet
    recorded = {Path(venv.path).name: venv for venv in collect()}
    assert set(recorded) == {current.name, older.name}
    assert recorded[current.name] == EngineVenvFacts("sglang", str(current), SPEC.requirements, True,
                                                     {"sglang": "0.5.19", "torch": "2.13.0"})
    assert recorded[older.name].current is False


def test_the_cli_says_where_sglangs_venv_is_and_does_nothing_once_it_is_built(cli, private_cache):
    """`engine python sglang` before and after; `engine setup sglang` on a venv already built for these pins
    (a stand-in: the folder as a setup leaves it) is done at once, and prints its python."""
    from dflash.generate.engine_env import BYTECODE_STAMP

    before = cli("engine", "python", "sglang")
    assert before.code == 1 and "run `launcher.py engine setup sglang`" in before.err
    venv = venv_as_built(engine_env_dir("sglang"), {"sglang": "0.5.19"})
    (venv / BYTECODE_STAMP).write_text(venv.name + "\n")
    assert cli("engine", "python", "sglang").out.strip() == str(venv / "bin" / "python")
    again = cli("engine", "setup", "sglang")
    assert again.code == 0 and again.out.strip() == str(venv / "bin" / "python")
    assert again.err.strip() == f"engine setup sglang: up to date ({SPEC.requirements})"


@pytest.fixture(scope="module")
def fresh(fixtures_dir):
    return load_snapshot(fixtures_dir / "snapshots" / "rtx6000-x8-fresh.json")


def sglang_finding(snapshot, profile_name="rtx6000-x8"):
    [finding] = check_sglang_serves_the_drafter(CheckInput(snapshot, load_profile(profile_name)))
    return finding


def with_venv(snapshot, current=True, sglang="0.5.19", driver_cuda="13.0"):
    venv = EngineVenvFacts("sglang", "/home/u/.cache/dflash-launcher/engines/sglang-0123456789ab", SPEC.requirements,
                           current, {"sglang": sglang})
    return dataclasses.replace(snapshot, engine_venvs=[venv],
                               nvml=dataclasses.replace(snapshot.nvml, cuda_driver_version=driver_cuda))


def test_the_check_passes_on_sglangs_own_venv_and_names_it(fresh):
    finding = sglang_finding(with_venv(fresh))
    assert finding.status == "PASS"
    assert finding.message.startswith("sglang 0.5.19 (engine venv sglang-0123456789ab, `launcher.py engine setup sglang`)")


def test_the_venv_on_a_driver_older_than_its_torchs_cuda_warns(fresh):
    finding = sglang_finding(with_venv(fresh, driver_cuda="12.8"))
    assert finding.status == "WARN" and "built for CUDA 13.0 and the driver (580.95.05) runs CUDA 12.8" in finding.message


def test_a_venv_too_old_for_the_drafter_warns_naming_its_layers(fresh):
    finding = sglang_finding(with_venv(fresh, sglang="0.5.13"))
    assert finding.status == "WARN" and "layer 0 (sliding_attention): trained causal, window 2048" in finding.message


@pytest.mark.parametrize("engine_venvs, why", [
    ([], ""),
    (None, "this snapshot does not record engine venvs (taken by an older launcher: take it again); "),
    ("older", "the sglang venv built before is from older pins; ")])
def test_without_a_venv_of_the_current_pins_the_hint_is_the_setup_command(fresh, engine_venvs, why):
    snapshot = with_venv(fresh, current=False) if engine_venvs == "older" else dataclasses.replace(fresh, engine_venvs=engine_venvs)
    finding = sglang_finding(snapshot)
    assert finding.status == "WARN" and "sglang 0.5.10.post1 (installed)" in finding.message
    assert finding.hint.startswith(f"{why}run `launcher.py engine setup sglang` (SGLang's own venv, from {SPEC.requirements}")


def test_a_node_whose_own_sglang_serves_needs_no_venv(fixtures_dir):
    b200 = load_snapshot(fixtures_dir / "snapshots" / "b200-x8-nvcc128-cu130.json")
    assert b200.engine_venvs == []
    finding = sglang_finding(b200, "b200-x8")
    assert finding.status == "PASS" and finding.message.startswith("sglang 0.5.19 (installed)")


def uv_compile(lines: list[str], python: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "uv", "pip", "compile", "-", "--python-version", python,
                           "--python-platform", "x86_64-manylinux_2_34", "--no-header", "--no-annotate", "-q", *flags],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"}, timeout=300)


@pytest.mark.engine
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_the_engine_file_resolves_to_itself_with_a_wheel_for_every_package(python):
    """The package index answers (uv reads metadata, installs nothing): the file resolved with its dependencies is
    itself (nothing missing, nothing else chosen), and each package but cuda-tile (a source placeholder on PyPI; the
    setup takes its wheel from pypi.nvidia.com) has a wheel for Linux x86_64 and this Python."""
    from envcheck.engine_venvs import read_requirement_lines

    lines = read_requirement_lines(SPEC)
    resolved = uv_compile(lines, python)
    if resolved.returncode != 0 and "Failed to fetch" in resolved.stderr:
        pytest.skip(f"the package index is not reachable: {resolved.stderr.strip().splitlines()[-1]}")
    assert resolved.returncode == 0, resolved.stderr
    assert resolved.stdout.split() == lines
    wheels = uv_compile([line for line in lines if not line.startswith("cuda-tile==")], python, "--no-deps", "--no-build")
    assert wheels.returncode == 0, wheels.stderr


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DFLASH_TEST_SGLANG_SETUP") != "1",
                    reason="downloads about 6.5 GB (8.7 GB venv): set DFLASH_TEST_SGLANG_SETUP=1 to run it")
def test_the_real_setup_builds_a_venv_that_imports_sglang():
    """`launcher.py engine setup sglang` for real, into the user's cache (DFLASH_CACHE): a venv whose python reports
    sglang 0.5.19 and a CUDA 13.0 torch, found again by a second setup. Where the wheels from an index besides PyPI
    are out of reach, the setup names the step and the index and puts nothing in place: the test reports that as its
    skip; any other failure fails it."""
    from dflash.generate.engine_env import setup_engine_env
    from envcheck.engine_venvs import built_engine_python
    from launcher_core.errors import RunFailed

    lines: list[str] = []
    try:
        env = setup_engine_env("sglang", echo=lines.append)
    except RunFailed as failed:
        assert not engine_env_dir("sglang").exists()
        if not any(wheel.index in str(failed) for wheel in SPEC.index_wheels):
            raise
        pytest.skip(str(failed))            # an index besides PyPI is out of reach (the step names it)
    probe = subprocess.run([str(env.python), "-c", "import importlib.metadata as m, torch; "
                            "print(m.version('sglang'), torch.version.cuda)"], capture_output=True, text=True)
    assert probe.stdout.split() == ["0.5.19", "13.0"], probe.stderr
    assert setup_engine_env("sglang", echo=lines.append).built is False and built_engine_python("sglang") == env.python
