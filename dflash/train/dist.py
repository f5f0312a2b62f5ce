"""Every collective of a training rank, and the one process-group setup.

torchrun gives every rank the same argv; each derives its own values from RANK, WORLD_SIZE and
LOCAL_RANK (`WorkerEnv`). Without an initialised process group every helper here is the
identity, so single-process runs and tests use the same code.

Collective tensors live where the backend wants them: the current CUDA device for NCCL, the
CPU for gloo.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class WorkerEnv:
    """This rank's place in the job, from the torchrun environment contract."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> "WorkerEnv":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_device(device_type: str, env: WorkerEnv) -> "torch.device":
    """This rank's device: its local GPU (made current) on CUDA, else the CPU."""
    import torch

    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(backend: str, device: "torch.device | None" = None,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the job's process group (no-op for a single process or when already joined).

    The rendezvous keys get a per-attempt prefix, so a rank restarted by torchrun
    (--max-restarts) never connects to an address a dead rank of the previous attempt published
    (gloo then fails with 'Connection refused'). The store is the launcher's loopback store on
    one node (dflash.train.rendezvous), the torchrun agent's otherwise.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world <= 1 or distributed():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    host, port = _store_address()
    store = dist.TCPStore(host, port, world_size=world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout,
                            device_id=device if device is not None and device.type == "cuda" else None)


def _store_address() -> tuple[str, int]:
    """The launcher's store (one node: DFLASH_RDZV_STORE), else torchrun's (MASTER_ADDR/MASTER_PORT)."""
    from dflash.train.rendezvous import STORE_ENV

    endpoint = os.environ.get(STORE_ENV)
    if endpoint:
        host, port = endpoint.rsplit(":", 1)
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def close_process_group() -> None:
    if distributed():
        import torch.distributed as dist

        dist.destroy_process_group()


def collective_device(group: ProcessGroup | None = None) -> "torch.device":
    """Where a collective's tensor must live: the current CUDA device for NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_tensor(values: "torch.Tensor", op_name: str = "SUM", group: ProcessGroup | None = None) -> "torch.Tensor":
    """All-reduce `values` in place (on the collective device) and return them on their own device."""
    if not distributed():
        return values
    import torch.distributed as dist

    moved = values.to(collective_device(group))
    dist.all_reduce(moved, op=getattr(dist.ReduceOp, op_name), group=group)
    return moved.to(values.device)


def all_reduce_scalar(value: float, op_name: str, group: ProcessGroup | None = None, dtype: str = "float64") -> float:
    if not distributed():
        return value
    import torch

    tensor = torch.tensor([value], dtype=getattr(torch, dtype))
    return all_reduce_tensor(tensor, op_name, group).item()


def agree_micro_batch(local: int, group: ProcessGroup | None = None) -> int:
    """Every rank's feasible micro-batch -> the smallest (all_reduce MIN), the same on all ranks."""
    return int(all_reduce_scalar(local, "MIN", group, dtype="int64"))


def global_weight(local_weight: float, group: ProcessGroup | None = None) -> float:
    """The step's total loss weight over all ranks (all_reduce SUM): the loss normaliser."""
    return all_reduce_scalar(float(local_weight), "SUM", group)


def all_ranks_ok(ok: bool, group: ProcessGroup | None = None) -> bool:
    return all_reduce_scalar(1 if ok else 0, "MIN", group, dtype="int64") == 1


def any_rank(flag: bool, group: ProcessGroup | None = None) -> bool:
    """True on every rank when at least one rank's flag is set (all_reduce MAX)."""
    return all_reduce_scalar(1 if flag else 0, "MAX", group, dtype="int64") == 1


def count_failed(ok: bool, group: ProcessGroup | None = None) -> int:
    """How many ranks report a failure (all_reduce SUM of 0/1)."""
    return int(all_reduce_scalar(0 if ok else 1, "SUM", group, dtype="int64"))


DEFAULT_GRAD_BUCKET_MIB = 64      # train.grad_bucket_mib: the gradient sum's bucket (and staging buffer) cap
MIB = 2**20


@dataclass(frozen=True, eq=False)          # tensors do not compare as values
class Bucket:
    """Tensors summed by one all_reduce: one large tensor in place, or small ones packed."""

    tensors: tuple["torch.Tensor", ...]
    in_place: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class GradientSum:
    """The plan of one gradient sum (`prepare_gradient_sum`), run by `run` (`sync_gradients` does both).

    Tensors are grouped in order into buckets of at most `bucket_bytes`. A tensor at least that
    large, contiguous and already on the collective device is its own bucket: all-reduced in place
    in `.grad`, no copy. Smaller ones (same dtype) are packed into `staging`, ONE flat byte buffer
    of at most `bucket_bytes`, reused by every packed bucket: copied in, all-reduced, copied back.
    So the sum holds at most one bucket beyond the gradients themselves, never a second full copy.

    Every allocation of the sum (the staging buffer) happens in `prepare_gradient_sum`, before
    its first collective; `run` only copies and all-reduces. An out-of-memory error of the sum is
    therefore raised before any rank has entered one of its collectives, and AutoBatch agrees on
    it like an OOM of the backward.
    """

    buckets: list[Bucket]
    staging: "torch.Tensor | None"          # uint8, min(bucket, all packed bytes): `staging_bytes`
    group: ProcessGroup | None = None

    @property
    def staging_bytes(self) -> int:
        return 0 if self.staging is None else self.staging.numel()

    def run(self) -> None:
        import torch.distributed as dist

        for bucket in self.buckets:
            if bucket.in_place:
                dist.all_reduce(bucket.tensors[0], op=dist.ReduceOp.SUM, group=self.group)
            else:
                assert self.staging is not None, "a packed bucket needs the staging buffer"
                _through_staging(bucket, self.staging, lambda flat: dist.all_reduce(flat, group=self.group))


def _through_staging(bucket: Bucket, staging: "torch.Tensor", collective: Callable[["torch.Tensor"], object]) -> None:
    """Copy the bucket into the front of `staging`, run the collective on it, copy it back."""
    flat = staging[:bucket.nbytes].view(bucket.tensors[0].dtype)
    offset = 0
    for tensor in bucket.tensors:
        flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        offset += tensor.numel()
    collective(flat)
    offset = 0
    for tensor in bucket.tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def grad_bucket_bytes(bucket_mib: float) -> int:
    assert bucket_mib > 0, "the profile schema holds train.grad_bucket_mib > 0"
    return max(1, int(bucket_mib * MIB))


def trainable_grads(parameters: Iterable["torch.nn.Parameter"]) -> list["torch.Tensor"]:
    """The gradients to sum: of trainable parameters that have one, each parameter once."""
    seen: set[int] = set()
    grads = []
    for p in parameters:
        if p.requires_grad and p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            grads.append(p.grad)
    return grads


def plan_buckets(tensors: list["torch.Tensor"], bucket_bytes: int, device: "torch.device") -> list[Bucket]:
    """A tensor of `bucket_bytes` or more (contiguous, on `device`) alone, in place, as it comes;
    the others packed in order while they fit `bucket_bytes` and share a dtype (packing goes on
    past the large ones; a large one that cannot be reduced in place is packed alone, and the
    staging buffer then holds that one tensor). The same order on every rank: the same buckets."""
    buckets: list[Bucket] = []
    packing: list[torch.Tensor] = []
    packed = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size >= bucket_bytes and tensor.is_contiguous() and tensor.device == device:
            buckets.append(Bucket((tensor,), in_place=True))
            continue
        if packing and (packed + size > bucket_bytes or tensor.dtype != packing[0].dtype):
            buckets.append(Bucket(tuple(packing), in_place=False))
            packing, packed = [], 0
        packing.append(tensor)
        packed += size
    return buckets + ([Bucket(tuple(packing), in_place=False)] if packing else [])


def prepare_gradient_sum(parameters: Iterable["torch.nn.Parameter"], group: ProcessGroup | None = None,
                         bucket_mib: float = DEFAULT_GRAD_BUCKET_MIB,
                         before_staging: Callable[[], None] | None = None) -> GradientSum:
    """The buckets of this step's gradients and the one staging buffer (the sum's only allocation,
    on the collective device). `before_staging` runs just before that allocation, on every call
    (AutoBatch's fault-injection point `sync`). Without a process group: nothing to sum."""
    import torch

    bucket_bytes = grad_bucket_bytes(bucket_mib)
    device = collective_device(group)
    buckets = plan_buckets(trainable_grads(parameters), bucket_bytes, device) if distributed() else []
    if before_staging is not None:
        before_staging()
    size = staging_bytes(buckets, bucket_bytes)
    staging = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    return GradientSum(buckets, staging, group)


def staging_bytes(buckets: list[Bucket], bucket_bytes: int) -> int:
    """The staging buffer: min(bucket, all packed bytes), so the memory model can count it from
    the tensor sizes alone (dflash.memory.model); larger only for a packed tensor above the bucket."""
    packed = [b.nbytes for b in buckets if not b.in_place]
    return max(min(bucket_bytes, sum(packed)), max(packed, default=0))


def sync_gradients(parameters: Iterable["torch.nn.Parameter"], group: ProcessGroup | None = None,
                   bucket_mib: float = DEFAULT_GRAD_BUCKET_MIB) -> None:
    """Sum every trainable parameter's gradient over the ranks, in place, bucket by bucket
    (`GradientSum`); the identity without a process group."""
    if distributed():
        prepare_gradient_sum(parameters, group, bucket_mib).run()


def broadcast_module(module: "torch.nn.Module", src: int = 0, group: ProcessGroup | None = None,
                     bucket_mib: float = DEFAULT_GRAD_BUCKET_MIB) -> None:
    """Every rank takes rank `src`'s parameters and buffers (the initial weights), in place, in
    buckets like the gradient sum: no DistributedDataParallel wrapper, no gradient buckets."""
    if not distributed():
        return
    import torch

    with torch.no_grad():
        tensors = [t.data for t in (*module.parameters(), *module.buffers())]
        device = collective_device(group)
        bucket_bytes = grad_bucket_bytes(bucket_mib)
        for bucket in plan_buckets(tensors, bucket_bytes, device):
            _broadcast_bucket(bucket, src, group, device)


def _broadcast_bucket(bucket: Bucket, src: int, group: ProcessGroup | None, device: "torch.device") -> None:
    import torch
    import torch.distributed as dist

    if bucket.in_place:
        dist.broadcast(bucket.tensors[0], src=src, group=group)
        return
    staging = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)     # one bucket, freed after it
    _through_staging(bucket, staging, lambda flat: dist.broadcast(flat, src=src, group=group))


def gather_floats(value: float, group: ProcessGroup | None = None) -> list[float]:
    """`value` of every rank, in rank order (all_gather)."""
    if not distributed():
        return [value]
    import torch
    import torch.distributed as dist

    device = collective_device(group)
    gathered = [torch.zeros(1, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([value], device=device, dtype=torch.float32), group=group)
    return [float(t.item()) for t in gathered]


def gather_memory_mib(device: "torch.device") -> list[float]:
    """Peak memory of every rank in MiB (device memory on GPU, max RSS on CPU)."""
    import torch

    if device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        import resource

        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return [round(value, 1) for value in gather_floats(mine)]


def barrier() -> None:
    if distributed():
        import torch.distributed as dist

        dist.barrier()


def rank_of_process() -> int:
    """This process's rank in the group (0 without one)."""
    if not distributed():
        return 0
    import torch.distributed as dist

    return dist.get_rank()
