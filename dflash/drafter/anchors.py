"""Anchor sampling: where the training blocks start.

An anchor is a position i with loss_mask[i] and loss_mask[i + 1] (the block's first prediction,
slot 1, is a trained token). Up to `num_anchors` per sequence, drawn without replacement,
resampled every epoch, reproducible from (seed, epoch, row).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def valid_anchor_positions(loss_mask: Sequence[int] | np.ndarray) -> np.ndarray:
    """Positions i with loss_mask[i] and loss_mask[i + 1] (int64, ascending)."""
    mask = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(mask[:-1] & mask[1:]).astype(np.int64)


def sample_anchors(loss_mask: Sequence[int] | np.ndarray, num_anchors: int, *, seed: int, epoch: int,
                   row: int) -> np.ndarray:
    """Up to `num_anchors` valid positions, sorted; the same (seed, epoch, row) gives the same draw."""
    candidates = valid_anchor_positions(loss_mask)
    if len(candidates) <= num_anchors:
        return candidates
    rng = np.random.default_rng([seed, epoch, row])
    return np.sort(rng.choice(candidates, size=num_anchors, replace=False))
