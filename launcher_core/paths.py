"""Where the project keeps things: the repository root, the profiles folder and the cache.

Relative paths in profiles are under REPO_ROOT; `DFLASH_PROFILES_DIR` and `DFLASH_CACHE`
move the shipped profiles folder and the cache for tests and unusual installs.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

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


@contextlib.contextmanager
def cache_build_lock(name: str) -> Iterator[None]:
    """Hold `<cache>/.locks/<name>.lock` (flock, waiting for it) while building `name` into the
    cache: two processes that need the same converted model or engine venv at once (two launcher
    commands, parallel test workers) build it once; the second finds it done. The kernel drops the
    lock with its process, however it ends."""
    import fcntl

    folder = cache_dir() / ".locks"
    folder.mkdir(exist_ok=True)
    fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
