"""A measured memory model: peak allocated memory at two micro-batch sizes on one workload, each a
step of two micro-batches on `world_size` ranks (`launcher.py calibrate` measures it on the GPU
node, `dflash.measure.gpu_calibration`), and its storage inside the baseline JSON under the key
`memory_calibration`, next to the machine facts it was measured on. `dflash.memory.peak_estimate.peak_model`
corrects the analytic estimate with it when its workload key is the profile's.

It also holds the caching allocator's reserve: the peak reserved memory at the two sizes, and the
reserve ratio (max_memory_reserved / max_memory_allocated across steps of differently shaped
micro-batches, under the allocator setting `expandable_segments`), which the plan counts inside each
budget (dflash.memory.reserve). A calibration stored before these keys existed reads with them None.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from launcher_core.errors import InputError

if TYPE_CHECKING:
    from dflash.memory.workload import Workload
    from envcheck.snapshot import Snapshot

CALIBRATION_KEY = "memory_calibration"


@dataclass(frozen=True)
class AllocatorPeaks:
    """The caching allocator's peaks over a run, in MiB: what tensors held, and what it reserved (the
    segments, tensors and the free blocks between them: what `set_per_process_memory_fraction` caps)."""

    allocated_mib: float
    reserved_mib: float

    @property
    def ratio(self) -> float:
        """Reserved over allocated: the allocator's reserve as a factor."""
        return self.reserved_mib / self.allocated_mib


@dataclass(frozen=True)
class Calibration:
    """Peak allocated memory measured at two micro-batch sizes on one workload."""

    micro_batches: tuple[int, int]
    peaks_mib: tuple[float, float]
    workload_key: str
    device_name: str = ""
    torch_version: str = ""
    measured_at: str = ""
    world_size: int = 1             # ranks the drafter was sharded over while measuring
    micro_batches_per_step: int = 1  # micro-batches of each measured step (2: the accumulated gradients are in it)
    reserved_mib: tuple[float, float] | None = None  # peak reserved at the two sizes (None: measured before it was)
    reserve_ratio: float | None = None   # peak reserved / peak allocated across differently shaped micro-batches
    expandable_segments: bool | None = None   # the allocator setting the reserve was measured under
    start_s: float | None = None    # one rank's state built (the target loaded, the drafter built and sharded):
                                    # what every rank pays again at an OOM restart (None: measured before it was)

    @property
    def slope_mib(self) -> float:
        (m1, m2), (p1, p2) = self.micro_batches, self.peaks_mib
        return (p2 - p1) / (m2 - m1)

    @property
    def intercept_mib(self) -> float:
        return self.peaks_mib[0] - self.slope_mib * self.micro_batches[0]


def fit_calibration(peaks_by_micro_batch: Mapping[int, float], workload: Workload,
                    reserved_by_micro_batch: Mapping[int, float] | None = None,
                    varied: AllocatorPeaks | None = None, **facts: str | int | bool | float) -> Calibration:
    """Two measured (micro-batch, peak MiB) points -> Calibration (the line through them); with the
    reserved peaks at those sizes and the varied-shape steps' measurement, the reserve ratio: the larger
    of reserved over allocated at the worst-case sizes and across the varied steps."""
    if len(peaks_by_micro_batch) != 2:
        raise ValueError(f"calibration needs exactly two micro-batch sizes, got {sorted(peaks_by_micro_batch)}")
    (m1, p1), (m2, p2) = sorted(peaks_by_micro_batch.items())
    reserved = None if reserved_by_micro_batch is None else (float(reserved_by_micro_batch[m1]),
                                                             float(reserved_by_micro_batch[m2]))
    return Calibration(micro_batches=(m1, m2), peaks_mib=(float(p1), float(p2)), workload_key=workload.key(),
                       reserved_mib=reserved, reserve_ratio=_reserve_ratio((p1, p2), reserved, varied),
                       **facts)  # type: ignore[arg-type]


def _reserve_ratio(peaks: tuple[float, float], reserved: tuple[float, float] | None,
                   varied: AllocatorPeaks | None) -> float | None:
    ratios = [r / p for r, p in zip(reserved or (), peaks) if p > 0] + ([varied.ratio] if varied else [])
    return max(1.0, *ratios) if ratios else None


def calibration_as_dict(calibration: Calibration) -> dict[str, object]:
    return {**dataclasses.asdict(calibration), "slope_mib": calibration.slope_mib,
            "intercept_mib": calibration.intercept_mib}


def calibration_from_dict(document: Mapping[str, object], where: str) -> Calibration:
    """The parsed JSON of a stored calibration -> Calibration; InputError naming the file and key."""
    try:
        micro_batches = _pair(document, "micro_batches")
        peaks = _pair(document, "peaks_mib")
        return Calibration(micro_batches=(int(micro_batches[0]), int(micro_batches[1])),
                           peaks_mib=(float(peaks[0]), float(peaks[1])), workload_key=str(document["workload_key"]),
                           device_name=str(document.get("device_name", "")),
                           torch_version=str(document.get("torch_version", "")),
                           measured_at=str(document.get("measured_at", "")),
                           world_size=_count(document, "world_size"),
                           micro_batches_per_step=_count(document, "micro_batches_per_step"),
                           reserved_mib=_stored_reserved(document),
                           reserve_ratio=_stored_number(document, "reserve_ratio", 1.0, 100.0,
                                                        "a number >= 1 (reserved over allocated)"),
                           expandable_segments=_stored_expandable(document),
                           start_s=_stored_number(document, "start_s", 0.0, 1e6, "a number of seconds >= 0"))
    except (KeyError, TypeError, ValueError) as error:
        raise InputError(f"{where}: key {CALIBRATION_KEY!r} is malformed ({error}); re-run the calibration") from None


def _stored_reserved(document: Mapping[str, object]) -> tuple[float, float] | None:
    """The reserved peaks of a stored calibration (None: stored before they were measured)."""
    return None if document.get("reserved_mib") is None else _pair(document, "reserved_mib")


def _stored_number(document: Mapping[str, object], key: str, low: float, high: float, what: str) -> float | None:
    """An optional number of the stored calibration in [low, high) (None: stored before it was measured)."""
    value = document.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value < high:
        raise ValueError(f"{key!r} must be {what}, got {value!r}")
    return float(value)


def _stored_expandable(document: Mapping[str, object]) -> bool | None:
    expandable = document.get("expandable_segments")
    if expandable is not None and not isinstance(expandable, bool):
        raise ValueError(f"'expandable_segments' must be true or false, got {expandable!r}")
    return expandable


def _count(document: Mapping[str, object], key: str) -> int:
    """A positive integer of the stored calibration (1 when a calibration from before it lacks the key)."""
    value = document.get(key, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key!r} must be a positive integer, got {value!r}")
    return value


def _pair(document: Mapping[str, object], key: str) -> tuple[float, float]:
    value = document[key]
    if not isinstance(value, (list, tuple)) or len(value) != 2 or \
            not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{key!r} must be two numbers, got {value!r}")
    return float(value[0]), float(value[1])


def save_calibration(baseline_path: str | Path, calibration: Calibration) -> Path:
    """Store the calibration inside the baseline JSON (atomically), next to the facts it was measured on."""
    from launcher_core.fileio import read_json_object, write_json_atomic

    path = Path(baseline_path)
    document = read_json_object(path, "a baseline") if path.exists() else {}
    document[CALIBRATION_KEY] = calibration_as_dict(calibration)
    return write_json_atomic(path, document)


def load_calibration(document: Mapping[str, object] | None, where: str) -> Calibration | None:
    """The calibration stored in a baseline (or snapshot) JSON document, if any."""
    if not document or CALIBRATION_KEY not in document:
        return None
    stored = document[CALIBRATION_KEY]
    if not isinstance(stored, Mapping):
        raise InputError(f"{where}: key {CALIBRATION_KEY!r} must be an object, got {stored!r}; re-run the calibration")
    return calibration_from_dict(stored, where)


def stored_calibration(snapshot: Snapshot | None, where: str) -> Calibration | None:
    """The calibration a loaded baseline (or snapshot) carries, if any."""
    if snapshot is None or snapshot.memory_calibration is None:
        return None
    return calibration_from_dict(snapshot.memory_calibration, where)
