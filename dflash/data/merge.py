"""`launcher.py merge --base A --add B (--output C | --in-place)`: merge two tokenized datasets safely.

1. Refuse datasets whose columns, dtypes, tokenizer or chat-template fingerprint (or max_length)
   differ, naming each difference.
2. In place: back the base up first (a copy, verified against the base's recorded per-shard
   sha256 and row count) before anything else happens.
3. Stream record batches (base, then add, optionally de-duplicated by id or content hash) into a
   staging directory next to the final path; memory stays at a few batches whatever the sizes.
4. Verify from disk that rows, tokens and loss tokens equal the sums, then rename into place
   (in place: one atomic exchange with the base). A kill at any moment leaves the base as it was
   and nothing half-written at the final path; the next run removes the stale staging directory.
"""
from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

import numpy as np

from dflash.data import dataset_io, publish
from dflash.data.meta import DatasetMeta, RejectsEntry
from dflash.data.rendering_record import merged_rendering
from launcher_core.errors import ConfigError, DataError, InputError

if TYPE_CHECKING:
    import pyarrow as pa
    from tqdm import tqdm

    from launcher_core.outputs import OutputPlan

Dedup = Literal["none", "id", "content"]
DEDUP_CHOICES = ("none", "id", "content")
COPY_CHUNK = 8 << 20


@dataclass
class MergeSummary:
    output: str
    base_rows: int
    add_rows: int
    dedup: str
    dropped_duplicates: int = 0
    dropped_tokens: int = 0
    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    backup: str | None = None
    replaced: str | None = None          # --output --force: where the dataset it replaced was kept
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def format_text(self) -> str:
        lines = [f"merged {self.base_rows:,} + {self.add_rows:,} rows -> {self.rows:,} rows, "
                 f"{self.tokens:,} tokens, {self.loss_tokens:,} loss tokens at {self.output} ({self.seconds:.1f} s)",
                 f"  de-duplication by {self.dedup}: dropped {self.dropped_duplicates:,} rows "
                 f"({self.dropped_tokens:,} tokens) of the added dataset"]
        if self.backup:
            lines.append(f"  base backed up (verified) at {self.backup}")
        if self.replaced:
            lines.append(f"  the dataset it replaced is kept at {self.replaced}")
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


@dataclass(frozen=True)
class DatasetOnDisk:
    path: Path
    meta: DatasetMeta
    schema: pa.Schema

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> "DatasetOnDisk":
        """`verify`: every shard's size and sha256 against dflash_meta.json first (DataError naming
        the shard and the backup); without it, sizes only."""
        path = Path(path)
        meta = dataset_io.read_meta(path)
        shards = dataset_io.verify_shards(path, meta, hashes=verify)
        return cls(path, meta, dataset_io.read_schema(shards[0]))

    @property
    def shards(self) -> list[Path]:
        return dataset_io.shard_paths(self.path, self.meta)

    @property
    def rows(self) -> int:
        return int(self.meta["rows"])


def merge_datasets(base: str | Path, add: str | Path, output: str | Path | None = None, in_place: bool = False,
                   dedup: Dedup = "none", shard_rows: int | None = None, backup_dir: str | Path | None = None,
                   progress: bool = True, force: bool = False) -> MergeSummary:
    """Merge `add` into `base`, writing `output` (a new path; an existing merged dataset there only
    with `force`, kept as a backup) or replacing `base` (`in_place`). Both inputs are verified
    (every shard's size and sha256) before anything is written."""
    from launcher_core.diskfull import disk_full_guard, tree_bytes

    started = time.perf_counter()
    target, plan = _target_path(Path(base), Path(add), output, in_place, dedup, force)
    folder = Path(backup_dir) if backup_dir else Path(base).parent
    removed = [*publish.sweep_stale_staging(Path(base)), *publish.sweep_stale_staging(target),
               *sweep_backup_copies(Path(base), folder)]
    # in place, the verified backup copy checks the base's sha256 (one read instead of two)
    base_set, add_set = DatasetOnDisk.open(base, verify=not in_place), DatasetOnDisk.open(add)
    problems = compatibility_problems(base_set, add_set)
    if problems:
        raise DataError(f"cannot merge {add_set.path} into {base_set.path}: " + "; ".join(problems))
    summary = MergeSummary(str(target), base_set.rows, add_set.rows, dedup)
    summary.notes += [f"removed {path}: left behind by an interrupted merge or tokenize (a partial copy)" for path in removed]
    needed = (tree_bytes(base_set.path) if in_place else 0) + tree_bytes(base_set.path) + tree_bytes(add_set.path)
    if in_place:
        with disk_full_guard(folder, needed, "the backup of the base (then the merged dataset)"):
            summary.backup = str(backup_dataset(base_set, Path(backup_dir) if backup_dir else None, progress))
    keep = duplicate_filter(base_set, add_set, dedup)
    with disk_full_guard(target, needed, "the merged dataset"):
        staging = publish.new_staging(target, "merge")
        try:
            _write_merged(base_set, add_set, keep, staging, shard_rows, summary, progress)
            _publish(staging, target, in_place, plan)
            if plan is not None and plan.backup is not None:
                summary.replaced = str(plan.backup)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    summary.seconds = time.perf_counter() - started
    return summary


def sweep_backup_copies(base: Path, folder: Path) -> list[Path]:
    """`.BASE.backup-<time>.copy-PID` directories whose process is gone: the partial backup copy of
    a merge --in-place that was killed while copying (the base itself was never touched)."""
    import re

    from launcher_core.processes import process_alive

    pattern = re.compile(rf"^\.{re.escape(base.name)}\.backup-[^/]+\.copy-(\d+)$")
    removed = []
    for entry in sorted(folder.glob(f".{base.name}.backup-*.copy-*")) if folder.is_dir() else []:
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not process_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _target_path(base: Path, add: Path, output: str | Path | None, in_place: bool, dedup: str,
                 force: bool) -> tuple[Path, OutputPlan | None]:
    """(the path written, the OutputPlan of --output; None in place)."""
    from launcher_core.outputs import DATASET, prepare_output

    if dedup not in DEDUP_CHOICES:
        raise ConfigError(f"--dedup {dedup!r}: valid choices: {', '.join(DEDUP_CHOICES)}")
    if in_place == (output is not None):
        raise ConfigError("merge needs exactly one of --output DATASET or --in-place")
    if output is None:      # in place
        return base, None
    plan = prepare_output(Path(output), DATASET, inputs=(base, add), force=force)
    return plan.path, plan


def compatibility_problems(base: DatasetOnDisk, add: DatasetOnDisk) -> list[str]:
    """Every reason the two datasets cannot be merged, each naming the field and both values."""
    problems = []
    if base.path.resolve() == add.path.resolve():
        problems.append("--base and --add are the same dataset")
    base_types = {f.name: f.type for f in base.schema}
    add_types = {f.name: f.type for f in add.schema}
    for name in base_types.keys() - add_types.keys():
        problems.append(f"column {name!r} is only in the base")
    for name in add_types.keys() - base_types.keys():
        problems.append(f"column {name!r} is only in the added dataset")
    for name in base_types.keys() & add_types.keys():
        if base_types[name] != add_types[name]:
            problems.append(f"column {name!r} has dtype {base_types[name]} in the base but {add_types[name]} in the added dataset")
    if list(base_types) != list(add_types) and base_types.keys() == add_types.keys():
        problems.append(f"columns are in a different order: {list(base_types)} vs {list(add_types)}")
    for key, label in (("fingerprint", "tokenizer fingerprint"), ("chat_template_fingerprint", "chat-template fingerprint")):
        left, right = base.meta["tokenizer"].get(key), add.meta["tokenizer"].get(key)
        if left != right:
            problems.append(f"{label} differs (base {str(left)[:12]}..., added {str(right)[:12]}...; "
                            f"tokenizers {base.meta['tokenizer'].get('path')} vs {add.meta['tokenizer'].get('path')})")
    if base.meta.get("max_length") != add.meta.get("max_length"):
        problems.append(f"max_length differs: base {base.meta.get('max_length')}, added {add.meta.get('max_length')}")
    return problems


# --- backup -------------------------------------------------------------------------------------

def backup_dataset(dataset: DatasetOnDisk, backup_dir: Path | None, progress: bool) -> Path:
    """Copy the dataset to `NAME.backup-<time>`; every shard's copy must match the recorded sha256
    and the copy's row count the recorded rows, else nothing is merged."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = (backup_dir or dataset.path.parent) / f"{dataset.path.name}.backup-{stamp}"
    staging = publish.new_staging(target, "copy")
    try:
        _copy_verified(dataset, staging, progress)
        rows = count_rows(staging, dataset.meta)
        if rows != dataset.rows:
            raise DataError(f"backup of {dataset.path} holds {rows} rows, the base records {dataset.rows}; nothing merged")
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _copy_verified(dataset: DatasetOnDisk, staging: Path, progress: bool) -> None:
    from tqdm import tqdm

    recorded = {shard["filename"]: shard["sha256"] for shard in dataset.meta["shards"]}
    files = sorted(p for p in dataset.path.iterdir() if p.is_file())
    with tqdm(total=sum(p.stat().st_size for p in files), unit="B", unit_scale=True, desc="backup",
              disable=not progress, mininterval=1.0) as bar:
        for source in files:
            copied = _copy_file(source, staging / source.name, bar)
            expected = recorded.get(source.name)
            if expected and copied != expected:
                raise DataError(f"{source} does not match the sha256 in {dataset_io.META_NAME}: the base "
                                "changed or is corrupt; nothing merged (restore it from a backup)")
            if expected and dataset_io.file_sha256(staging / source.name) != expected:
                raise DataError(f"backup copy of {source} does not match its recorded sha256; nothing merged")


def _copy_file(source: Path, target: Path, bar: tqdm) -> str:
    import os

    digest = hashlib.sha256()
    with source.open("rb") as reader, target.open("wb") as writer:
        while block := reader.read(COPY_CHUNK):
            digest.update(block)
            writer.write(block)
            bar.update(len(block))
        writer.flush()
        os.fsync(writer.fileno())
    return digest.hexdigest()


def count_rows(directory: Path, meta: DatasetMeta) -> int:
    return sum(batch.num_rows for shard in dataset_io.shard_paths(directory, meta)
               for batch in dataset_io.iter_batches(shard, ["length"], mapped=True))


# --- de-duplication -------------------------------------------------------------------------------

def duplicate_filter(base: DatasetOnDisk, add: DatasetOnDisk, dedup: str) -> np.ndarray | None:
    """Boolean keep-mask over the added rows (None: keep all). A row is dropped when its key is in
    the base or earlier in the added dataset. Keys are 8-byte hashes: 8 bytes of memory per row."""
    if dedup == "none":
        return None
    base_keys = np.unique(np.concatenate(list(_keys(base, dedup)) or [np.empty(0, np.uint64)]))
    add_keys = np.concatenate(list(_keys(add, dedup)) or [np.empty(0, np.uint64)])
    keep = ~np.isin(add_keys, base_keys, assume_unique=False)
    first = np.zeros(len(add_keys), dtype=bool)
    first[np.unique(add_keys, return_index=True)[1]] = True
    return keep & first


def _keys(dataset: DatasetOnDisk, dedup: str) -> Iterator[np.ndarray]:
    column = "id" if dedup == "id" else "input_ids"
    for shard in dataset.shards:  # token lists are read batch by batch, not mapped: RSS stays flat
        for batch in dataset_io.iter_batches(shard, [column], mapped=dedup == "id"):
            yield _id_keys(batch.column(0)) if dedup == "id" else _content_keys(batch.column(0))


def _hash8(data: bytes | memoryview) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _id_keys(ids: pa.StringArray) -> np.ndarray:
    return np.fromiter((_hash8(value.encode()) for value in ids.to_pylist()), dtype=np.uint64, count=len(ids))


def _content_keys(lists: pa.ListArray) -> np.ndarray:
    offsets = dataset_io.numpy_of(lists.offsets)
    values = dataset_io.numpy_of(lists.values)
    return np.fromiter((_hash8(values[offsets[i]: offsets[i + 1]].data) for i in range(len(lists))),
                       dtype=np.uint64, count=len(lists))


# --- the merged dataset -----------------------------------------------------------------------------

def _write_merged(base: DatasetOnDisk, add: DatasetOnDisk, keep: np.ndarray | None, staging: Path,
                  shard_rows: int | None, summary: MergeSummary, progress: bool) -> None:
    from tqdm import tqdm

    rows = shard_rows or max(shard["rows"] for shard in base.meta["shards"]) or 20000
    writer = dataset_io.ShardWriter(staging, base.schema, rows)
    expected = Totals()
    total_bytes = sum(p.stat().st_size for p in base.shards + add.shards)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="merge", disable=not progress, mininterval=1.0) as bar:
        try:
            read_base = _stream(base, None, writer, expected, bar)
            read_add = _stream(add, keep, writer, expected, bar)
            shards = writer.close()
        except BaseException:
            writer.abandon()
            raise
    summary.dropped_duplicates = read_base.rows + read_add.rows - expected.rows
    summary.dropped_tokens = read_base.tokens + read_add.tokens - expected.tokens
    verify_written(staging, shards, expected)
    dataset_io.finalize_dataset(staging, shards, base.schema, merged_meta(base, add, summary))
    summary.rows, summary.tokens, summary.loss_tokens = expected.rows, expected.tokens, expected.loss_tokens


@dataclass
class Totals:
    rows: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows
        self.tokens += int(dataset_io.numpy_of(batch.column("length")).sum(dtype=np.int64))
        self.loss_tokens += int(dataset_io.numpy_of(batch.column("num_loss_tokens")).sum(dtype=np.int64))


def _stream(dataset: DatasetOnDisk, keep: np.ndarray | None, writer: dataset_io.ShardWriter, totals: Totals,
            bar: tqdm) -> Totals:
    """Copy a dataset's record batches into `writer`, filtered by `keep`; one batch in memory.
    Returns the totals read (before filtering); `totals` accumulates what was written."""
    read, position = Totals(), 0
    for shard in dataset.shards:
        for batch in dataset_io.iter_batches(shard):
            read.add(batch)
            if keep is not None:
                batch = batch.filter(dataset_io.arrow_bool_mask(keep[position: position + batch.num_rows]))
                position = read.rows
            totals.add(batch)
            writer.write(batch)
        bar.update(shard.stat().st_size)
    if read.rows != dataset.rows:
        raise DataError(f"{dataset.path} holds {read.rows} rows but its {dataset_io.META_NAME} records "
                        f"{dataset.rows}; the dataset is damaged, nothing merged")
    return read


def verify_written(staging: Path, shards: list[dataset_io.ShardInfo], expected: Totals) -> None:
    """Re-read the written shards from disk: rows, tokens and loss tokens must equal the sums."""
    found = Totals()
    for shard in shards:
        for batch in dataset_io.iter_batches(staging / shard.filename, ["length", "num_loss_tokens"], mapped=True):
            found.add(batch)
    if found != expected:
        raise DataError(f"merged dataset verification failed: wrote {found}, expected {expected}; "
                        "nothing was replaced")


def merged_meta(base: DatasetOnDisk, add: DatasetOnDisk, summary: MergeSummary) -> DatasetMeta:
    by_reason: dict[str, int] = {}
    no_rejects: RejectsEntry = {"total": 0, "by_reason": {}, "file": None}
    for meta in (base.meta, add.meta):
        for reason, count in meta.get("rejects", no_rejects).get("by_reason", {}).items():
            by_reason[reason] = by_reason.get(reason, 0) + count
    event: dict[str, object] = {"merged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base": str(base.path), "base_rows": base.rows,
             "add": str(add.path), "add_rows": add.rows, "dedup": summary.dedup,
             "dropped_duplicates": summary.dropped_duplicates, "backup": summary.backup}
    merged: DatasetMeta = {"tokenizer": base.meta["tokenizer"], "max_length": base.meta.get("max_length"),
            "settings": base.meta.get("settings", {}),
            "sources": base.meta.get("sources", []) + add.meta.get("sources", []),
            "rejects": {"total": sum(by_reason.values()), "by_reason": by_reason, "file": None},
            "created_at": base.meta.get("created_at"),
            "history": base.meta.get("history", []) + add.meta.get("history", []) + [event]}
    rendering = merged_rendering(base.meta.get("rendering"), add.meta.get("rendering"))
    if rendering is not None:      # none when either dataset predates the block
        merged["rendering"] = rendering
    return merged


def _publish(staging: Path, target: Path, in_place: bool, plan: OutputPlan | None) -> None:
    if in_place or plan is None:
        publish.publish_directory(staging, target)
        return
    if plan.replaces or (target.is_dir() and not any(target.iterdir())):
        publish.publish_directory(staging, target, plan.backup)
        return
    if target.exists():
        raise InputError(f"{target} appeared while merging; the merged dataset is not published")
    staging.rename(target)
