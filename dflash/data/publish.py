"""Staging directories and atomic publication of a dataset directory.

A dataset is built in a staging directory next to its final path (`.NAME.<purpose>-<pid>`) and
renamed into place; a staging directory whose process is gone is removed by the next run, and an
existing dataset is swapped out in one atomic exchange where Linux offers it.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
from pathlib import Path

from launcher_core.processes import process_alive

STAGING_RE = re.compile(r"^\.(?P<name>.+)\.(?P<purpose>[a-z-]+)-(?P<pid>\d+)$")


def staging_path(target: Path, purpose: str) -> Path:
    return target.parent / f".{target.name}.{purpose}-{os.getpid()}"


def new_staging(target: Path, purpose: str) -> Path:
    """A fresh staging directory for `target` (stale ones of dead processes are removed first)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_staging(target)
    staging = staging_path(target, purpose)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def sweep_stale_staging(target: Path) -> list[Path]:
    """Remove `.NAME.<purpose>-<pid>` siblings of `target` whose process no longer exists."""
    removed = []
    for entry in target.parent.glob(f".{target.name}.*-*"):
        match = STAGING_RE.match(entry.name)
        if match and match["name"] == target.name and not process_alive(int(match["pid"])):
            _restore_if_orphaned(entry, target, match["purpose"])
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _restore_if_orphaned(entry: Path, target: Path, purpose: str) -> None:
    """A two-rename swap killed between its renames leaves the old dataset at `.NAME.old-PID`."""
    if purpose == "old" and not target.exists():
        os.replace(entry, target)


def publish_directory(staging: Path, target: Path, backup: Path | None = None) -> None:
    """Put `staging` at `target` atomically; an existing `target` is swapped out, then removed, or
    with `backup`, moved there first (a kill between the two renames leaves it at `backup`)."""
    if not target.exists():
        os.replace(staging, target)
        return
    if backup is not None:
        os.replace(target, backup)
        os.replace(staging, target)
        return
    if _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old dataset
        return
    old = staging_path(target, "old")
    os.replace(target, old)   # a kill here is repaired by sweep_stale_staging (restores `old`)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(first: Path, second: Path) -> bool:
    """Linux renameat2(RENAME_EXCHANGE): swap two paths in one atomic step. False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange)
    return result == 0
