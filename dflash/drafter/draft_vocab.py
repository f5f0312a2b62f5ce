"""The draft vocabulary (`drafter.draft_vocab_size`): the most frequent loss tokens of the data.

A drafter that proposes only the N tokens its training data uses most pays N/V of the
lm_head's cost in every training step and every draft (SmolLM2: 49,152 rows; its CPU-demo
completions use under 2,000 distinct tokens). Tokens outside it are never proposed; a
speculative step whose true token is outside simply commits the target's token.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


def count_loss_tokens(dataset: Any, max_length: int, batch_rows: int = 1024) -> Counter[int]:
    """How often each token id is a trained (loss_mask = 1) token, over the whole dataset (a
    datasets.Dataset with input_ids and loss_mask: an untyped third-party object)."""
    counts: Counter[int] = Counter()
    for start in range(0, len(dataset), batch_rows):
        part = dataset[start:start + batch_rows]
        for ids, mask in zip(part["input_ids"], part["loss_mask"]):
            ids, mask = np.asarray(ids[:max_length]), np.asarray(mask[:max_length], dtype=bool)
            values, times = np.unique(ids[mask], return_counts=True)
            counts.update(dict(zip(values.tolist(), times.tolist())))
    return counts


def draft_vocabulary(counts: Counter[int], size: int) -> list[int]:
    """The `size` most frequent ids (fewer if the data has fewer), ties to the lower id; sorted."""
    if size < 1:
        raise ValueError(f"drafter.draft_vocab_size must be positive here, got {size}")
    if not counts:
        raise ValueError("the dataset has no loss tokens to choose a draft vocabulary from")
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return sorted(token for token, _ in ranked[:size])


def coverage(counts: Counter[int], vocabulary: list[int]) -> float:
    """Share of the counted loss tokens inside `vocabulary`."""
    chosen = set(vocabulary)
    total = sum(counts.values())
    return sum(n for token, n in counts.items() if token in chosen) / total if total else 0.0
