"""The drafter materialised per shard: built on the meta device, sharded by FSDP2, then given memory
on the rank's device (`to_empty`) and its values one tensor at a time (torchtitan's order).

A rank never holds the whole drafter. Each *init unit* (a module whose constructor draws its
values: nn.Linear, the RMSNorms, the rotary embedding, DFlash 2's convolutions and selector) is
built again on the host, alone, in the drafter's construction order: with the same seed it draws
exactly the numbers the whole drafter's constructor drew, so the global parameters are those of
the whole-drafter build (`dflash.train.rank.setup.build_drafter`) at any world size. Each of its
tensors then goes to the drafter: this rank's chunk of it (FSDP2's dim-0 chunk, the DTensor's local
tensor), or the whole tensor for buffers (the rotary `inv_freq`, not saved in checkpoints, is
recomputed this way). An `initial values` mapping (target init, a drafter checkpoint, the norm fill,
the draft vocabulary) replaces a unit's fresh value by name; a value is a tensor or a function
that reads it (a checkpoint's tensors are read one at a time).

What a rank holds on the host while starting is then one init unit at a time (its largest: one
weight matrix, or DFlash 2's selector): `dflash.memory.host_ram` counts it.
"""
from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.drafter.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from dflash.drafter.network import DFlashDrafter, InitValue, resolved


def rebuild_linear(module: nn.Module) -> nn.Module:
    assert isinstance(module, nn.Linear)
    return nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)


def rebuild_norm(module: nn.Module) -> nn.Module:
    assert isinstance(module, Qwen3RMSNorm)
    return Qwen3RMSNorm(module.weight.shape[0], eps=module.variance_epsilon)


def rebuild_rotary(module: nn.Module) -> nn.Module:
    assert isinstance(module, Qwen3RotaryEmbedding)
    return Qwen3RotaryEmbedding(module.config)


def rebuild_conv(module: nn.Module) -> nn.Module:
    assert isinstance(module, GroupedDynamicCausalConv)
    return GroupedDynamicCausalConv(module.base_kernel.shape[-1], module.kernel_size, module.group_size, module.block_size)


def rebuild_selector(module: nn.Module) -> nn.Module:
    assert isinstance(module, CandidateSelector)
    vocab, rank = module.predecessor_codebook.shape
    projection = module.hidden_projection
    assert isinstance(projection, nn.Linear)
    return CandidateSelector(projection.in_features, vocab, rank, module.top_k)


# Each init unit's constructor, called again with the unit's own sizes (first match wins).
REBUILDERS: tuple[tuple[type[nn.Module], Callable[[nn.Module], nn.Module]], ...] = (
    (nn.Linear, rebuild_linear), (Qwen3RMSNorm, rebuild_norm), (Qwen3RotaryEmbedding, rebuild_rotary),
    (GroupedDynamicCausalConv, rebuild_conv), (CandidateSelector, rebuild_selector),
)


def rebuilder(module: nn.Module) -> Callable[[nn.Module], nn.Module] | None:
    return next((build for kind, build in REBUILDERS if isinstance(module, kind)), None)


def init_units(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(name prefix, unit) in construction order (registration order: each module is assigned as it is built)."""
    for name, child in module.named_children():
        if rebuilder(child) is not None:
            yield f"{prefix}{name}.", child
            continue
        if any(True for _ in child.parameters(recurse=False)):
            raise TypeError(f"{prefix}{name} ({type(child).__name__}) holds parameters but has no rebuilder in "
                            f"dflash.train.rank.materialize.REBUILDERS: its values would be left uninitialised")
        yield from init_units(child, f"{prefix}{name}.")


def local_chunk(full: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's part of `full` as FSDP2 shards it (dim 0 in torch.chunk's pieces; none past the last)."""
    if tuple(sharded.placements) != (Shard(0),):
        raise ValueError(f"expected a Shard(0) parameter (FSDP2 on a one-dimensional mesh), got {sharded.placements}")
    mesh = sharded.device_mesh
    pieces = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    piece = pieces[rank] if rank < len(pieces) else full.narrow(0, 0, 0)
    local = sharded.to_local()
    assert piece.shape == local.shape, f"chunk {tuple(piece.shape)} vs local shard {tuple(local.shape)}"
    return piece


@torch.no_grad()
def set_value(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole value `full` into `tensor`: its local shard when sharded, all of it otherwise."""
    if isinstance(tensor, DTensor):
        tensor.to_local().copy_(local_chunk(full, tensor))
    else:
        tensor.copy_(full)


@torch.no_grad()
def materialize(drafter: DFlashDrafter, device: torch.device, initial: Mapping[str, InitValue]) -> None:
    """Give the (meta, sharded) drafter memory on `device` and its values: each init unit built again on
    the host in construction order (the caller seeds the RNG as for the whole build), a name in `initial`
    taking its value instead. Every parameter and buffer is written; every name in `initial` is used."""
    drafter.to_empty(device=device)
    written: set[str] = set()
    for prefix, unit in init_units(drafter):
        fresh = rebuilt(unit)
        targets = {**dict(unit.named_buffers()), **dict(unit.named_parameters())}
        for name, value in [*fresh.named_parameters(), *fresh.named_buffers()]:
            key = prefix + name
            set_value(targets[name], resolved(initial[key]) if key in initial else value)
            written.add(key)
        del fresh
    for name, buffer in drafter.named_buffers(recurse=False):      # the draft vocabulary: zeros as constructed
        set_value(buffer, resolved(initial[name]) if name in initial else torch.zeros_like(buffer))
        written.add(name)
    _check_complete(drafter, written, initial)


def rebuilt(unit: nn.Module) -> nn.Module:
    """The unit built again on the host by its own constructor (drawing from the RNG as it did)."""
    build = rebuilder(unit)
    assert build is not None, "init_units yields rebuildable units only"
    return build(unit)


def _check_complete(drafter: nn.Module, written: set[str], initial: Mapping[str, InitValue]) -> None:
    every = {name for name, _ in drafter.named_parameters()} | {name for name, _ in drafter.named_buffers()}
    if every - written:
        raise RuntimeError(f"materialize left {sorted(every - written)} uninitialised")
    if set(initial) - written:
        raise RuntimeError(f"initial values for tensors the drafter does not have: {sorted(set(initial) - written)}")
