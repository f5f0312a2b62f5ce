"""The shape of a dataset's dflash_meta.json (written by tokenize and merge, read by inspect,
merge and the trainer): what each key holds. It stays JSON on disk; `dataset_io.read_meta`
checks the keys the readers rely on before handing it out as a `DatasetMeta`."""
from __future__ import annotations

from typing import TypedDict

from dflash.data.rendering_record import RenderingBlock

# `class` is a keyword, hence the functional form.
TokenizerIdentity = TypedDict("TokenizerIdentity", {
    "path": str,                        # the tokenizer directory it was loaded from
    "class": str,
    "vocab_size": int,
    "fingerprint": str,                 # sha256 of the vocabulary and the special tokens
    "chat_template_fingerprint": str,   # sha256 of the chat template
}, total=False)


class SourceEntry(TypedDict):
    """One completions file tokenize read."""

    path: str
    bytes: int
    records: int
    sha256: str


class RejectsEntry(TypedDict):
    total: int
    by_reason: dict[str, int]
    file: str | None                    # the rejects file's name next to the dataset (None after a merge)


class ShardEntry(TypedDict):
    """One Arrow shard (`dataset_io.ShardInfo` as JSON)."""

    filename: str
    rows: int
    tokens: int
    loss_tokens: int
    bytes: int
    sha256: str


class DatasetMeta(TypedDict, total=False):
    format: str                         # dataset_io.META_FORMAT
    tokenizer: TokenizerIdentity
    max_length: int | None
    settings: dict[str, object]         # TokenizeSettings and the degenerate thresholds at tokenize time
    rendering: RenderingBlock           # how the completions were rendered (absent in datasets written before it)
    sources: list[SourceEntry]
    rejects: RejectsEntry
    created_at: str | None
    history: list[dict[str, object]]    # one entry per merge: what went in, what was dropped
    shards: list[ShardEntry]            # added by dataset_io.finalize_dataset
    rows: int
    tokens: int
    loss_tokens: int
