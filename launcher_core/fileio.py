"""Crash-safe file writing: write to a temporary path next to the target, then rename.

A crash or kill at any moment leaves either the old file or the new one, never half of one.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

RUN_DIR_SETTING = "paths.run_dir (or --run-dir)"


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file in the same directory, fsync, rename)."""
    target = Path(path)
    _check_file_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def _check_file_target(target: Path) -> None:
    """A file is written only where a file can go: not over a directory, not under a file."""
    from launcher_core.errors import InputError

    if target.is_dir():
        raise InputError(f"{target} is a directory; name a file to write (e.g. {target / 'out.json'})")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{target}: {parent} is a file, not a directory; choose another path")
            break


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, document: Any) -> Path:
    return write_text_atomic(path, json.dumps(document, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a missing or malformed file raises InputError naming it."""
    from launcher_core.errors import InputError

    target = Path(path)
    try:
        return json.loads(target.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{target}: file not found") from None
    except IsADirectoryError:
        raise InputError(f"{target} is a directory, not a JSON file") from None
    except UnicodeDecodeError:
        raise InputError(f"{target}: not a text (UTF-8) file, so not JSON; is it the right file?") from None
    except json.JSONDecodeError as error:
        raise InputError(f"{target}: line {error.lineno}: not valid JSON ({error.msg})") from None
    except OSError as error:
        raise InputError(f"{target}: cannot read it: {error.strerror or error}") from None


def read_json_object(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """Read a JSON file that must hold an object (`what` names it in the error, e.g. "a snapshot")."""
    from launcher_core.errors import InputError

    document = read_json(path)
    if not isinstance(document, dict):
        raise InputError(f"{path}: expected {what} (a JSON object), found a JSON {_json_kind(document)}; "
                         "is it the right file?")
    return document


def json_object_or_empty(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON file's object where its absence is an answer ({} when it is missing, unreadable or not an object):
    optional facts such as a tokenizer's or a dataset's side files, which the caller checks for what it needs."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    If `path` already exists it is moved aside first and removed only after the new one is in
    place. On error the temporary directory is removed and `path` is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_directory(staging, target)


def replace_directory(source: Path, target: Path) -> None:
    """Put directory `source` at `target`, replacing any existing one with at most one rename gap."""
    if not target.exists():
        os.replace(source, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, old)
    os.replace(source, target)
    shutil.rmtree(old, ignore_errors=True)


def _json_kind(document: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(document), type(document).__name__)


def make_run_dir(run_dir: str | Path) -> Path:
    """`mkdir -p` of a run directory; ConfigError naming RUN_DIR_SETTING when a file stands where a
    directory of its path should be (paths.run_dir = "/etc/passwd/x"): the profile's error, not a bug."""
    from launcher_core.errors import ConfigError

    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise ConfigError(f"{RUN_DIR_SETTING} = {path}: {blocker} is a file, not a directory; set it to a "
                          f"directory (an existing one or one it can create)") from None
    return path
