"""Where the project keeps things: the repository root, the profiles folder and the cache.

Relative paths in profiles are under REPO_ROOT; `DFLASH_PROFILES_DIR` and `DFLASH_CACHE`
move the shipped profiles folder and the cache for tests and unusual installs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import ContextManager

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_PROFILES_DIR = REPO_ROOT / "profiles"


def profile_dir() -> Path:
    """The folder of the shipped profiles (`DFLASH_PROFILES_DIR` overrides it)."""
    return Path(os.environ.get("DFLASH_PROFILES_DIR", SHIPPED_PROFILES_DIR))


def cache_dir() -> Path:
    """The project's cache directory (`DFLASH_CACHE`, default ~/.cache/dflash-launcher)."""
    default = Path.home() / ".cache" / "dflash-launcher"
    path = Path(os.environ.get("DFLASH_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_build_lock(name: str) -> ContextManager[None]:
    """Hold `<cache>/.locks/<name>.lock` (waiting for it) while building `name` into the cache: two
    processes that need the same converted model or engine venv at once (two launcher commands,
    parallel test workers) build it once; the second finds it done."""
    from launcher_core.runlock import waiting_lock

    return waiting_lock(cache_dir() / ".locks" / f"{name}.lock")
