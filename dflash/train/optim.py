"""The optimizer and schedule: AdamW (ZeRO-1 sharded across ranks on request), linear warmup
then cosine, and the helpers that gather a sharded optimizer's state for a checkpoint."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from dflash.train.dist import distributed, rank_of_process
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float) -> LRScheduler:
    """Linear warmup over ceil(ratio * total) steps, then cosine to 0."""
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

def total_steps(profile: Profile, steps_per_epoch: int) -> int:
    return profile.train.max_steps or profile.train.epochs * steps_per_epoch

def build_optimizer(profile: Profile, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW; with train.optimizer_sharding = "zero1" on several ranks its states are sharded
    (ZeroRedundancyOptimizer: each rank updates its parameters, then broadcasts them). The caller
    sums the gradients over the ranks before `step`, so every rank holds the full gradient."""
    # foreach on every device: torch picks it by default on CUDA only, and the memory model and the
    # CPU tests count its one temporary over the parameters (the update's peak) as on the GPU
    lr, weight_decay = profile.train.lr, profile.train.weight_decay
    if not sharded_optimizer_wanted(profile):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr, weight_decay=weight_decay,
                                   foreach=True)

def sharded_optimizer_wanted(profile: Profile) -> bool:
    import torch.distributed as dist

    return profile.train.optimizer_sharding == "zero1" and distributed() and dist.get_world_size() > 1

def full_optimizer_state(optimizer: torch.optim.Optimizer, to_rank: int = 0) -> dict[str, object] | None:
    """The complete optimizer state on `to_rank` (None elsewhere). A sharded optimizer first gathers
    every rank's shard to `to_rank`: a collective, so EVERY rank must call this."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=to_rank)
    return optimizer.state_dict() if rank_of_process() == to_rank else None

def optimizer_shard_count(optimizer: torch.optim.Optimizer) -> int:
    """Ranks the optimizer's states are sharded over (1: every rank holds them all)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.world_size if isinstance(optimizer, ZeroRedundancyOptimizer) else 1
