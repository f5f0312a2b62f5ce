"""Reading completions JSONL for tokenize: non-blank lines numbered from 1, each file hashed as
it is read; undecodable or over-long lines become a Reject before anything parses them."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, TypeVar

from dflash.data.conversations import Reject

if TYPE_CHECKING:
    from _hashlib import HASH

    from dflash.data.meta import SourceEntry

Item = TypeVar("Item")
# A JSONL line longer than this many bytes per token of max_length is rejected before it is parsed
# or rendered (reason `record_too_long`): BPE tokens cover about 3-5 bytes of text (under 10 even
# for escaped non-ASCII JSON), so such a record would lose most of itself to truncation, and
# rendering and tokenizing it whole costs memory out of all proportion (10 MB: 1.7 GB RSS).
RECORD_BYTES_PER_TOKEN = 64


def record_byte_limit(max_length: int) -> int:
    """The longest JSONL line (bytes) tokenize renders: RECORD_BYTES_PER_TOKEN x data.max_length."""
    return RECORD_BYTES_PER_TOKEN * max_length


@dataclass(frozen=True)
class Line:
    source: str
    number: int
    text: str


@dataclass
class SourceFile:
    """An input file, hashed as it is read."""

    path: Path
    records: int = 0
    bytes: int = 0
    digest: HASH = field(default_factory=hashlib.sha256)

    def describe(self) -> SourceEntry:
        return {"path": str(self.path), "bytes": self.bytes, "records": self.records,
                "sha256": self.digest.hexdigest()}


def read_lines(source: SourceFile, max_bytes: int | None = None) -> Iterator[Line | Reject]:
    """Non-blank lines of a JSONL file, numbered from 1; undecodable bytes, and lines over
    `max_bytes`, become a Reject (before anything parses or renders them)."""
    with source.path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            source.digest.update(raw)
            source.bytes += len(raw)
            if not raw.strip():
                continue
            source.records += 1
            if max_bytes is not None and len(raw) > max_bytes:
                yield Reject(str(source.path), number, "record_too_long",
                             f"{len(raw):,} bytes, over the limit of {max_bytes:,} "
                             f"({RECORD_BYTES_PER_TOKEN} x data.max_length); not rendered")
                continue
            try:
                yield Line(str(source.path), number, raw.decode("utf-8"))
            except UnicodeDecodeError as error:
                yield Reject(str(source.path), number, "invalid_json", f"not UTF-8: {error.reason}")
    if source.records == 0:
        yield Reject(str(source.path), 0, "empty_file", "the file holds no records")


def chunked(items: Iterable[Item], size: int) -> Iterator[list[Item]]:
    chunk: list[Item] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
