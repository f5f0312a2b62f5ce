"""The serving engines' own venvs (`launcher.py engine setup ENGINE`): what each holds, where it lives
under the project cache and whether the one for the current pins is built. The build is
dflash/generate/engine_env.py's; the snapshot records what is built here (`collect`), so the audit's
engine.sglang check reads it from a snapshot like any other fact of the node.

A venv lives at `<cache>/engines/<engine>-<key>/`, the key hashing the engine's requirements file, the
Python that builds it, the wheels taken from other indexes and the packages removed after the
install. It counts as built once its stamp (`.engine-key`, holding its folder's name) is written: the
last thing a setup does, after the engine's module imported in it.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from envcheck.snapshot import EngineVenvFacts
from launcher_core.errors import ConfigError
from launcher_core.paths import REPO_ROOT, cache_dir

STAMP = ".engine-key"


@dataclass(frozen=True)
class IndexWheel:
    """A pinned package that the default index does not serve as a wheel: installed from `index` without
    its dependencies (which the engine's requirements file pins), before that file."""

    requirement: str                   # name==version
    index: str                         # the index URL (PEP 503 simple API) that has the wheel
    why: str = ""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine's venv holds: its pinned requirements, what to remove after, what proves it works."""

    engine: str
    requirements: str                  # file in the repository root (or an absolute path)
    local_wheels: tuple[str, ...]      # pinned packages installed from a local wheel file of that version
    remove_after: tuple[str, ...]      # pulled by the engine, unusable here: uninstalled after the install
    import_check: str                  # module that must import in the finished venv (its bytecode is kept)
    compile_packages: tuple[str, ...] = ()     # packages compiled whole to bytecode before the import check
    index_wheels: tuple[IndexWheel, ...] = ()  # installed first, each from its own index (no dependencies)
    cuda: str = ""                     # the CUDA its torch is built for ("": a CPU build); the driver must run it
    download: str = "about 1 GB"       # what the first build downloads (the progress line says it)


# SGLang 0.5.19 pins cuda-tile 1.6.0rc5, which PyPI has only as a placeholder source package whose build
# fetches the wheel from NVIDIA's index; FlashInfer's kernel wheels of 0.6.18 are on FlashInfer's index only
# (its own `flashinfer install-cubin-wheel` / `install-jit-cache-wheel` use these URLs, --no-deps).
SGLANG_INDEX_WHEELS = (
    IndexWheel("cuda-tile==1.6.0rc5", "https://pypi.nvidia.com", "PyPI has only a placeholder of it"),
    IndexWheel("flashinfer-cubin==0.6.18", "https://flashinfer.ai/whl", "not on PyPI after 0.6.13"),
    IndexWheel("flashinfer-jit-cache==0.6.18+cu130", "https://flashinfer.ai/whl/cu130", "one per CUDA version"),
)
ENGINE_SPECS = {
    "vllm": EngineSpec("vllm", "requirements-engine-vllm-cpu.txt", ("torch",), ("torchvision", "torchaudio", "torchcodec"),
                       "vllm.entrypoints.openai.api_server", ("vllm",)),
    "sglang": EngineSpec("sglang", "requirements-engine-sglang-cu130.txt", (), (), "sglang.launch_server", ("sglang",),
                         SGLANG_INDEX_WHEELS, cuda="13.0", download="about 6.5 GB"),
}


def engine_spec(engine: str) -> EngineSpec:
    if engine not in ENGINE_SPECS:
        raise ConfigError(f"engine setup {engine!r}: valid engines are {', '.join(ENGINE_SPECS)}")
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
    """Hash of what the venv holds: the pins (wheel file names, not their folder), the Python, the wheels
    from other indexes, the removals."""
    names = [Path(line).name if line.endswith(".whl") else line for line in lines]
    indexed = [f"{wheel.requirement} @ {wheel.index}" for wheel in spec.index_wheels]
    text = "\n".join([sys.version, *names, "remove:", *spec.remove_after, *(["index:", *indexed] if indexed else [])])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def engines_dir() -> Path:
    return cache_dir() / "engines"


def engine_env_dir(engine: str) -> Path:
    """Where the engine's venv for the current pins lives (built or not)."""
    spec = engine_spec(engine)
    return engines_dir() / f"{engine}-{env_key(spec, install_lines(spec))}"


def is_complete(path: Path) -> bool:
    stamp = path / STAMP
    return stamp.exists() and stamp.read_text(encoding="utf-8").strip() == path.name and (path / "bin" / "python").exists()


def built_engine_python(engine: str) -> Optional[Path]:
    """The python of the engine's up-to-date venv, None when it is not built (or its pins changed)."""
    if engine not in ENGINE_SPECS:
        return None
    try:
        path = engine_env_dir(engine)
    except ConfigError:
        return None
    return path / "bin" / "python" if is_complete(path) else None


def built_venvs(engine: str) -> list[Path]:
    """The engine's built venvs under the cache, whatever pins they were built from."""
    folder = engines_dir()
    return sorted(path for path in folder.glob(f"{engine}-*") if is_complete(path)) if folder.is_dir() else []


def collect() -> list[EngineVenvFacts]:
    """Every built engine venv under the cache, with the packages it holds (read from its dist-info
    folders, nothing imported) and whether it is the one for the current pins (the one the launcher uses)."""
    from envcheck.packages import installed_versions

    found = []
    for engine, spec in ENGINE_SPECS.items():
        venvs = built_venvs(engine)
        current = _current_dir(engine) if venvs else None
        for path in venvs:
            site = [str(folder) for folder in sorted(path.glob("lib/python*/site-packages"))]
            found.append(EngineVenvFacts(engine=engine, path=str(path), requirements=spec.requirements,
                                         current=path == current, packages=installed_versions(site)))
    return found


def _current_dir(engine: str) -> Optional[Path]:
    try:
        return engine_env_dir(engine)
    except ConfigError:
        return None
