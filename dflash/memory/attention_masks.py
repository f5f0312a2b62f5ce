"""What sliding-window draft layers cost and save in a training step's memory.

Training (flex_attention on CUDA) builds one BlockMask per distinct layer rule
(`dflash.drafter.attention.make_layer_attends`): a drafter with sliding layers and full ones holds
two. A BlockMask stores, per sequence, int32 block counts and block indices of the partial and the
full blocks, for the query side and again transposed for the key side: about
4 x (query blocks x key blocks) x 4 bytes (plus the per-row counts), blocks of 128 (queries: anchors x B block tokens;
keys: context + block tokens). The first mask is part of every drafter (and, like the rest of
the mask, a few hundred KiB at most); `extra_block_mask_mib` is what each further rule adds.

Saving: none in a training step's memory. Every context position is some block's window (the
anchors spread over the whole sequence), so every layer still projects and keeps the K/V of all
S context positions, and flex_attention saves q, k, v, its output and the log-sum-exp whatever
the mask; the window only skips score blocks (compute, not memory). The saving is at inference:
the draft cache keeps `window` positions per sliding layer (`dflash.drafter.draft_cache`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.memory.workload import Workload

FLEX_BLOCK = 128            # flex_attention's default BLOCK_SIZE (queries and keys)
BLOCK_MASK_TABLES = 4       # partial and full blocks, for the query side and the transposed key side
INT32_BYTES = 4
MIB = 1024 * 1024           # the memory model's unit (dflash.memory.model.MIB)


def block_mask_bytes(num_queries: int, num_keys: int) -> int:
    """One sequence's BlockMask: block counts and indices of its query/key block grid."""
    query_blocks, key_blocks = math.ceil(num_queries / FLEX_BLOCK), math.ceil(num_keys / FLEX_BLOCK)
    indices = BLOCK_MASK_TABLES * query_blocks * key_blocks           # [Qb, Kb] and [Kb, Qb], partial and full
    counts = 2 * (query_blocks + key_blocks)                          # per row of each, partial and full
    return INT32_BYTES * (indices + counts)


def distinct_layer_rules(sliding_layers: int, drafter_layers: int) -> int:
    """Rules among the layers: full + sliding when both are present, else one."""
    return 1 + (0 < sliding_layers < drafter_layers)


def extra_block_mask_mib(workload: Workload) -> float:
    """Per sequence: the BlockMasks beyond the first (one more when sliding and full layers mix)."""
    extra = distinct_layer_rules(workload.sliding_layers, workload.drafter_layers) - 1
    if not extra:
        return 0.0
    queries = workload.block_tokens
    return extra * block_mask_bytes(queries, workload.max_length + queries) / MIB
