"""The bisect's JSON-lines log: a header naming what is bisected, then one line per step, and
a `learned` line for each coupling an inconsistent candidate revealed (replayed on resume, so
the resumed search regroups exactly as the interrupted one did).

Each line is appended, flushed and fsynced before the next step starts, so a bisect killed at
any moment loses at most the step in flight; a torn last line is dropped on resume. Opening
an existing log whose header does not match this bisect (other GOOD/BAD sets, groups or probe)
is a ConfigError: resuming it would mix two searches.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from envcheck.bisect.search import Outcome
from launcher_core.errors import ConfigError
from launcher_core.fileio import write_text_atomic


@dataclass
class StepRecord:
    """One candidate environment tried: what it was, what happened, how long it took."""

    step: int
    k: int                                   # GOOD + the first k groups (of the grouping at that step)
    groups: list[str]                        # the groups applied
    result: Outcome                          # "good", "bad" or "skip"
    packages: list[str] = field(default_factory=list)   # the changed packages applied
    reason: str = ""                         # why skipped: "regrouped" (inconsistent; the coupling it
                                             # showed regrouped the changes, the search went on),
                                             # "inconsistent", "install failed", "cannot test"
    exit_code: Optional[int] = None          # the probe's exit code (None: not probed)
    memory_mib: Optional[float] = None       # the probe report's headline figure
    probe_report: Optional[str] = None
    message: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)  # inconsistent: the check's lines naming them
    kind: str = "step"


@dataclass
class LearnedRecord:
    """Step `after_step` was inconsistent: `mover` cannot move before `needs` (`reason`: the check)."""

    after_step: int
    mover: str
    needs: str
    reason: str
    kind: str = "learned"


class BisectLog:
    def __init__(self, path: Path, header: dict[str, Any], steps: list[StepRecord],
                 learned: Optional[list[LearnedRecord]] = None) -> None:
        self.path, self.header, self.steps = path, header, steps
        self.learned: list[LearnedRecord] = learned or []

    @classmethod
    def open(cls, path: Path, header: dict[str, Any], fresh: bool = False) -> "BisectLog":
        """Resume the log at `path` (same header) or start it; `fresh` discards an old one."""
        lines = [] if fresh or not path.exists() else _read_lines(path)
        if not lines:
            write_text_atomic(path, json.dumps(header, sort_keys=True) + "\n")
            return cls(path, header, [])
        if lines[0].get("fingerprint") != header["fingerprint"]:
            raise ConfigError(f"{path}: this log belongs to another bisect (different GOOD/BAD sets, "
                              "groups or probe); pass --log NEW_FILE, or --fresh to start over")
        steps = [StepRecord(**line) for line in lines[1:] if line.get("kind") == "step"]
        learned = [LearnedRecord(**line) for line in lines[1:] if line.get("kind") == "learned"]
        return cls(path, lines[0], steps, learned)

    def append(self, record: StepRecord) -> None:
        self._write(record)
        self.steps.append(record)

    def append_learned(self, record: LearnedRecord) -> None:
        self._write(record)
        self.learned.append(record)

    def _write(self, record: StepRecord | LearnedRecord) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(asdict(record), sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The log's records; a torn last line (killed mid-write) is dropped and the file repaired."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    records, good_text = [], ""
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ConfigError(f"{path}: line {number} is not JSON; the log is damaged, "
                              "pass --fresh to start over") from None
        good_text += line if line.endswith("\n") else line + "\n"
    if good_text != text:
        write_text_atomic(path, good_text)
    return records
