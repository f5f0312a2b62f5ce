"""Every private torch API the project uses, each behind one function here and nowhere else.

torch has no public form of these (checked at the pinned releases, 2.9.1 and 2.13.0). Each function
names what it reaches for; `tests/test_torch_private.py` calls every one and fails when torch moves or
reshapes it, and `tests/test_layers.py` fails when a module outside this one imports a private torch
path. None of them is on a plain training run's path except the flight recorder's dump (read by the
heartbeat thread) and the agent's failure report (torchrun's process context).
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


def flight_recorder_dump() -> Optional[bytes]:
    """This process's flight recorder (TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE): every
    recorded collective of every process group, pickled as torch's `fr_trace` tool reads it; None where
    this torch has no dump or records nothing (the buffer size 0)."""
    import torch

    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        return bytes(dump(includeCollectives=True, includeStackTraces=False, onlyActive=False))
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
