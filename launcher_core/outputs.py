"""Where a command may write its output: the one set of refusal rules every writer uses.

No command deletes or replaces a path it did not create:

* an output that equals an input or contains one (an input lies inside it) is refused (a new
  folder inside an input folder destroys nothing and is allowed);
* an existing path that is not this command's own kind of output (`OutputKind`: a dflash dataset
  for tokenize and merge, a drafter export for export, a snapshot for snapshot -o) is refused,
  with or without `--force`; an empty directory counts as free;
* an existing output of the right kind is replaced only with `--force`; a dataset is then kept as
  a backup (`NAME.backup-<time>`, moved aside at the moment the new one is published).

All refusals are ConfigError (exit 2) naming the path and what to do. The writes themselves stay
temp-then-rename (`launcher_core.fileio`, `dflash.data.publish.publish_directory`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from launcher_core.errors import ConfigError


@dataclass(frozen=True)
class OutputKind:
    """A kind of output: its name in messages, how to recognise one on disk, whether a replaced
    one is kept as a backup."""

    name: str
    recognise: Callable[[Path], bool]
    backup: bool = False
    directory: bool = True


def _json_field(path: Path, key: str) -> object:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return document.get(key) if isinstance(document, dict) else None


def is_dflash_dataset(path: Path) -> bool:
    """A dataset written by tokenize or merge (its dflash_meta.json names the format)."""
    return str(_json_field(path / "dflash_meta.json", "format") or "").startswith("dflash-dataset/")


EXPORT_MARKER = ".dflash-export.json"      # written by `launcher.py export` into every folder it writes


def is_drafter_export(path: Path) -> bool:
    """A drafter directory written by export: our marker file (`EXPORT_MARKER`) beside its
    config.json. A downloaded drafter (config.json, weights, README.md) looks the same otherwise,
    and is not ours to replace."""
    return _json_field(path / EXPORT_MARKER, "written_by") == "launcher.py export"


def mark_export(directory: Path, **facts: object) -> None:
    """Write the marker that makes `directory` an export of ours (what `export --force` may replace)."""
    document = {"written_by": "launcher.py export", "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **facts}
    (Path(directory) / EXPORT_MARKER).write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


def is_snapshot_file(path: Path) -> bool:
    return _json_field(path, "schema_version") is not None and _json_field(path, "hostname") is not None


DATASET = OutputKind("dflash dataset", is_dflash_dataset, backup=True)
EXPORT = OutputKind("drafter export", is_drafter_export)
SNAPSHOT = OutputKind("snapshot", is_snapshot_file, directory=False)


@dataclass(frozen=True)
class OutputPlan:
    """Where to write; `replaces`: an output of the right kind is there (allowed by --force);
    `backup`: where that one is moved when the new output is published (datasets)."""

    path: Path
    replaces: bool = False
    backup: Optional[Path] = None


def prepare_output(path: str | Path, kind: OutputKind, *, inputs: Iterable[str | Path] = (), force: bool = False,
                   flag: str = "--output") -> OutputPlan:
    """Check `path` against the refusal rules (module docstring); ConfigError naming it if refused."""
    target = Path(path)
    for source in inputs:
        _refuse_overlap(target, Path(source), flag)
    _refuse_under_file(target, flag)
    if not target.exists() and not target.is_symlink():
        return OutputPlan(target)
    if kind.directory and target.is_dir() and not any(target.iterdir()):
        return OutputPlan(target)             # an empty folder holds nothing to lose
    _refuse_foreign(target, kind, flag)
    if not force:
        raise ConfigError(f"{flag} {target} is an existing {kind.name}; pass --force to replace it"
                          + (" (it is kept as a backup)" if kind.backup else "") + ", or choose a new path")
    return OutputPlan(target, replaces=True, backup=backup_path(target) if kind.backup else None)


def _refuse_overlap(target: Path, source: Path, flag: str) -> None:
    out, given = target.resolve(), source.resolve()
    if out == given:
        raise ConfigError(f"{flag} {target} is the input {source} itself; choose a new path")
    if out in given.parents:
        raise ConfigError(f"{flag} {target} contains the input {source}; writing there would destroy it; "
                          "choose a new path")


def _refuse_under_file(target: Path, flag: str) -> None:
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {target}: {parent} is a file, not a directory; choose another path")
            return


def _refuse_foreign(target: Path, kind: OutputKind, flag: str) -> None:
    if kind.directory and not target.is_dir():
        raise ConfigError(f"{flag} {target} is an existing file, not a {kind.name}; nothing was written. "
                          "Choose a new path")
    if not kind.directory and target.is_dir():
        raise ConfigError(f"{flag} {target} is a directory; name a file to write (e.g. {target / 'out.json'})")
    if not kind.recognise(target):
        what = "folder" if target.is_dir() else "file"
        raise ConfigError(f"{flag} {target} is an existing {what} that is not a {kind.name}; nothing was "
                          f"touched. Choose a new path (--force never replaces what this command did not write)")


def backup_path(target: Path) -> Path:
    """`NAME.backup-<time>` next to `target` (a counter is added if that name is taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = target.with_name(f"{target.name}.backup-{stamp}")
    counter = 1
    while candidate.exists():
        counter += 1
        candidate = target.with_name(f"{target.name}.backup-{stamp}-{counter}")
    return candidate


def backups_of(target: Path) -> list[Path]:
    """Backups of `target` (merge's and --force's), newest first."""
    return sorted(Path(target).parent.glob(f"{Path(target).name}.backup-*"), key=lambda p: p.name, reverse=True)
