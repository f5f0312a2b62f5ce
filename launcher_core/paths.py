"""Where the project keeps things: the repository root, the profiles folder and the cache.

Relative paths in profiles are under REPO_ROOT; `DFLASH_PROFILES_DIR` and `DFLASH_CACHE`
move the shipped profiles folder and the cache for tests and unusual installs.
"""
from __future__ import annotations

import os
from pathlib import Path

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
