"""Crash-safe completions output: append + flush in batches, a done index, a failures file.

The completions JSONL is the source of truth: one line per prompt id. Alongside it, in the run's
`generate/` directory:

* `done.index` — one `[end_offset, id]` JSON line per completion, appended after the batch it
  describes is flushed. On restart only the output past the last indexed offset is re-read, so
  resuming a 200k-line file costs milliseconds, and a crash between the two writes is repaired.
* `failures.jsonl` — prompts that still failed after all retries, with the reason
  (`--retry-failed` runs just those).

A SIGKILL can leave a torn last line (a partial batch write); it is detected on the next open
and cut off, so a restart continues with exactly one completion per id, no gaps, no duplicates.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypedDict, cast

from launcher_core.errors import ConfigError, InputError
from launcher_core.fileio import write_text_atomic

if TYPE_CHECKING:
    from dflash.generate.completions import CompletionRecord

INDEX_NAME = "done.index"
FAILURES_NAME = "failures.jsonl"
FSYNC_INTERVAL_S = 1.0
RECORD_KEYS = frozenset({"id", "messages", "finish_reason", "completion_tokens", "sampling"})   # records.completion_record
FIRST_LINE_LIMIT = 64 << 20      # bytes read to find the first line of an existing output


class FailureEntry(TypedDict):
    """One line of the failures file: a prompt that failed after all its retries."""

    id: str
    reason: str
    attempts: int
    at: str                      # UTC time, ISO 8601


@dataclass
class RecoveryReport:
    """What opening the store found: completions already done and what was repaired."""

    done: int = 0
    torn_bytes_dropped: int = 0
    index_rebuilt: bool = False
    reindexed: int = 0


@dataclass
class CompletionStore:
    """Append-only completions file with a done index and a failures file (see module doc)."""

    output_path: Path
    state_dir: Path
    flush_every: int = 32
    done_ids: set[str] = field(default_factory=set)
    failures: dict[str, FailureEntry] = field(default_factory=dict)
    _pending: list[tuple[str, bytes]] = field(default_factory=list)
    _output: BinaryIO | None = None
    _index: BinaryIO | None = None
    _offset: int = 0
    _last_fsync: float = 0.0
    _write_error: OSError | None = None     # a failed write (a full disk): every later write raises it

    @property
    def index_path(self) -> Path:
        return self.state_dir / INDEX_NAME

    @property
    def failures_path(self) -> Path:
        return self.state_dir / FAILURES_NAME

    def open(self) -> RecoveryReport:
        """Recover the done set from the index + the output's unindexed tail, then open for append."""
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        report = self._recover_output()
        self.failures = read_failures(self.failures_path, exclude=self.done_ids)
        self._output = self.output_path.open("ab")
        self._index = self.index_path.open("ab")
        self._offset = self._output.tell()
        report.done = len(self.done_ids)
        return report

    def _recover_output(self) -> RecoveryReport:
        report = RecoveryReport()
        size = self.output_path.stat().st_size if self.output_path.exists() else 0
        indexed, offset = _read_index(self.index_path, size, self.output_path)
        if indexed is None:
            report.index_rebuilt = True
            indexed, offset = {}, 0
            write_text_atomic(self.index_path, "")
        self.done_ids = set(indexed)
        tail, good_end = _scan_output(self.output_path, offset, line_base=len(indexed))
        report.torn_bytes_dropped = size - good_end
        if good_end < size:
            with self.output_path.open("r+b") as handle:
                handle.truncate(good_end)
        self._append_index_entries(tail)
        report.reindexed = len(tail)
        return report

    def _append_index_entries(self, entries: list[tuple[int, str]]) -> None:
        new = [(end, prompt_id) for end, prompt_id in entries if prompt_id not in self.done_ids]
        self.done_ids.update(prompt_id for _, prompt_id in entries)
        if new:
            with self.index_path.open("ab") as index:
                index.write(b"".join(_index_line(end, prompt_id) for end, prompt_id in new))

    def add(self, record: CompletionRecord) -> None:
        """Queue one completion (its `id` must not be done yet); flush every `flush_every`."""
        if self._write_error is not None:
            raise self._write_error
        prompt_id = record["id"]
        assert prompt_id not in self.done_ids, f"duplicate completion for id {prompt_id!r}"
        self.done_ids.add(prompt_id)
        self.failures.pop(prompt_id, None)
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        self._pending.append((prompt_id, line.encode("utf-8")))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def average_record_bytes(self) -> int | None:
        """The mean size of a completion line so far (written and queued); None before the first."""
        if not self.done_ids:
            return None
        return (self._offset + sum(len(line) for _, line in self._pending)) // len(self.done_ids)

    def add_failure(self, prompt_id: str, reason: str, attempts: int) -> None:
        """Record a prompt that failed after all retries (appended and flushed at once)."""
        entry: FailureEntry = {"id": prompt_id, "reason": reason, "attempts": attempts,
                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.failures[prompt_id] = entry
        with self.failures_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        """Write the queued completions in one append, then their index entries."""
        if self._write_error is not None:
            raise self._write_error
        if not self._pending or self._output is None or self._index is None:
            return
        index_lines, start = [], self._offset
        for prompt_id, line in self._pending:
            self._offset += len(line)
            index_lines.append(_index_line(self._offset, prompt_id))
        try:
            self._output.write(b"".join(line for _, line in self._pending))
            self._output.flush()
        except OSError as error:
            self._cut_back(start)
            self._write_error = error
            raise
        self._pending.clear()
        self._maybe_fsync(self._output)
        self._index.write(b"".join(index_lines))
        self._index.flush()

    def _cut_back(self, start: int) -> None:
        """A batch write failed (a full disk): the output is cut back to its last whole line and
        closed, and the batch's prompts count as not done (the index never named them: a resume
        sends them again). Every later write raises the same error: nothing is dropped quietly."""
        import contextlib

        handle, self._output = self._output, None
        assert handle is not None, "the output is open"
        try:
            os.ftruncate(handle.fileno(), start)
        finally:
            with contextlib.suppress(OSError):
                os.close(handle.fileno())          # the buffered bytes that did not fit are dropped
            with contextlib.suppress(OSError, ValueError):
                handle.close()
        self.done_ids.difference_update(prompt_id for prompt_id, _ in self._pending)
        self._offset = start
        self._pending.clear()

    def _maybe_fsync(self, handle: BinaryIO, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_fsync >= FSYNC_INTERVAL_S:
            os.fsync(handle.fileno())
            self._last_fsync = now

    def close(self) -> None:
        """Flush everything, fsync, and rewrite the failures file without ids now done."""
        self.flush()
        for handle in (self._output, self._index):
            if handle is not None:
                self._maybe_fsync(handle, force=True)
                handle.close()
        self._output = self._index = None
        if self.failures_path.exists():
            lines = "".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in self.failures.values())
            write_text_atomic(self.failures_path, lines)


def _index_line(end_offset: int, prompt_id: str) -> bytes:
    return (json.dumps([end_offset, prompt_id], ensure_ascii=False) + "\n").encode("utf-8")


def _read_index(index_path: Path, output_size: int, output_path: Path) -> tuple[dict[str, int] | None, int]:
    """The index's {id: end_offset} and its last offset; None when it does not match the output."""
    if not index_path.exists():
        return ({} if output_size == 0 else None), 0
    entries: dict[str, int] = {}
    last = 0
    for line in index_path.read_bytes().splitlines(keepends=True):
        try:
            end, prompt_id = json.loads(line)
        except (ValueError, TypeError):
            break  # a torn last entry: the output tail scan re-indexes what follows
        if not line.endswith(b"\n") or end <= last:
            break
        entries[prompt_id] = last = end
    if last > output_size or (last and not _ends_line(output_path, last)):
        return None, 0
    if len(entries) and _index_truncated(index_path, entries, last):
        _rewrite_index(index_path, entries)
    return entries, last


def _ends_line(path: Path, offset: int) -> bool:
    with path.open("rb") as handle:
        handle.seek(offset - 1)
        return handle.read(1) == b"\n"


def _index_truncated(index_path: Path, entries: dict[str, int], last: int) -> bool:
    text = index_path.read_bytes()
    return not text.endswith(_index_line(last, next(reversed(entries))))


def _rewrite_index(index_path: Path, entries: dict[str, int]) -> None:
    write_text_atomic(index_path, b"".join(_index_line(end, i) for i, end in entries.items()).decode("utf-8"))


def _scan_output(path: Path, offset: int, line_base: int) -> tuple[list[tuple[int, str]], int]:
    """Parse the output from `offset`: [(end_offset, id)] of complete lines and where good data ends.

    A bad last line (torn by a kill) ends the good data; a bad line followed by more lines is
    corruption this code did not make, so it is an InputError naming the line.
    """
    if not path.exists():
        return [], 0
    entries: list[tuple[int, str]] = []
    bad_line: int | None = None
    with path.open("rb") as handle:
        handle.seek(offset)
        for number, line in enumerate(handle, start=line_base + 1):
            if bad_line is not None:
                raise InputError(f"{path}: line {bad_line}: not a complete completion record; "
                                 "fix or remove that line (or write to a new --output)")
            prompt_id = _line_id(line)
            if prompt_id is None:
                bad_line = number
                continue
            offset += len(line)
            entries.append((offset, prompt_id))
    return entries, offset


def _line_id(line: bytes) -> str | None:
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return str(record["id"]) if isinstance(record, dict) and "id" in record else None


def read_failures(path: Path, exclude: Set[str] = frozenset()) -> dict[str, FailureEntry]:
    """The failures file as {id: last entry}, minus ids in `exclude`; unreadable lines are skipped."""
    if not path.exists():
        return {}
    failures: dict[str, FailureEntry] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            entry = json.loads(line)
            failures[str(entry["id"])] = cast(FailureEntry, entry)
        except (ValueError, KeyError, TypeError):
            print(f"warning: {path}: line {number}: unreadable failure entry skipped", file=sys.stderr)
    return {prompt_id: entry for prompt_id, entry in failures.items() if prompt_id not in exclude}


def check_output(output: Path, prompts: Path, run_dir: Path) -> None:
    """`generate --output` rules (ConfigError, exit 2, naming it), checked before anything is read
    or written: never the prompts file, never a directory or a path under a file, never an existing
    file that is not this command's completions JSONL. An empty file or our own output (to resume,
    also one whose only line a kill tore) is fine."""
    if _same_file(output, prompts):
        raise ConfigError(f"--output {output} is the prompts file {prompts} itself; completions would be appended "
                          "to it. Choose a new path")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--output {output}: {parent} is a file, not a directory; choose another path")
            break
    if output.is_dir():
        raise ConfigError(f"--output {output} is a directory; name a file to write (e.g. {output / 'completions.jsonl'})")
    if output.exists() and not _is_own_output(output, run_dir):
        raise ConfigError(f"--output {output} is an existing file that is not a completions JSONL of generate "
                          f"(its first line is not a completion record); nothing was touched. Choose a new path")


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    return a.exists() and b.exists() and os.path.samefile(a, b)


def _is_own_output(output: Path, run_dir: Path) -> bool:
    with output.open("rb") as handle:
        first = handle.readline(FIRST_LINE_LIMIT)
    if not first:
        return True                                # empty: nothing to lose
    if first.endswith(b"\n"):
        return is_completion_line(first)
    return _manifest_names(run_dir, output)        # no whole line: ours only if this run wrote it (torn by a kill)


def is_completion_line(line: bytes) -> bool:
    """A line `records.completion_record` wrote (its keys; tokenize reads the same)."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and RECORD_KEYS <= set(record) and isinstance(record["messages"], list)


def _manifest_names(run_dir: Path, output: Path) -> bool:
    from launcher_core.manifest import read_manifest

    stage = read_manifest(run_dir)["stages"].get("generate") or {}
    named = stage.get("output") if isinstance(stage, dict) else None
    return isinstance(named, str) and Path(named).resolve() == output.resolve()
