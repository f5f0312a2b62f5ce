"""The offline alternative, for comparison: what storing the tap hidden states on disk would take
(`launcher.py plan` prints it next to the plan; the seeds' dataset needed ~90 TB)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.memory.workload import Workload

SEEDS_SAMPLES = 902_087             # the seeds' tokenized completions
SEEDS_AVG_TOKENS = 2000             # their average length


@dataclass(frozen=True)
class OfflineStorage:
    """What storing the tap hidden states on disk (the offline alternative) would take."""

    samples: int
    avg_tokens: int
    layers: int
    hidden: int
    dtype_bytes: int

    @property
    def bytes(self) -> int:
        return self.samples * self.avg_tokens * self.layers * self.hidden * self.dtype_bytes


def offline_storage(workload: Workload, samples: int = SEEDS_SAMPLES, avg_tokens: int = SEEDS_AVG_TOKENS) -> OfflineStorage:
    return OfflineStorage(samples=samples, avg_tokens=avg_tokens, layers=len(workload.tap_layers),
                          hidden=workload.target.hidden, dtype_bytes=workload.dtype_bytes)
