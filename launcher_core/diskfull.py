"""A full disk is the environment's error, not a bug: every writer reports it the same way.

`disk_full_guard(path, needed)` around a write turns the failure of a full filesystem (OSError
ENOSPC or EDQUOT anywhere in the exception's chain, or torch's serializer failing on a filesystem
with less free space than the write needs) into `DiskFull` (exit 7, the node's fault): the path, the bytes the
write needed and the bytes free there. `disk_full_of(error)` finds one in any exception, for the
CLI's last line of defence and for a training rank's failure record.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from launcher_core.errors import DiskFull

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What torch's zip writer says when a write fell short (it loses the OSError on the way).
TORCH_WRITER_MARKERS = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
Needed = Union[int, None, Callable[[], Optional[int]]]


def free_bytes(path: str | Path) -> Optional[int]:
    """Free bytes (for this user) on the filesystem that holds `path` or its nearest existing parent."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def human_bytes(count: Optional[int]) -> str:
    if count is None:
        return "an unknown number of bytes"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count:,} bytes ({count / size:.1f} {unit})"
    return f"{count:,} bytes"


def disk_full_message(path: str | Path, needed: Optional[int], what: str = "") -> str:
    free = free_bytes(path)
    doing = f"writing {what} to {path}" if what else f"writing {path}"
    need = f"needs about {human_bytes(needed)}" if needed is not None else "needs more room"
    return (f"disk full: {doing} {need}; {human_bytes(free)} free on that filesystem. Free space there (or "
            f"write somewhere else) and run the command again")


FULL_MESSAGES = ("No space left on device", "Disk quota exceeded", "[errno 28]", "[Errno 28]", "StorageFull")


def is_full_oserror(error: BaseException) -> bool:
    """ENOSPC / EDQUOT, by errno or (pyarrow's and safetensors' errors keep no errno) by the system's
    own words in the message."""
    if isinstance(error, OSError) and error.errno in FULL_ERRNOS:
        return True
    return isinstance(error, Exception) and any(words in str(error) for words in FULL_MESSAGES)


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and the per-rank errors a collective writer gathered
    (torch.distributed.checkpoint's CheckpointException keeps them in `failures`: rank -> (error, frames))."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current: Optional[BaseException] = pending.pop(0)
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            yield current
            failures = getattr(current, "failures", None)
            if isinstance(failures, dict):
                pending += [entry[0] if isinstance(entry, tuple) else entry for entry in failures.values()
                            if isinstance(entry[0] if isinstance(entry, tuple) else entry, BaseException)]
            current = current.__cause__ or current.__context__


def disk_full_of(error: BaseException, path: str | Path | None = None, needed: Optional[int] = None,
                 what: str = "") -> Optional[DiskFull]:
    """The DiskFull an exception amounts to, or None. An ENOSPC/EDQUOT OSError anywhere in its chain
    counts (its own filename is the path named); a torch writer failure counts when the filesystem
    at `path` has less free space than `needed` (or under 1 MiB)."""
    for link in exception_chain(error):
        if isinstance(link, DiskFull):
            return link
        if is_full_oserror(link):
            named = link.filename if isinstance(link, OSError) else None
            where = path or named
            if where is None:
                return DiskFull("disk full: a write found its filesystem full (" + str(link).splitlines()[0][:200] +
                                "); free space where the command writes and run it again")
            return DiskFull(disk_full_message(where, needed, what))
    if path is not None and any(marker in str(link) for link in exception_chain(error) for marker in TORCH_WRITER_MARKERS):
        free = free_bytes(path)
        if free is not None and free < max(needed or 0, 2**20):
            return DiskFull(disk_full_message(path, needed, what))
    return None


@contextlib.contextmanager
def disk_full_guard(path: str | Path, needed: Needed = None, what: str = "") -> Iterator[None]:
    """Around a write into `path`: a full filesystem becomes DiskFull naming `path` (or the file
    the OSError names inside it), `needed` bytes (a number, or a callable asked after the failure)
    and the bytes free; anything else passes through unchanged."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        count = needed() if callable(needed) else needed
        found = disk_full_of(error, path, count)
        if found is None:
            raise
        raise DiskFull(disk_full_message(path, count, what)) from None


def tree_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (or of the file), 0 when it is missing."""
    target = Path(path)
    if target.is_file():
        return target.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(target):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total
