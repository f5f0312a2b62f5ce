"""train.feature_cache: the target's tap features of each dataset row, computed once per run.

The target is frozen and its forward is deterministic per row (right padding under a causal
mask leaves a row's features unchanged), so features read back give what the online forward
would give again: the loss curve is the online run's. Rows are files `ROW.pt` in one directory
per (dataset, target, taps, dtype, max_length) under the run's `train/feature_cache/`, shared by
the ranks of the node: a row extracted by one rank in epoch 1 is read by whichever rank meets
it later. Each file is written to a temporary name and renamed, so a killed run leaves only
whole files (a resumed run reuses them). The directory is removed when training finishes.

Size: rows x tokens x taps x hidden x dtype bytes. Meant for small datasets trained for many epochs;
the GPU profiles read the target online.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from dflash.train.rank.data import MicroBatch

CACHE_DIR = "feature_cache"


class FeatureSource(Protocol):
    """Where a step reads a micro-batch's tap features instead of the online forward: the
    feature cache, or the memory trace's fake features (dflash.measure.trace.FakeFeatures)."""

    def features(self, batch: MicroBatch, extract: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


def cache_directory(run_dir: Path, key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(run_dir) / "train" / CACHE_DIR / digest


class FeatureCache:
    """One rank's view of the node's feature files: how many rows it read (hits) or extracted (misses)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def stats(self) -> dict[str, float]:
        files = list(self.directory.glob("*.pt"))
        return {"rows": len(files), "mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
                "hits": self.hits, "misses": self.misses}

    def features(self, batch: MicroBatch, extract: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[b, S, L*H] for a MicroBatch: stored rows are read, the others extracted and stored."""
        import torch

        if not batch.rows or len(batch.rows) != batch.input_ids.shape[0]:
            raise ValueError("the feature cache needs the batch's dataset rows (collate_rows sets them)")
        stored = {i: self._read(row) for i, row in enumerate(batch.rows)}
        found = {i: value for i, value in stored.items() if value is not None}
        missing = [i for i in stored if i not in found]
        self.hits, self.misses = self.hits + len(found), self.misses + len(missing)
        if missing:
            fresh = extract(batch.input_ids[missing])
            for j, i in enumerate(missing):
                found[i] = fresh[j, : batch.lengths[i]].to("cpu", copy=True)
                self._write(batch.rows[i], found[i])
        first = found[0]
        out = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1], first.shape[-1], dtype=first.dtype)
        for i, value in found.items():
            out[i, : value.shape[0]] = value
        return out.to(batch.input_ids.device)

    def _path(self, row: int) -> Path:
        return self.directory / f"{row}.pt"

    def _read(self, row: int) -> torch.Tensor | None:
        import torch

        path = self._path(row)
        if not path.exists():
            return None
        value: torch.Tensor = torch.load(path, map_location="cpu", weights_only=True)
        return value

    def _write(self, row: int, value: torch.Tensor) -> None:
        import io

        import torch

        from launcher_core.fileio import write_bytes_atomic

        buffer = io.BytesIO()
        torch.save(value.contiguous(), buffer)
        write_bytes_atomic(self._path(row), buffer.getvalue())

    def remove(self) -> None:
        shutil.rmtree(self.directory.parent, ignore_errors=True)
