"""A fault of the node, not of the input: the same command may pass on another node (exit 7, EXIT_NODE).

`node_fault_of(error)` is the NodeFault an exception amounts to, or None: a full disk
(launcher_core.diskfull), an OSError EROFS (a read-only filesystem) anywhere in its chain, EACCES or
EPERM on a path (permission denied), or the host out of memory (MemoryError, torch's CPU allocator).
Its message names the path and what to do. The CLI's funnel (launcher.main) turns such an error into
exit 7 instead of a crash report, and a training rank records it as the cause of its failure
(dflash.train.rank.worker), so a scheduler can tell "retry on another node" from "fix your profile".
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional

from launcher_core.diskfull import disk_full_of, exception_chain, human_bytes
from launcher_core.errors import LauncherError, NodeFault

READ_ONLY_ERRNOS = (errno.EROFS,)
DENIED_ERRNOS = (errno.EACCES, errno.EPERM)
# What torch's CPU allocator says when the host has no memory left for it (a RuntimeError, not a MemoryError).
HOST_MEMORY_MARKERS = ("DefaultCPUAllocator: can't allocate memory",)


def node_fault_of(error: BaseException) -> Optional[NodeFault]:
    """The NodeFault `error` amounts to (module docstring), None for any other error."""
    full = disk_full_of(error)
    if full is not None:
        return full
    for link in exception_chain(error):
        fault = _link_fault(link)
        if fault is not None:
            return fault
    return None


def known_error(error: BaseException) -> Optional[LauncherError]:
    """A LauncherError as it is, another exception as the NodeFault it amounts to; None: a bug."""
    return error if isinstance(error, LauncherError) else node_fault_of(error)


def _link_fault(link: BaseException) -> Optional[NodeFault]:
    if isinstance(link, NodeFault):
        return link
    if isinstance(link, OSError) and link.errno in READ_ONLY_ERRNOS:
        return NodeFault(read_only_message(link.filename))
    if isinstance(link, OSError) and link.errno in DENIED_ERRNOS and link.filename is not None:
        return NodeFault(denied_message(link.filename))
    if isinstance(link, MemoryError) or any(marker in str(link) for marker in HOST_MEMORY_MARKERS):
        return NodeFault(host_memory_message(link))
    return None


def read_only_message(path: object) -> str:
    where = f"{path} cannot be written" if path is not None else "a write was refused"
    return (f"read-only filesystem: {where} (the filesystem that holds it is mounted read-only on this node); "
            f"run on a node where it is writable, remount it read-write, or choose another directory")


def denied_message(path: object) -> str:
    return (f"permission denied: {path} ({owner_of(Path(str(path)))}; this process runs as uid {os.geteuid()}); "
            f"fix its owner or permissions (chown, chmod), run as its owner, or use another directory or node")


def owner_of(path: Path) -> str:
    """`owned by uid U, mode 0755` of `path` or of its nearest existing parent (named when it is not `path`)."""
    probe = path.absolute()
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    try:
        facts = probe.lstat()
    except OSError:
        return "its owner cannot be read"
    which = "" if probe == path.absolute() else f"{probe} is "
    return f"{which}owned by uid {facts.st_uid}, mode {facts.st_mode & 0o7777:04o}"


def host_memory_message(link: BaseException) -> str:
    detail = str(link).strip().splitlines()[0][:160] if str(link).strip() else type(link).__name__
    return (f"the host ran out of memory ({detail}; {human_bytes(available_ram())} available now): free memory on "
            f"this node (stop other processes) or run on a node with more")


def available_ram() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:       # psutil missing or unable to read the host: the message says "unknown"
        return None
