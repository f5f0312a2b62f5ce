"""Every private torch API the project uses, each behind one function here and nowhere else.

torch has no public form of these (checked at the pinned releases, 2.9.1 and 2.13.0). Each function
names what it reaches for; `tests/test_torch_private.py` calls every one and fails when torch moves or
reshapes it, and `tests/test_layers.py` fails when a module outside this one imports a private torch
path. None of them is on a plain training run's path except the flight recorders' dumps (read by the
heartbeat thread: NCCL's own on a NCCL rank) and the agent's failure report (torchrun's process context).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, RunProcsResult

FAKE_BACKEND = "fake"


def fsdp_default_reduce_scatter() -> type:
    """FSDP2's default gradient reduce-scatter (`set_custom_reduce_scatter` takes a subclass of it):
    the memory trace and OOM fault injection observe a unit's reduction through it."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter


def register_fake_backend() -> str:
    """torch's fake process group ("fake": collectives that move nothing), registered by importing its
    module under torch.testing; the memory trace shards the drafter over it. Returns the backend name."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend)

    return FAKE_BACKEND


def fake_tensor_mode() -> type:
    """torch's FakeTensorMode: tensors with shapes, dtypes and storages of the right size, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def fsdp_mem_tracker() -> tuple[type, Any, Any]:
    """(FSDPMemTracker, its reference-type enum _FSDPRefType, MemTracker's module state enum _State)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _State

    return FSDPMemTracker, _FSDPRefType, _State


def mem_tracker() -> type:
    """torch's plain MemTracker (a frozen model's forward)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


# Which recorder a backend's collectives fill, read in torch's source and checked in the wheels of both pinned
# torches (v2.9.1+cu128, git 5811a8d7, requirements-cu128.txt; v2.13.0+cu130, git cf30153c, requirements-cu130.txt):
# torch/csrc/distributed/c10d/init.cpp (`c10d_init`) binds `_dump_nccl_trace`, built only with USE_C10D_NCCL, to
# ProcessGroupNCCL.cpp's `dump_nccl_trace(bool includeCollectives, bool includeStackTraces, bool onlyActive)`,
# which pickles FlightRecorderCUDA (`FlightRecorder<at::cuda::CUDAEvent>`), the recorder ProcessGroupNCCL records
# every collective into; `_dump_fr_trace` binds FlightRecorder.cpp's `dump_fr_trace` (the same three arguments),
# which pickles the generic `FlightRecorder<c10::Event>` that ProcessGroupGloo records into. On NCCL ranks the
# generic one stays empty. Both exports take the three bools in both wheels (libtorch_python.so).
FLIGHT_RECORDER_DUMPS = {"nccl": "_dump_nccl_trace", "gloo": "_dump_fr_trace"}
FLIGHT_RECORDER_ARGUMENTS = {"includeCollectives": True, "includeStackTraces": False, "onlyActive": False}


def flight_recorder_dump(backend: str = "gloo") -> Optional[bytes]:
    """The flight recorder that `backend`'s collectives fill (TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE):
    NCCL's own for "nccl", torch's generic one for any other; every recorded collective of every process group
    of that backend, pickled as torch's `fr_trace` tool reads it. None where this torch has no such dump (a CPU
    build has no NCCL) or records nothing (the buffer size 0)."""
    import torch

    dump = getattr(torch._C._distributed_c10d, FLIGHT_RECORDER_DUMPS.get(backend, FLIGHT_RECORDER_DUMPS["gloo"]), None)
    if dump is None:
        return None
    try:
        return bytes(dump(**FLIGHT_RECORDER_ARGUMENTS))
    except RuntimeError:
        return None


PollWrapper = Callable[[Callable[["MultiprocessContext"], Optional["RunProcsResult"]]],
                       Callable[["MultiprocessContext"], Optional["RunProcsResult"]]]


def wrap_multiprocess_poll(wrap: PollWrapper, marker: str) -> bool:
    """Replace torchrun's `MultiprocessContext._poll` (the start-method context's check of its ranks)
    by `wrap(original)`, once (`marker` set on the replacement). False where torch has none."""
    from torch.distributed.elastic.multiprocessing import api

    poll = getattr(api.MultiprocessContext, "_poll", None)
    if poll is None:
        return False
    if not getattr(poll, marker, False):
        replacement = wrap(poll)
        setattr(replacement, marker, True)
        setattr(api.MultiprocessContext, "_poll", replacement)
    return True


def multiprocess_processes(context: MultiprocessContext) -> Optional[list[Any]]:
    """The multiprocessing processes behind a start-method context (None where torch keeps them elsewhere)."""
    return getattr(getattr(context, "_pc", None), "processes", None)
