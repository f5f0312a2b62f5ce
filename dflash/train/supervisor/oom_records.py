"""OOM records: what a rank that ran out of memory leaves for the restart, written by the rank
(dflash.train.rank.autobatch) and read both by the launcher, which restarts every rank on one, and
by the restarted ranks, which halve the micro-batch. One file per rank,
`train/autobatch/oom-rank-R.json` (step, micro-batch, phase, error); a record at micro-batch 1 cannot be
recovered by halving (`unrecoverable`, `fatal_oom_message`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

OOM_RECORDS_DIR = "autobatch"
OOM_EXIT_CODE = 75                    # a rank ran out of memory and recorded it: restart at a smaller micro-batch


@dataclass(frozen=True)
class OomRecord:
    """What a rank that ran out of memory wrote before it exited."""

    rank: int
    step: int
    micro_batch: int
    phase: str
    error: str

    @property
    def halved(self) -> int:
        return self.micro_batch // 2


def oom_records_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / OOM_RECORDS_DIR


def write_oom_record(run_dir: str | Path, record: OomRecord) -> Path:
    import dataclasses

    from launcher_core.fileio import write_json_atomic

    return write_json_atomic(oom_records_dir(run_dir) / f"oom-rank-{record.rank}.json",
                             {**dataclasses.asdict(record), "time": time.time()})


def read_oom_records(run_dir: str | Path) -> list[OomRecord]:
    """Every rank's OOM record not yet taken into autobatch.json (a damaged one is skipped: its rank
    will run out of memory again and write it anew)."""
    import json

    records = []
    for path in sorted(oom_records_dir(run_dir).glob("oom-rank-*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            records.append(OomRecord(int(document["rank"]), int(document["step"]), int(document["micro_batch"]),
                                     str(document["phase"]), str(document.get("error", ""))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def clear_oom_records(run_dir: str | Path) -> None:
    for path in oom_records_dir(run_dir).glob("oom-rank-*.json"):
        path.unlink(missing_ok=True)


def unrecoverable(records: list[OomRecord]) -> OomRecord | None:
    """A record of an OOM at micro-batch 1: halving cannot help."""
    return next((r for r in records if r.micro_batch <= 1), None)


def fatal_oom_message(record: OomRecord) -> str:
    phase = record.phase
    advice = ("AdamW's states are allocated at the first update: raise memory.margin (or memory.overhead_mib) so "
              "the plan leaves room for them, free the GPU, or train fewer drafter layers") if phase == "optimizer" else \
        ("one sequence does not fit: lower data.max_length or train.num_anchors, set "
         "train.activation_checkpointing = \"layers\", or free GPU memory")
    return (f"rank {record.rank} ran out of memory at step {record.step}, micro-batch 1 ({phase}): {advice}")
