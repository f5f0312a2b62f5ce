"""Installed package versions, read from the dist-info folder names on sys.path (no imports).

Also parses a requirements file's `name==version` pins, and compares versions the way pip's
`==` does (a pin without a local label, `2.9.1`, matches `2.9.1+cu128`).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

# The packages whose versions decide whether a GPU run works; shown first by `audit`.
PACKAGES_THAT_MATTER = (
    "torch", "triton", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "sgl-kernel",
    "sglang-kernel", "sglang", "transformers", "datasets", "pyarrow", "accelerate", "nvidia-nccl-cu12",
    "nvidia-nccl-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "nvidia-cuda-runtime-cu12",
    "nvidia-cuda-runtime", "nvidia-ml-py", "psutil",
)
FLASHINFER_FAMILY = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")
_DIST_DIR = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+?)(?:-py[\d.]+)?\.(?:dist|egg)-info$")
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*(?P<version>[^\s;#]+)")


@dataclass(frozen=True)
class InstalledDist:
    name: str
    version: str
    path: Path


def normalize(name: str) -> str:
    """PEP 503 name: `Flashinfer_Python` -> `flashinfer-python`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_dists(search_path: Iterable[str] | None = None) -> dict[str, InstalledDist]:
    """name -> the first distribution of that name on sys.path (the one Python imports)."""
    found: dict[str, InstalledDist] = {}
    for entry in (sys.path if search_path is None else search_path):
        directory = Path(entry or ".")
        if not directory.is_dir():
            continue
        for child in sorted(directory.iterdir()):
            match = _DIST_DIR.match(child.name)
            if match:
                name = normalize(match["name"])
                found.setdefault(name, InstalledDist(name, match["version"], child))
    return found


def installed_versions(search_path: Iterable[str] | None = None) -> dict[str, str]:
    return {name: dist.version for name, dist in sorted(installed_dists(search_path).items())}


def find_dist(name: str) -> Optional[InstalledDist]:
    return installed_dists().get(normalize(name))


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a requirements file, comments and blank lines dropped."""
    lines = [line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


def read_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file -> {normalised name: version}."""
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[normalize(match["name"])] = match["version"]
    return pins


def version_matches_pin(installed: str, pinned: str) -> bool:
    """pip's `==`: without a local label in the pin, the installed local label is ignored."""
    if "+" in pinned:
        return installed == pinned
    return installed.split("+", 1)[0] == pinned


def public_version(version: str) -> str:
    """`0.6.7+cu128` -> `0.6.7` (the local label names the build, not the release)."""
    return version.split("+", 1)[0]
