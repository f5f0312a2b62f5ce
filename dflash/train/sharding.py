"""The drafter under FSDP2: its parameters, gradients and AdamW states sharded over the ranks.

`shard_drafter` applies torch's `fully_shard` (torch.distributed.fsdp) once per draft layer, once
per module the loss calls after the drafter's forward (`outside_forward`: DFlash 2's candidate
selector) and once to the drafter itself (the root unit: fc, the norms; the rotary and
draft-vocabulary buffers stay whole), on a one-dimensional device mesh of every rank:

* each rank keeps 1/N of every float32 parameter (dim 0, padded to a multiple of N) as its
  master weights, and AdamW updates those shards (dflash.train.optim);
* a unit's full weights are all-gathered just before its forward, in the compute dtype
  (`MixedPrecisionPolicy.param_dtype`: bf16 with train.compute_dtype = "bfloat16", else float32),
  and freed after it (`train.reshard_after_forward`, default on; off keeps a draft layer's
  gathered weights from its forward to its backward, as FSDP1's SHARD_GRAD_OP);
* gradients are reduce-scattered in float32 (`reduce_dtype`) as each unit's backward ends, so
  the reduction overlaps the rest of the backward; with train.gradient_sync = "last_micro_batch"
  the earlier micro-batches of a step keep unsharded gradients and only the last one reduces.

The loss of a step is already divided by the GLOBAL weight of the step (dflash.train.step), so
the ranks' gradients are summed, never averaged: every unit's divide factor is 1 and its
collectives use plain SUM (gloo has no pre-multiplied sum).

The frozen target's embedding and lm_head are attached to the drafter, not registered in it
(dflash.drafter.model), so FSDP2 never sees them: the target stays replicated on every rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from dflash.drafter.model import DFlashDrafter

ComputeDtype = Literal["float32", "bfloat16"]


def drafter_mesh(device: torch.device, backend: str) -> DeviceMesh:
    """The one-dimensional mesh of every rank (a process group of one in a single process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dflash.train.dist import single_process_group

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
    record's phase and fault injection (`sync`, dflash.train.faults) and the memory trace's
    "gradient reduction" phase (dflash.train.trace)."""
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
