"""`launcher.py engine setup vllm|sglang`: a serving engine's own venv, built from the project's pins.

An engine's pins conflict with ours or need another torch build, so it lives in a uv venv of its own
under the project cache (`<cache>/engines/<engine>-<key>/`, envcheck/engine_venvs.py);
`eval.engine_python` defaults to it. The venv is built in a temporary sibling and renamed into place
only once the server's module imports, so a killed setup never leaves a half venv where a good one
is expected; the same pins again do nothing; an older pins' venv is removed once the new one is in
place. uv writes no bytecode, so the import check compiles the engine's package once per venv and a
server does not recompile its imports at every start. Install order and figures: docs/serving.md
"vLLM on CPU", "SGLang on a GPU node".
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from envcheck.engine_venvs import STAMP, EngineSpec, IndexWheel, engine_spec, engines_dir, env_key, install_lines, is_complete
from launcher_core.errors import RunFailed
from launcher_core.paths import cache_build_lock
from launcher_core.processes import process_alive

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


def setup_engine_env(engine: str, echo: Callable[[str], None] = print, spec: Optional[EngineSpec] = None) -> EngineEnv:
    """Build the engine's venv unless an up-to-date one exists; see the module docstring.
    `spec` replaces the engine's own (tests: a small venv built the same way)."""
    spec = spec or engine_spec(engine)
    lines = install_lines(spec)
    final = engines_dir() / f"{engine}-{env_key(spec, lines)}"
    if is_complete(final) and _has_bytecode(final):
        echo(f"engine setup {engine}: up to date ({spec.requirements})")
        return EngineEnv(engine, final, False, 0.0)
    with cache_build_lock(f"engine-{final.name}"):      # a second setup waits, then finds it built
        if not is_complete(final):
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
    steps = build_steps(spec, staging, lines)
    for number, (what, argv) in enumerate(steps, 1):
        echo(f"engine setup {spec.engine} [{number}/{len(steps)}]: {what}")
        _run_or_fail(argv, f"engine setup {spec.engine}: step {number} ({what}) failed",
                     "Nothing was put in place; run it again once the cause is fixed")


def build_steps(spec: EngineSpec, staging: Path, lines: list[str]) -> list[tuple[str, list[str]]]:
    """(what, argv) of each step: the venv, the wheels from other indexes, the pins, the removals, the import."""
    python = str(staging / "bin" / "python")
    uv = [sys.executable, "-m", "uv"]
    steps = [(f"creating the venv ({sys.version.split()[0]})",
              [*uv, "venv", "--relocatable", "--no-project", "--python", sys.executable, str(staging)])]
    steps += [(_index_wheel_step(wheel), [*uv, "pip", "install", "--python", python, "--no-deps", "--index-url",
                                          wheel.index, wheel.requirement]) for wheel in spec.index_wheels]
    steps.append((f"installing {spec.requirements} (the first time downloads {spec.download})",
                  [*uv, "pip", "install", "--python", python, *lines]))
    if spec.remove_after:
        steps.append((f"removing {', '.join(spec.remove_after)} (CUDA builds pulled by the engine)",
                      [*uv, "pip", "uninstall", "--python", python, *spec.remove_after]))
    steps.append((f"checking `import {spec.import_check}`, writing its bytecode", _import_writing_bytecode(spec, python)))
    return steps


def _index_wheel_step(wheel: IndexWheel) -> str:
    return f"installing {wheel.requirement} from {wheel.index}" + (f"; {wheel.why}" if wheel.why else "")


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
        if not is_complete(final):
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
