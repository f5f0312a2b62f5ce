"""The machine's facts as one versioned JSON document: its records, and reading and writing it.

A snapshot is what `audit` checks, what a baseline stores and what `baseline diff` compares.
How the facts are collected is `envcheck.collect`.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

SCHEMA_VERSION = 1


@dataclass
class GpuProcess:
    """A process holding memory on a GPU."""

    pid: int
    name: str
    used_mib: Optional[int] = None           # None where NVML does not report it


@dataclass
class GpuFacts:
    """One GPU as NVML sees it, plus the CUDA probe's results when it ran (matched by UUID)."""

    index: int
    uuid: str
    name: str
    compute_capability: str                  # "12.0"
    memory_total_mib: int
    memory_free_mib: int
    memory_used_mib: int
    memory_reserved_mib: Optional[int] = None   # memory v2 (driver-reserved), where supported
    processes: list[GpuProcess] = field(default_factory=list)
    ecc_enabled: Optional[bool] = None
    ecc_uncorrected_volatile: Optional[int] = None
    retired_pages_pending: Optional[bool] = None
    retired_pages_count: Optional[int] = None
    remapped_rows_pending: Optional[bool] = None
    remapped_rows_failed: Optional[bool] = None
    remapped_rows_uncorrectable: Optional[int] = None
    pcie_gen: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width_max: Optional[int] = None
    context_mib: Optional[int] = None        # probe: context + cuBLAS + first collective (non-torch overhead)
    kernel_ok: Optional[bool] = None         # probe: a real kernel ran and gave the right answer
    probe_error: str = ""


@dataclass
class NvmlFacts:
    available: bool = False
    error: str = ""                          # why NVML is unavailable (the GPU checks' SKIP reason)
    driver_version: str = ""
    cuda_driver_version: str = ""            # "13.0": the newest CUDA the driver supports


@dataclass
class TorchFacts:
    installed: bool = False
    version: str = ""
    cuda: str = ""                           # torch.version.cuda, "" for a CPU build
    arch_list: list[str] = field(default_factory=list)   # ["sm_90", "sm_100", "sm_120", ...]
    error: str = ""
    cached: bool = False


@dataclass
class ToolkitFacts:
    """The CUDA toolkit found the way FlashInfer's JIT finds it."""

    cuda_home: str = ""
    source: str = ""                         # CUDA_HOME, CUDA_PATH, "nvcc on PATH", "/usr/local/cuda"
    nvcc_path: str = ""
    nvcc_version: str = ""                   # "12.8"
    cudart_version: str = ""                 # CUDART_VERSION of include/cuda_runtime_api.h, "12.8"
    headers_missing: list[str] = field(default_factory=list)
    libraries_missing: list[str] = field(default_factory=list)


@dataclass
class DiskFacts:
    path: str
    free_mib: int
    total_mib: int


@dataclass
class HostFacts:
    cpu_count: int = 0                       # honours the cgroup CPU quota and affinity
    ram_total_mib: int = 0                   # honours the cgroup memory limit
    ram_available_mib: int = 0
    shm_total_mib: int = 0
    shm_free_mib: int = 0
    open_files_soft: int = 0
    open_files_hard: int = 0
    disks: list[DiskFacts] = field(default_factory=list)


@dataclass
class EngineVenvFacts:
    """A serving engine's own venv under the project cache (`launcher.py engine setup ENGINE`)."""

    engine: str                              # "sglang", "vllm"
    path: str
    requirements: str                        # the pins file it was built from
    current: bool                            # built from the current pins: the venv the launcher serves from
    packages: dict[str, str] = field(default_factory=dict)     # normalised name -> version


@dataclass
class Snapshot:
    schema_version: int = SCHEMA_VERSION
    created_at: str = ""
    hostname: str = ""
    python: str = ""
    nvml: NvmlFacts = field(default_factory=NvmlFacts)
    gpus: list[GpuFacts] = field(default_factory=list)
    torch: TorchFacts = field(default_factory=TorchFacts)
    toolkit: ToolkitFacts = field(default_factory=ToolkitFacts)
    packages: dict[str, str] = field(default_factory=dict)     # normalised name -> version
    host: HostFacts = field(default_factory=HostFacts)
    env: dict[str, str] = field(default_factory=dict)          # GPU-relevant variables, redacted
    cuda_probe_ran: bool = False
    memory_calibration: Optional[dict[str, Any]] = None   # a baseline's measured memory model (`launcher.py calibrate`)
    engine_venvs: Optional[list[EngineVenvFacts]] = None  # built engine venvs; None: not recorded (an older snapshot)

    def to_dict(self) -> dict[str, Any]:
        document = dataclasses.asdict(self)
        if document["memory_calibration"] is None:      # only a calibrated baseline carries the key
            del document["memory_calibration"]
        return document

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> "Snapshot":
        version = document.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {version!r} is not supported (this launcher reads {SCHEMA_VERSION})")
        return _from_data(cls, document, "snapshot")

    def gpu_by_uuid(self, uuid: str) -> Optional[GpuFacts]:
        return next((gpu for gpu in self.gpus if gpu.uuid == uuid), None)


def _from_data(hint: Any, value: Any, where: str) -> Any:
    """Rebuild dataclasses from JSON data, rejecting unknown and missing keys and values of the
    wrong type (the error names the key, e.g. `snapshot.gpus[0].memory_free_mib`)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        hints = typing.get_type_hints(hint)
        unknown = sorted(set(value) - set(hints))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(hints)}")
        missing = [f.name for f in dataclasses.fields(hint) if f.name not in value and _required(f)]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
        return hint(**{key: _from_data(hints[key], item, f"{where}.{key}") for key, item in value.items()})
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        return _from_data(next(a for a in get_args(hint) if a is not type(None)), value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [_from_data(get_args(hint)[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict and not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got {value!r}")
    return _checked_scalar(hint, value, where)


def _required(field_: dataclasses.Field) -> bool:
    return field_.default is dataclasses.MISSING and field_.default_factory is dataclasses.MISSING


SCALARS: dict[type, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
# Every number a snapshot records is a size, a count, an index, a pid or a version: 0 or more. The one
# difference it records may be negative (the CUDA probe's context cost: memory in use after minus before).
SIGNED = frozenset({"context_mib"})


def _checked_scalar(hint: Any, value: Any, where: str) -> Any:
    """A JSON scalar of the field's type (a bool is not a number here); a number at least 0 (SIGNED aside)."""
    allowed = SCALARS.get(hint)
    if allowed is None:
        return value
    if not isinstance(value, allowed) or (hint is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    if hint is not bool and isinstance(value, (int, float)) and value < 0 and where.rsplit(".", 1)[-1] not in SIGNED:
        raise ValueError(f"{where}: {value} is out of range; valid: {'an integer' if hint is int else 'a number'} >= 0")
    return value


def load_snapshot(path: str | os.PathLike) -> Snapshot:
    """Read a snapshot file; a malformed one raises InputError naming the file and the key."""
    from launcher_core.errors import InputError
    from launcher_core.fileio import read_json_object

    document = read_json_object(path, "a snapshot")
    missing = [key for key in WRITTEN_KEYS if key not in document]
    if missing and document.get("schema_version") == SCHEMA_VERSION:
        raise InputError(f"{path}: not a valid snapshot: missing key(s) {', '.join(missing)} (`launcher.py snapshot` "
                         "writes every one of them: the file was cut short or edited); take the snapshot again")
    try:
        return Snapshot.from_dict(document)
    except (ValueError, TypeError, AttributeError) as error:
        raise InputError(f"{path}: not a valid snapshot: {error}") from None


# The keys every snapshot file has (`to_dict`); a file without one of them would read as a machine
# without that fact (no packages: "24 packages not installed") instead of as a damaged file.
WRITTEN_KEYS = ("schema_version", "created_at", "hostname", "python", "nvml", "gpus", "torch", "toolkit", "packages",
                "host", "env", "cuda_probe_ran")


def save_snapshot(snapshot: Snapshot, path: str | os.PathLike) -> Path:
    """Write atomically; values of secret-looking environment variables are masked anywhere in it."""
    from launcher_core.fileio import write_json_atomic
    from launcher_core.redact import redact_document, secret_values

    return write_json_atomic(path, redact_document(snapshot.to_dict(), secret_values(os.environ)))
