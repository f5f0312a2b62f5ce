"""Completions JSONL -> tokenized Arrow dataset (`launcher.py tokenize`).

Each conversation is rendered with the target's chat template (a few renderings, see
`dflash.data.chat_render`), the full text is tokenized ONCE with offsets, and the loss mask is set
from the character spans (`dflash.data.samples`). Work is split into chunks of lines
(`dflash.data.sources` reads them) handled by worker processes; the results come back in input
order, so the dataset is identical whatever the number of workers.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from dflash.data.conversations import Reject, RejectsFile
from dflash.data.rendering_record import RenderingTally, chat_template_fingerprint
from dflash.data.samples import LineResult, SampleTokenizer, TokenizedSample, TokenizeSettings, samples_to_batch
from dflash.data.sources import Line, SourceFile, chunked, read_lines, record_byte_limit
from dflash.tokenizer import load_tokenizer, tokenizer_dir_for
from launcher_core.errors import DataError, InputError
from launcher_core.schema import Profile

if TYPE_CHECKING:
    import pyarrow as pa
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerFast

    from dflash.data.dataset_io import ShardWriter
    from dflash.data.inspect import InspectReport
    from dflash.data.meta import DatasetMeta, TokenizerIdentity

InputPaths = str | Path | Sequence[str | Path]
CHUNK_LINES = 32
BATCH_ROWS = 256


@dataclass(frozen=True)
class DegenerateThresholds:
    """The profile's data.* limits on degenerate samples, recorded in the dataset's settings."""

    min_loss_tokens: int
    tool_call_repeat_limit: int
    max_degenerate_share: float


@dataclass
class TokenizeSummary:
    """What `tokenize_completions` did; also recorded in the manifest's "tokenize" stage."""

    output: str
    rejects_path: str
    sources: list[str]
    records: int = 0
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated_samples: int = 0
    rewritten_turns: int = 0
    backup: str | None = None        # --force: where the dataset it replaced was kept
    rejects: dict[str, int] = field(default_factory=dict)
    degenerate_share: float = 0.0
    degenerate: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    rejects_by_source: dict[tuple[str, str], int] = field(default_factory=dict)   # (input file, reason) -> count

    @property
    def rejected(self) -> int:
        return sum(self.rejects.values())

    def manifest_figures(self) -> dict[str, object]:
        return {"samples": self.samples, "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "degenerate_share": round(self.degenerate_share, 6), "degenerate": self.degenerate,
                "rejects": self.rejected, "rejects_by_reason": self.rejects, "dataset": self.output}


# --- the worker processes ---------------------------------------------------------------------

_WORKER: SampleTokenizer | None = None


def _set_worker(worker: SampleTokenizer) -> None:
    global _WORKER
    _WORKER = worker


def _process_chunk(lines: list[Line]) -> list[LineResult]:
    assert _WORKER is not None, "worker not initialised"
    return [_WORKER.process_line(line) for line in lines]


# --- the orchestration ------------------------------------------------------------------------

def tokenize_completions(profile: Profile, input_path: InputPaths | None = None,
                         output_path: str | Path | None = None, workers: int | None = None,
                         allow_degenerate: bool = False, run_dir: str | Path | None = None,
                         progress: bool = True, force: bool = False) -> TokenizeSummary:
    """Tokenize completions into a dataset at `output_path` (default: the profile's paths).

    The output path follows `launcher_core.outputs` (checked before any work): an existing dataset
    there is replaced only with `force` (and kept as `NAME.backup-<time>`); anything else is refused.

    Raises InputError when nothing usable is in the input, DataError when more than
    `data.max_degenerate_share` of the records and samples are rejected or degenerate (unless `allow_degenerate`):
    the file with the most rejects named with what was likely wrong (a prompts file given for completions).
    With `run_dir`, the manifest's "tokenize" stage records the state and the figures.
    """
    from launcher_core.manifest import update_stage

    job = TokenizeJob.from_profile(profile, input_path, output_path, workers, allow_degenerate, progress, force)
    if run_dir is not None:
        update_stage(run_dir, "tokenize", "running", dataset=str(job.output))
    try:
        summary = job.run()
    except BaseException as error:
        if run_dir is not None:
            update_stage(run_dir, "tokenize", "failed", error=str(error) or type(error).__name__)
        raise
    if run_dir is not None:
        update_stage(run_dir, "tokenize", "done", **summary.manifest_figures())
    return summary


@dataclass
class TokenizeJob:
    inputs: list[Path]
    output: Path
    tokenizer_dir: Path
    settings: TokenizeSettings
    shard_rows: int
    workers: int
    allow_degenerate: bool
    progress: bool
    thresholds: DegenerateThresholds
    backup: Path | None = None       # where an existing dataset at `output` goes (--force)
    consumed_bytes: int = 0          # input behind the batches written so far (the disk-full estimate)
    written_bytes: int = 0           # bytes of those batches
    pending_bytes: int = 0           # input read since the last batch
    rendering: RenderingTally = field(default_factory=RenderingTally)   # the meta's `rendering` block

    @classmethod
    def from_profile(cls, profile: Profile, input_path: InputPaths | None, output_path: str | Path | None,
                     workers: int | None,
                     allow_degenerate: bool, progress: bool, force: bool = False) -> "TokenizeJob":
        from launcher_core.outputs import DATASET, prepare_output
        from launcher_core.profile import expand_path

        inputs = _input_paths(profile, input_path)
        output = Path(output_path) if output_path else expand_path(profile, profile.paths.dataset)
        plan = prepare_output(output, DATASET, inputs=inputs, force=force)
        data = profile.data
        settings = TokenizeSettings(data.max_length, _thinking_default(profile), data.rewritten_turns)
        thresholds = DegenerateThresholds(data.min_loss_tokens, data.tool_call_repeat_limit, data.max_degenerate_share)
        from envcheck.host import cpu_count

        count = workers or data.num_workers or cpu_count()
        return cls(inputs, output, tokenizer_dir_for(profile), settings, data.shard_rows, max(1, count),
                   allow_degenerate, progress, thresholds, plan.backup)

    @property
    def rejects_path(self) -> Path:
        return self.output.with_name(self.output.name + ".rejects.jsonl")

    def run(self) -> TokenizeSummary:
        from dflash.data import publish
        from launcher_core.diskfull import disk_full_guard

        started = time.perf_counter()
        tokenizer = load_tokenizer(self.tokenizer_dir)
        staging = publish.new_staging(self.output, "tokenize")
        needed: list[int] = []
        with disk_full_guard(self.output, lambda: needed[0] if needed else None, "the tokenized dataset"):
            try:
                summary = self._write(tokenizer, staging)
                summary.seconds = time.perf_counter() - started
                publish.publish_directory(staging, self.output, self.backup)
            except BaseException:
                needed.append(self.bytes_needed(staging))
                raise
            finally:
                import shutil

                shutil.rmtree(staging, ignore_errors=True)    # before the free space is measured
        summary.backup = str(self.backup) if self.backup else None
        return summary

    def bytes_needed(self, staging: Path) -> int:
        """The whole dataset's size: the bytes of the batches written so far, scaled from the input
        they came from to the whole input (the staging's size when no batch was written yet)."""
        from launcher_core.diskfull import tree_bytes

        total = sum(p.stat().st_size for p in self.inputs)
        if not self.consumed_bytes:
            return tree_bytes(staging)
        return int(self.written_bytes * total / min(self.consumed_bytes, total))

    def _write(self, tokenizer: PreTrainedTokenizerFast, staging: Path) -> TokenizeSummary:
        from dflash.data import dataset_io
        from dflash.data.inspect import inspect_dataset

        sources = [SourceFile(path) for path in self.inputs]
        summary = TokenizeSummary(str(self.output), str(self.rejects_path), [str(p) for p in self.inputs])
        writer = dataset_io.ShardWriter(staging, dataset_io.dataset_schema(), self.shard_rows)
        with RejectsFile(self.rejects_path, staging) as rejects:
            try:
                self._consume(self._results(tokenizer, sources), writer, rejects, summary)
                shards = writer.close()
            except BaseException:
                writer.abandon()
                raise
        dataset_io.finalize_dataset(staging, shards, dataset_io.dataset_schema(),
                                    self._meta(tokenizer, sources, summary))
        report = inspect_dataset(staging, verify=False)   # its shards were hashed as they were written
        summary.degenerate_share, summary.degenerate = report.degenerate_share, dict(report.degenerate)
        self._check_usable(summary, report)
        return summary

    def _results(self, tokenizer: PreTrainedTokenizerFast,
                 sources: list[SourceFile]) -> Iterator[tuple[Line | Reject, LineResult]]:
        """(line, result) in input order; results from a pool of workers when workers > 1."""
        worker = SampleTokenizer(tokenizer, self.settings)
        limit = record_byte_limit(self.settings.max_length)
        lines = (item for source in sources for item in read_lines(source, limit))
        chunks = chunked(lines, CHUNK_LINES)
        bar = _progress_bar(self.progress, sum(p.stat().st_size for p in self.inputs), sources)
        for chunk, results in _map_chunks(worker, chunks, self.workers):
            bar.update(sum(len(item.text) for item in chunk if isinstance(item, Line)))
            yield from zip(chunk, results)
        bar.close()

    def _consume(self, results: Iterable[tuple[Line | Reject, LineResult]], writer: ShardWriter,
                 rejects: RejectsFile, summary: TokenizeSummary) -> None:
        seen: set[int] = set()
        buffer = SampleBuffer()
        for line, result in results:
            summary.records += 1
            self.pending_bytes += len(line.text) if isinstance(line, Line) else 0
            if isinstance(result, list) and _id_key(result[0].record_id) in seen:
                assert isinstance(line, Line), "a line rejected while reading is its own result"
                result = Reject(line.source, line.number, "duplicate_id", "this id appeared earlier",
                                result[0].record_id)
            if isinstance(result, Reject):
                rejects.add(result)
                continue
            seen.add(_id_key(result[0].record_id))
            self.rendering.add(result[0].thinking, result[0].sampling)
            summary.rewritten_turns += len(result) - 1
            for sample in result:
                buffer.add(sample, summary)
            if len(buffer) >= BATCH_ROWS:
                self._write_batch(writer, buffer.take())
        if len(buffer):
            self._write_batch(writer, buffer.take())
        summary.rejects = dict(sorted(rejects.counts.items()))
        summary.rejects_by_source = dict(rejects.by_source)

    def _write_batch(self, writer: ShardWriter, batch: pa.RecordBatch) -> None:
        """Write a batch, counting the input it came from and its bytes (the disk-full estimate)."""
        self.consumed_bytes, self.written_bytes = self.consumed_bytes + self.pending_bytes, self.written_bytes + batch.nbytes
        self.pending_bytes = 0
        writer.write(batch)

    def _meta(self, tokenizer: PreTrainedTokenizerFast, sources: list[SourceFile],
              summary: TokenizeSummary) -> DatasetMeta:
        identity = tokenizer_identity(tokenizer, self.tokenizer_dir)
        return {"tokenizer": identity, "max_length": self.settings.max_length,
                "settings": {**asdict(self.settings), **asdict(self.thresholds)},
                "rendering": self.rendering.block(identity["chat_template_fingerprint"]),
                "sources": [source.describe() for source in sources],
                "rejects": {"total": summary.rejected, "by_reason": summary.rejects, "file": self.rejects_path.name},
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "history": []}

    def _check_usable(self, summary: TokenizeSummary, report: InspectReport) -> None:
        if summary.samples == 0:
            reasons = ", ".join(f"{k}={v}" for k, v in summary.rejects.items()) or "no records"
            raise InputError(f"no usable records in {', '.join(summary.sources)} ({reasons}); "
                             f"see {summary.rejects_path}")
        limit = self.thresholds.max_degenerate_share
        empty_files = summary.rejects.get("empty_file", 0)
        unusable = UnusableShare(summary.rejected - empty_files, summary.records - empty_files,
                                 report.degenerate_samples, report.samples)
        if unusable.share <= limit or self.allow_degenerate:
            return
        if not unusable.rejected:
            raise DataError(f"{report.degenerate_share:.1%} of the {report.samples} samples are degenerate "
                            f"(limit data.max_degenerate_share = {limit:.1%}): {report.degenerate_summary()}. "
                            "Fix the generation, or pass --allow-degenerate to write the dataset anyway.")
        raise DataError(f"{rejects_cause(summary.rejects_by_source)}; {unusable.describe()} (limit "
                        f"data.max_degenerate_share = {limit:.1%}); each reject in {summary.rejects_path}. Nothing "
                        f"was written at {summary.output}; pass --allow-degenerate to write the dataset anyway.")


@dataclass(frozen=True)
class UnusableShare:
    """What the degenerate gate holds against data.max_degenerate_share: rejected records and degenerate samples
    together, of every record rejected and every sample written (an empty input file is no record)."""

    rejected: int
    records: int
    degenerate: int
    samples: int

    @property
    def share(self) -> float:
        return (self.rejected + self.degenerate) / max(1, self.rejected + self.samples)

    def describe(self) -> str:
        return (f"{self.rejected} of the {self.records} records rejected and {self.degenerate} of the {self.samples} "
                f"samples degenerate: {self.share:.1%} unusable")


# A reject reason that dominates a file -> what was likely wrong with the file.
LIKELY_CAUSES = {
    "no_assistant_turn": "its records hold no assistant answer: it looks like a prompts file (what `generate` reads), "
                         "not the completions `generate` writes (paths.completions, or --input FILE)",
    "missing_messages": "its records have no `messages`: it is not a completions file (what `generate` writes)",
    "invalid_json": "it is not JSONL (one JSON object a line)",
    "not_an_object": "its lines are JSON but not objects: it is not a completions file",
    "template_error": "the chat template of the profile's tokenizer (model.tokenizer) does not fit its records",
    "template_inconsistent": "the chat template of the profile's tokenizer (model.tokenizer) does not fit its records",
    "template_drops_fields": "the chat template of the profile's tokenizer (model.tokenizer) does not fit its records",
    "record_too_long": "its records are longer than data.max_length allows (raise data.max_length)",
    "duplicate_id": "its ids repeat: the same completions given twice?",
}


def rejects_cause(by_source: dict[tuple[str, str], int]) -> str:
    """`FILE: N records rejected, most for REASON (what it means): what was likely wrong`, for the input file
    with the most rejects."""
    from collections import Counter

    from dflash.data.conversations import REJECT_REASONS

    per_file: Counter[str] = Counter()
    for (source, _), count in by_source.items():
        per_file[source] += count
    source, count = per_file.most_common(1)[0]
    reason = max((r for s, r in by_source if s == source), key=lambda r: by_source[(source, r)])
    likely = LIKELY_CAUSES.get(reason, REJECT_REASONS.get(reason, reason))
    return f"{source}: {count} record(s) rejected, {by_source[(source, reason)]} for {reason}: {likely}"


class SampleBuffer:
    """Collects samples and turns them into one Arrow record batch."""

    def __init__(self) -> None:
        self.samples: list[TokenizedSample] = []

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, sample: TokenizedSample, summary: TokenizeSummary) -> None:
        self.samples.append(sample)
        summary.samples += 1
        summary.tokens += len(sample.input_ids)
        summary.loss_tokens += int(sample.loss_mask.sum())
        summary.truncated_samples += bool(sample.truncated_tokens)

    def take(self) -> pa.RecordBatch:
        batch = samples_to_batch(self.samples)
        self.samples = []
        return batch


def _map_chunks(worker: SampleTokenizer, chunks: Iterator[list[Line | Reject]],
                workers: int) -> Iterator[tuple[list[Line | Reject], list[LineResult]]]:
    """(chunk, results) in order. Lines already rejected while reading pass through unchanged."""
    _set_worker(worker)
    if workers <= 1:
        for chunk in chunks:
            yield chunk, _process_mixed(chunk)
        return
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor

    # fork: workers inherit the loaded tokenizer; at most 2 chunks per worker are in flight. A
    # worker that dies (OOM kill) raises BrokenProcessPool here instead of hanging the run.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        pending: deque[tuple[list[Line | Reject], Future[list[LineResult]]]] = deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_process_mixed, chunk)))
            if len(pending) >= 2 * workers:
                done_chunk, future = pending.popleft()
                yield done_chunk, future.result()
        while pending:
            done_chunk, future = pending.popleft()
            yield done_chunk, future.result()


def _process_mixed(chunk: list[Line | Reject]) -> list[LineResult]:
    lines = [item for item in chunk if isinstance(item, Line)]
    results = iter(_process_chunk(lines))
    return [next(results) if isinstance(item, Line) else item for item in chunk]


def _progress_bar(enabled: bool, total: int, sources: list[SourceFile]) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not enabled, mininterval=1.0)


def _id_key(record_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(record_id.encode(), digest_size=8).digest(), "little")


def _input_paths(profile: Profile, input_path: InputPaths | None) -> list[Path]:
    from launcher_core.profile import expand_path

    if input_path is None:
        paths = [expand_path(profile, profile.paths.completions)]
    else:
        paths = [Path(input_path)] if isinstance(input_path, (str, Path)) else [Path(p) for p in input_path]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise InputError(f"completions file not found: {', '.join(missing)} "
                         "(run `launcher.py generate` first, or pass --input FILE)")
    return paths


def _thinking_default(profile: Profile) -> bool:
    return profile.generate.thinking


def tokenizer_identity(tokenizer: PreTrainedTokenizerFast, directory: Path) -> TokenizerIdentity:
    """Fingerprints a merge compares: the vocabulary + special tokens, and the chat template."""
    return {"path": str(directory), "class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
            "fingerprint": _vocab_fingerprint(tokenizer),
            "chat_template_fingerprint": chat_template_fingerprint(tokenizer)}


def _vocab_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    cached = getattr(tokenizer, "_dflash_vocab_fingerprint", None)
    if cached is None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
        cached = hashlib.sha256((vocab + specials).encode()).hexdigest()
        tokenizer._dflash_vocab_fingerprint = cached
    return cached
