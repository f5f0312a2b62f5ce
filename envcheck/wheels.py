"""Local wheels: the files pip's find-links point at (a CPU torch build kept on disk, for example).

uv does not read pip's configuration, so a venv built with uv gets such a wheel by its file path:
`local_wheel("torch", "2.13.0")` finds `torch-2.13.0+cpu-cp311-...whl` in the find-links folders.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional


def pip_find_links() -> list[str]:
    """pip's find-links folders (PIP_FIND_LINKS, then pip's config), in that order, without duplicates."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    done = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                          capture_output=True, text=True)
    links += done.stdout.split() if done.returncode == 0 else []
    return list(dict.fromkeys(link.removeprefix("file://") for link in links))


def local_wheel(name: str, version: str, links: Optional[list[str]] = None) -> Optional[Path]:
    """The wheel of `name` at `version` (any local build tag, e.g. 2.13.0+cpu) for this Python, if on disk."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    patterns = (f"{name}-{version}-{tag}-*.whl", f"{name}-{version}+*-{tag}-*.whl")
    for link in pip_find_links() if links is None else links:
        folder = Path(link)
        found = sorted(wheel for pattern in patterns for wheel in folder.glob(pattern)) if folder.is_dir() else []
        if found:
            return found[0]
    return None


def local_torch_wheel() -> Optional[Path]:
    """The wheel of the torch this process runs (same version, same build), if one is at hand."""
    import torch

    return local_wheel("torch", torch.__version__)
