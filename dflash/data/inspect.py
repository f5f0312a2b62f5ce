"""`launcher.py inspect DATASET`: sizes, a histogram of loss tokens per sample, degenerate samples.

Reads only the small per-sample columns, shard by shard from a memory map (the token lists are
never paged in). First every shard's size and sha256 are checked against dflash_meta.json (the
hashing reads each shard once; its cost per GB: benchmarks/results/integrity-sha256_cpu-2core_2026-12-01.md). Degenerate reasons:

    low_loss_tokens  fewer than data.min_loss_tokens loss tokens (the seeds' 6-token empty answers)
    finish_length    the generation hit max_tokens (finish_reason == "length")
    tool_call_loop   one identical <tool_call> block repeated >= data.tool_call_repeat_limit times in a turn
    empty_reasoning  thinking was on but a turn's reasoning is empty
    truncated        the sample was cut at max_length
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa


REASONS = ("low_loss_tokens", "finish_length", "tool_call_loop", "empty_reasoning", "truncated")
HISTOGRAM_EDGES = (0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
NUMERIC_COLUMNS = ["length", "num_loss_tokens", "truncated", "truncated_tokens", "tool_call_repeats", "empty_reasoning"]
SMALL_COLUMNS = ["id", "length", "num_loss_tokens", "finish_reason", "truncated", "truncated_tokens",
                 "tool_call_repeats", "empty_reasoning"]


@dataclass(frozen=True)
class InspectThresholds:
    """Below `min_loss_tokens` loss tokens, or `tool_call_repeat_limit` repeats of one tool call: degenerate."""

    min_loss_tokens: int = 16
    tool_call_repeat_limit: int = 8


@dataclass
class InspectReport:
    path: str
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated_tokens: int = 0
    max_length_seen: int = 0
    histogram: list[tuple[int, int | None, int]] = field(default_factory=list)  # (from, below, count)
    degenerate: dict[str, int] = field(default_factory=lambda: {reason: 0 for reason in REASONS})
    degenerate_samples: int = 0
    examples: dict[str, list[str]] = field(default_factory=lambda: {reason: [] for reason in REASONS})
    thresholds: InspectThresholds = field(default_factory=InspectThresholds)
    rendering: str | None = None     # how the completions were rendered (the meta's block, described)

    @property
    def degenerate_share(self) -> float:
        return self.degenerate_samples / self.samples if self.samples else 0.0

    def degenerate_summary(self) -> str:
        parts = [f"{reason}={count}" for reason, count in self.degenerate.items() if count]
        return ", ".join(parts) or "none"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "degenerate_share": self.degenerate_share}

    def format_text(self) -> str:
        lines = [f"dataset {self.path}",
                 f"  samples {self.samples:,}   tokens {self.tokens:,}   loss tokens {self.loss_tokens:,}"
                 f" ({self.loss_tokens / max(1, self.tokens):.1%})   longest {self.max_length_seen:,}",
                 "  loss tokens per sample:"]
        lines += _histogram_lines(self.histogram, self.samples)
        lines.append(f"  degenerate samples {self.degenerate_samples:,} ({self.degenerate_share:.1%}):")
        for reason in REASONS:
            shown = ", ".join(self.examples[reason])
            lines.append(f"    {reason:<16} {self.degenerate[reason]:>9,}" + (f"   e.g. {shown}" if shown else ""))
        lines.append("  thresholds: " + ", ".join(f"{k}={v}" for k, v in asdict(self.thresholds).items()))
        lines.append(f"  rendered {self.rendering or 'in a mode not recorded (written before the rendering block)'}")
        return "\n".join(lines)


def _histogram_lines(histogram: list[tuple[int, int | None, int]], samples: int) -> list[str]:
    widest = max((count for _, _, count in histogram), default=0) or 1
    lines = []
    for low, high, count in histogram:
        label = f"{low}" if high == low + 1 else f"{low}-{high - 1}" if high else f">={low}"
        bar = "#" * round(40 * count / widest)
        lines.append(f"    {label:>11} {count:>9,} {count / max(1, samples):6.1%} {bar}")
    return lines


def inspect_dataset(path: str | Path, min_loss_tokens: int | None = None, tool_call_repeat_limit: int | None = None,
                    examples: int = 5, verify: bool = True) -> InspectReport:
    """Statistics of a tokenized dataset. Thresholds default to those recorded at tokenize time.

    Each shard's size is checked against dflash_meta.json, and with `verify` its sha256 too: a
    damaged dataset is a DataError naming the shard and the backup to restore, not a report."""
    from dflash.data import dataset_io
    from dflash.data.rendering_record import describe_rendering

    path = Path(path)
    meta = dataset_io.read_meta(path)
    settings = meta.get("settings", {})
    thresholds = InspectThresholds(_int_setting(min_loss_tokens, settings.get("min_loss_tokens"), 16),
                                   _int_setting(tool_call_repeat_limit, settings.get("tool_call_repeat_limit"), 8))
    block = meta.get("rendering")
    report = InspectReport(str(path), thresholds=thresholds, rendering=describe_rendering(block) if block else None)
    counts = np.zeros(len(HISTOGRAM_EDGES), dtype=np.int64)
    for shard in dataset_io.verify_shards(path, meta, hashes=verify):
        for batch in dataset_io.iter_batches(shard, SMALL_COLUMNS, mapped=True):
            _add_batch(report, batch, counts, examples)
    report.histogram = [(int(low), int(high) if high else None, int(count)) for low, high, count
                        in zip(HISTOGRAM_EDGES, (*HISTOGRAM_EDGES[1:], None), counts) if count]
    return report


def _int_setting(given: int | None, recorded: object, default: int) -> int:
    """The caller's value, else the one recorded at tokenize time (an integer), else the default."""
    if given is not None:
        return given
    return recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else default


def _add_batch(report: InspectReport, batch: pa.RecordBatch, counts: np.ndarray, examples: int) -> None:
    import pyarrow.compute as pc

    from dflash.data.dataset_io import numpy_of

    column = {name: numpy_of(batch.column(name)) for name in NUMERIC_COLUMNS}
    column["finish_length"] = numpy_of(pc.fill_null(pc.equal(batch.column("finish_reason"), "length"), False))
    loss = column["num_loss_tokens"]
    report.samples += batch.num_rows
    report.tokens += int(column["length"].sum())
    report.loss_tokens += int(loss.sum())
    report.truncated_tokens += int(column["truncated_tokens"].sum())
    report.max_length_seen = max(report.max_length_seen, int(column["length"].max(initial=0)))
    counts += np.bincount(np.searchsorted(HISTOGRAM_EDGES, loss, side="right") - 1, minlength=len(counts))
    flags = degenerate_flags(column, report.thresholds)
    report.degenerate_samples += int(np.logical_or.reduce(list(flags.values())).sum())
    ids = batch.column("id")
    for reason, flag in flags.items():
        report.degenerate[reason] += int(flag.sum())
        room = examples - len(report.examples[reason])
        if room > 0:
            report.examples[reason] += [ids[int(i)].as_py() for i in np.flatnonzero(flag)[:room]]


def degenerate_flags(column: dict[str, np.ndarray], thresholds: InspectThresholds) -> dict[str, np.ndarray]:
    """Reason -> boolean array over the batch's samples."""
    return {
        "low_loss_tokens": column["num_loss_tokens"] < thresholds.min_loss_tokens,
        "finish_length": column["finish_length"].astype(bool),
        "tool_call_loop": column["tool_call_repeats"] >= thresholds.tool_call_repeat_limit,
        "empty_reasoning": column["empty_reasoning"].astype(bool),
        "truncated": column["truncated"].astype(bool),
    }
