"""The dataset on disk: Arrow IPC shards in the layout `datasets.save_to_disk` writes.

    DATASET/data-00000-of-00003.arrow ...   Arrow IPC streams (what `datasets.load_from_disk` maps)
    DATASET/state.json, dataset_info.json   the files `load_from_disk` reads
    DATASET/dflash_meta.json                tokenizer + chat-template fingerprints, max_length,
                                            sources, per-shard rows/tokens/sha256, rejects, history

Shards are written record batch by record batch (memory stays bounded whatever the size), each
shard's sha256 computed as it is written. Datasets are built in a staging directory next to the
final path and renamed into place (`dflash.data.publish`).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence, cast

from dflash.data.meta import DatasetMeta, ShardEntry
from launcher_core.errors import DataError, InputError
from launcher_core.fileio import read_json_object, write_json_atomic

META_NAME = "dflash_meta.json"
META_FORMAT = "dflash-dataset/1"
# Fault injection for the kill-safety tests (documented in docs/data.md): seconds to sleep after
# each shard is closed, so a test can SIGKILL a merge or tokenize while it is half written.
SHARD_DELAY_ENV = "DFLASH_TEST_SHARD_DELAY_S"

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


def column_types() -> dict[str, pa.DataType]:
    """Column -> Arrow type of a tokenized dataset (the contract the trainer and merge rely on)."""
    import pyarrow as pa

    return {
        "id": pa.string(), "input_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.uint8()),
        "length": pa.int32(), "num_loss_tokens": pa.int32(), "finish_reason": pa.string(),
        "truncated": pa.bool_(), "truncated_tokens": pa.int32(), "tool_call_repeats": pa.int32(),
        "empty_reasoning": pa.bool_(),
    }


def dataset_schema() -> pa.Schema:
    import pyarrow as pa

    schema = pa.schema(list(column_types().items()))
    info = json.dumps({"info": {"features": features_of(schema)}})
    return schema.with_metadata({"huggingface": info})


def features_of(schema: pa.Schema) -> dict[str, dict[str, object]]:
    """`datasets` feature dicts for an Arrow schema of scalars and lists of scalars."""
    import pyarrow as pa

    def value(arrow_type: pa.DataType) -> dict[str, object]:
        name = "string" if arrow_type == pa.string() else "bool" if arrow_type == pa.bool_() else str(arrow_type)
        return {"dtype": name, "_type": "Value"}

    features: dict[str, dict[str, object]] = {}
    for column in schema:
        if pa.types.is_list(column.type):
            features[column.name] = {"feature": value(column.type.value_type), "_type": "List"}
        else:
            features[column.name] = value(column.type)
    return features


@dataclass(frozen=True)
class ShardInfo:
    filename: str
    rows: int
    tokens: int
    loss_tokens: int
    bytes: int
    sha256: str


class _HashingFile:
    """A write-only file that hashes what goes through it (pyarrow writes via `write`)."""

    def __init__(self, path: Path):
        self.handle = path.open("wb")
        self.digest = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        if not self.closed:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            self.closed = True

    def abandon(self) -> None:
        """Close without flushing what is buffered (a failed write: the file is removed after)."""
        if not self.closed:
            self.closed = True
            try:
                os.close(self.handle.fileno())     # the descriptor, not the buffered object: no flush
            except OSError:
                pass
            try:
                self.handle.close()
            except (OSError, ValueError):
                pass


class ShardWriter:
    """Writes record batches into shards of `shard_rows` rows; `close()` names them data-i-of-n."""

    def __init__(self, directory: Path, schema: pa.Schema, shard_rows: int):
        assert shard_rows > 0
        self.directory, self.schema, self.shard_rows = Path(directory), schema, shard_rows
        self.shards: list[ShardInfo] = []
        self._file: _HashingFile | None = None
        self._writer: pa.RecordBatchStreamWriter | None = None
        self._rows = self._tokens = self._loss_tokens = 0

    def write(self, batch: pa.RecordBatch) -> None:
        """Append a record batch (split across shards as needed)."""
        offset = 0
        while offset < batch.num_rows:
            if self._writer is None:
                self._open()
            take = min(batch.num_rows - offset, self.shard_rows - self._rows)
            self._write_part(batch.slice(offset, take))
            offset += take
            if self._rows >= self.shard_rows:
                self._close_shard()

    def abandon(self) -> None:
        """A failed write: let go of the open shard (its space is freed once the staging is removed,
        not when an exception's traceback lets go of this writer)."""
        if self._file is not None:
            self._file.abandon()
        self._writer = self._file = None

    def close(self) -> list[ShardInfo]:
        if self._writer is not None:
            self._close_shard()
        if not self.shards:  # an empty dataset still has one (empty) shard, as datasets writes it
            self._open()
            self._close_shard()
        return self._final_names()

    def _open(self) -> None:
        import pyarrow as pa

        self._file = _HashingFile(self.directory / f".shard-{len(self.shards):05d}.arrow")
        self._writer = pa.ipc.new_stream(self._file, self.schema)
        self._rows = self._tokens = self._loss_tokens = 0

    def _write_part(self, part: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        assert self._writer is not None, "a shard is open"
        self._writer.write_batch(part)
        self._rows += part.num_rows
        self._tokens += int(pc.sum(part.column("length")).as_py() or 0)
        self._loss_tokens += int(pc.sum(part.column("num_loss_tokens")).as_py() or 0)

    def _close_shard(self) -> None:
        assert self._writer is not None and self._file is not None, "a shard is open"
        self._writer.close()
        self._file.close()
        name = f".shard-{len(self.shards):05d}.arrow"
        self.shards.append(ShardInfo(name, self._rows, self._tokens, self._loss_tokens,
                                     self._file.size, self._file.digest.hexdigest()))
        self._writer = self._file = None
        _maybe_delay()

    def _final_names(self) -> list[ShardInfo]:
        final = []
        for index, shard in enumerate(self.shards):
            name = f"data-{index:05d}-of-{len(self.shards):05d}.arrow"
            os.replace(self.directory / shard.filename, self.directory / name)
            final.append(ShardInfo(name, shard.rows, shard.tokens, shard.loss_tokens, shard.bytes, shard.sha256))
        return final


def _maybe_delay() -> None:
    delay = float(os.environ.get(SHARD_DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def finalize_dataset(directory: Path, shards: list[ShardInfo], schema: pa.Schema, meta: DatasetMeta) -> None:
    """Write state.json, dataset_info.json and dflash_meta.json next to the shards."""
    meta = meta.copy()
    meta["format"], meta["shards"] = META_FORMAT, [cast(ShardEntry, asdict(shard)) for shard in shards]
    meta["rows"], meta["tokens"] = sum(s.rows for s in shards), sum(s.tokens for s in shards)
    meta["loss_tokens"] = sum(s.loss_tokens for s in shards)
    fingerprint = hashlib.sha256("".join(s.sha256 for s in shards).encode()).hexdigest()[:16]
    state: dict[str, object] = {"_data_files": [{"filename": s.filename} for s in shards], "_fingerprint": fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    info = {"citation": "", "description": "tokenized by launcher.py tokenize; see dflash_meta.json",
            "features": features_of(schema), "homepage": "", "license": ""}
    write_json_atomic(directory / "state.json", state)
    write_json_atomic(directory / "dataset_info.json", info)
    write_json_atomic(directory / META_NAME, meta)


def save_token_rows(path: Path, rows: Sequence[tuple[Sequence[int], Sequence[int]]], id_prefix: str = "row") -> Path:
    """(token ids, loss mask) rows as a small tokenized dataset with the columns `tokenize` writes,
    in `datasets.save_to_disk` form (tests, benchmarks, the calibration's worst case)."""
    import datasets

    columns = {"input_ids": [list(ids) for ids, _ in rows], "loss_mask": [list(mask) for _, mask in rows],
               "length": [len(ids) for ids, _ in rows], "num_loss_tokens": [int(sum(mask)) for _, mask in rows],
               "id": [f"{id_prefix}-{index}" for index in range(len(rows))]}
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return Path(path)


def read_meta(path: Path) -> DatasetMeta:
    """The dataset's dflash_meta.json; InputError if the directory is not a tokenized dataset or
    the file is unreadable (the message names it and the backup to restore)."""
    meta_path = Path(path) / META_NAME
    if not Path(path).is_dir():
        raise InputError(f"{path}: no such dataset directory")
    if not meta_path.exists():
        raise InputError(f"{path}: no {META_NAME}; not a dataset written by `launcher.py tokenize` or `merge`")
    try:
        meta = read_json_object(meta_path, f"the {META_NAME} of a dataset")
    except InputError as error:
        raise InputError(f"{error}; {restore_hint(Path(path))}") from None
    if meta.get("format") != META_FORMAT:
        raise InputError(f"{meta_path}: format {meta.get('format')!r}, expected {META_FORMAT!r}")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not all(_is_shard_entry(s) for s in shards):
        raise InputError(f"{meta_path}: `shards` is not a list of {{filename, rows, bytes, sha256}}; "
                         f"the file is damaged; {restore_hint(Path(path))}")
    return cast(DatasetMeta, meta)


def _is_shard_entry(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("filename"), str) and "/" not in entry["filename"]


def restore_hint(dataset: Path) -> str:
    """What to do about a damaged dataset: restore the newest backup next to it, or rebuild it."""
    from launcher_core.outputs import backups_of

    backups = backups_of(dataset)
    if backups:
        return f"restore it from the backup {backups[0]} (e.g. move the damaged one aside and rename the backup)"
    return "no backup of it was found next to it: rebuild it with `launcher.py tokenize` (or `merge`)"


def shard_paths(path: Path, meta: DatasetMeta) -> list[Path]:
    paths = [Path(path) / shard["filename"] for shard in meta["shards"]]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise DataError(f"{path}: shard files missing: {', '.join(missing)}; {restore_hint(Path(path))}")
    return paths


def verify_shards(path: Path, meta: DatasetMeta, hashes: bool = True) -> list[Path]:
    """The shard paths, after checking each one's size (always) and sha256 (`hashes`) against
    dflash_meta.json. A mismatch is a DataError naming the shard and the backup to restore."""
    paths = shard_paths(path, meta)
    for shard_path, shard in zip(paths, meta["shards"]):
        problem = _shard_problem(shard_path, shard, hashes)
        if problem:
            raise DataError(f"{shard_path}: {problem}; the dataset is damaged and was not used; "
                            f"{restore_hint(Path(path))}")
    return paths


def _shard_problem(shard_path: Path, shard: ShardEntry, hashes: bool) -> str:
    size = shard_path.stat().st_size
    recorded = shard.get("bytes")
    if isinstance(recorded, int) and size != recorded:
        return f"{size:,} bytes on disk, {recorded:,} recorded in {META_NAME} (truncated or overwritten)"
    if hashes and isinstance(shard.get("sha256"), str) and file_sha256(shard_path) != shard["sha256"]:
        return f"its sha256 does not match the one recorded in {META_NAME} (the bytes changed)"
    return ""


def read_schema(shard: Path) -> pa.Schema:
    import pyarrow as pa

    try:
        with pa.memory_map(str(shard)) as source:
            return pa.ipc.open_stream(source).schema
    except (OSError, pa.ArrowException) as error:
        raise _unreadable(shard, error) from None


def iter_batches(shard: Path, columns: list[str] | None = None, mapped: bool = False) -> Iterator[pa.RecordBatch]:
    """Record batches of one shard. `mapped`: zero-copy from a memory map (only touched columns are
    paged in); otherwise read batch by batch into memory that is freed after each batch. An
    unreadable shard (truncated, not Arrow) is a DataError naming it."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(shard)) if mapped else pa.OSFile(str(shard))
        with source:
            for batch in pa.ipc.open_stream(source):
                yield batch.select(columns) if columns else batch
    except (OSError, pa.ArrowException) as error:
        raise _unreadable(shard, error) from None


def _unreadable(shard: Path, error: BaseException) -> DataError:
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return DataError(f"{shard}: not a readable Arrow shard ({detail}); the dataset is damaged; "
                     f"{restore_hint(Path(shard).parent)}")


def numpy_of(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A null-free numeric or bool Arrow array (or a column of them) as numpy, zero-copy for numbers."""
    import numpy as np
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        return np.concatenate([numpy_of(chunk) for chunk in array.chunks] or [np.empty(0)])
    assert array.null_count == 0, "columns of a tokenized dataset have no nulls"
    data = array.buffers()[1]
    if pa.types.is_boolean(array.type):
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        return bits[array.offset: array.offset + len(array)].astype(bool)
    dtype = np.dtype(str(array.type))  # int8 ... uint64, float32, float64
    return np.frombuffer(data, dtype=dtype, count=array.offset + len(array))[array.offset:]


def arrow_bool_mask(mask: np.ndarray) -> pa.BooleanArray:
    """A numpy bool array as an Arrow BooleanArray, built from its packed bits (`pa.array` on numpy
    imports pandas: 40 MB and a second, once)."""
    import numpy as np
    import pyarrow as pa

    bits = np.packbits(np.asarray(mask, dtype=bool), bitorder="little")
    return pa.BooleanArray.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(bits.tobytes())])


def file_sha256(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
