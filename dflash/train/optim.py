"""The optimizer and schedule: AdamW over the drafter's parameter shards, linear warmup then cosine."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

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
    """AdamW over the drafter's trainable parameters: under FSDP2 (dflash.train.sharding) these are
    this rank's float32 shards, so its states are sharded too (about 8 bytes per parameter / N)."""
    # foreach on every device: torch picks it by default on CUDA only, and the memory model and the
    # CPU tests count its one temporary over the parameters (the update's peak) as on the GPU
    return torch.optim.AdamW(params, lr=profile.train.lr, weight_decay=profile.train.weight_decay, foreach=True)
