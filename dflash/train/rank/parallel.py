"""What is about ranks and meshes: the rank's process group, our few collectives on scalars, and the
drafter sharded by FSDP2.

Each rank derives its place from torchrun's RANK, WORLD_SIZE and LOCAL_RANK (`WorkerEnv`); without
a process group every collective here is the identity (FSDP2 still needs one: `single_process_group`).
`shard_drafter` applies `fully_shard` per draft layer, per module the loss calls after the forward
(`outside_forward`) and to the drafter itself, on a one-dimensional mesh of every rank. Gradients are
summed, never averaged (divide factor 1, plain SUM), because the step's loss is already divided by
its global weight. The frozen target is attached, not registered, so it stays replicated on every
rank. Sharding, precision and memory: docs/sharding.md.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Mapping

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from dflash.drafter.network import DFlashDrafter

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
    one node (dflash.train.supervisor.rendezvous), the torchrun agent's otherwise.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world <= 1 or distributed():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    host, port = _store_address()
    store = dist.TCPStore(host, port, world_size=world, is_master=False, timeout=timeout)
    make_nccl_dump_folders(os.environ)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timeout,
                            device_id=device if device is not None and device.type == "cuda" else None)


# NCCL's monitor thread makes its dump pipe with mkfifo and fails (ending the rank) where the folder is missing;
# its dumps are written with a plain open (ProcessGroupNCCL.cpp `DumpPipe`, FlightRecorder.cpp `DebugInfoWriter`)
NCCL_DUMP_PATH_VARIABLES = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


def make_nccl_dump_folders(env: Mapping[str, str]) -> None:
    """The folders of the dump pipe and dump files the launcher names (dflash.train.supervisor.launch), made
    before the process group starts NCCL's monitor thread."""
    for variable in NCCL_DUMP_PATH_VARIABLES:
        if env.get(variable):
            Path(env[variable]).parent.mkdir(parents=True, exist_ok=True)


def _store_address() -> tuple[str, int]:
    """The launcher's store (one node: DFLASH_RDZV_STORE), else torchrun's (MASTER_ADDR/MASTER_PORT)."""
    from dflash.train.supervisor.rendezvous import STORE_ENV

    endpoint = os.environ.get(STORE_ENV)
    if endpoint:
        host, port = endpoint.rsplit(":", 1)
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def single_process_group(backend: str) -> None:
    """A process group of one (in-process runs: benchmarks, tests, calibration on one GPU), so the
    drafter can be sharded by FSDP2 the same way as under torchrun; no-op when one exists."""
    import torch.distributed as dist

    if distributed():
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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


def any_rank(flag: bool, group: ProcessGroup | None = None) -> bool:
    """True on every rank when at least one rank's flag is set (all_reduce MAX)."""
    return all_reduce_scalar(1 if flag else 0, "MAX", group, dtype="int64") == 1


def count_failed(ok: bool, group: ProcessGroup | None = None) -> int:
    """How many ranks report a failure (all_reduce SUM of 0/1)."""
    return int(all_reduce_scalar(0 if ok else 1, "SUM", group, dtype="int64"))


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


# --- the drafter under FSDP2 ------------------------------------------------------------

ComputeDtype = Literal["float32", "bfloat16"]


def drafter_mesh(device: torch.device, backend: str) -> DeviceMesh:
    """The one-dimensional mesh of every rank (a process group of one in a single process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    single_process_group(backend)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def mixed_precision(compute_dtype: ComputeDtype) -> MixedPrecisionPolicy:
    """Gathered weights in the compute dtype, gradients reduced in float32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = torch.bfloat16 if compute_dtype == "bfloat16" else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard_drafter(drafter: DFlashDrafter, mesh: DeviceMesh, *, compute_dtype: ComputeDtype = "float32",
                  reshard_after_forward: bool = True) -> DFlashDrafter:
    """fully_shard every draft layer, then the drafter (in place; returns it)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(compute_dtype)
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for prefix in drafter.outside_forward:      # called after the drafter's forward (DFlash 2's selector, by the loss)
        fully_shard(drafter.get_submodule(prefix.rstrip(".")), mesh=mesh, mp_policy=policy)
    fully_shard(drafter, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for unit in fsdp_units(drafter):
        unit.set_gradient_divide_factor(1.0)            # the loss is normalised by the global weight: sum
        unit.set_force_sum_reduction_for_comms(True)
    return drafter


def fsdp_units(module: nn.Module) -> Iterator[FSDPModule]:
    """The FSDP2 units inside `module` (itself included), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return (m for m in module.modules() if isinstance(m, FSDPModule))


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def set_gradient_sync(drafter: nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters its gradients (False: they accumulate unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(drafter, FSDPModule):
        drafter.set_requires_gradient_sync(sync)


def observe_reductions(drafter: nn.Module, starting: Callable[[], None], finished: Callable[[], None]) -> None:
    """Call `starting` as each unit's gradient reduction allocates its buffers (before its
    reduce-scatter) and `finished` after it, every unit of `drafter`. FSDP2's own reduce-scatter
    runs in between: the observer only subclasses its default communication (`set_custom_reduce_scatter`)
    and uses its all-reduce hook, which FSDP2 calls after the reduce-scatter. Used for the OOM
    record's phase and fault injection (`sync`, dflash.train.rank.faults) and the memory trace's
    "gradient reduction" phase (dflash.measure.trace)."""
    from dflash.torch_private import fsdp_default_reduce_scatter

    class ObservedReduceScatter(fsdp_default_reduce_scatter()):  # type: ignore[misc]
        def allocate(self, size: object, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            starting()
            return super().allocate(size, dtype=dtype, device=device)  # type: ignore[arg-type]

    for unit in fsdp_units(drafter):
        unit.set_custom_reduce_scatter(ObservedReduceScatter())
        unit.set_all_reduce_hook(lambda _reduced: finished())


def sharded_param_bytes(drafter: nn.Module) -> int:
    """Bytes of this rank's shards of the drafter's trainable parameters (their local tensors)."""
    return sum(local_tensor(p).numel() * p.element_size() for p in drafter.parameters() if p.requires_grad)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) parameter or gradient; a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
