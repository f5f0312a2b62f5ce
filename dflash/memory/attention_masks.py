"""What flex attention's BlockMasks cost in a training step, and why sliding-window layers save none.

Training builds one BlockMask per distinct layer rule (`dflash.drafter.attention.make_layer_attends`)
at the start of every micro-batch's drafter forward and keeps it through the backward.
Resident (`block_mask_bytes`): per sequence, the int32 block counts and indices of the partial and
the full tiles, for the query side and transposed for the key side, in tiles of FLEX_TILE.
Transient (`block_mask_build_bytes`): the larger of the two phases of
`dflash.drafter.attention.block_mask` (per-row key and tile ranges beside two counting grids; the
key-side transpose of `BlockMask.from_kv_blocks`), a bound on what the CPU allocator measures
(tests/memory/test_attention_masks.py). The model counts both per sequence beside the drafter's
activations (`dflash.memory.activations.drafter_activations_mib`).

A sliding window saves no training memory: the anchors spread over the whole sequence, so every
layer keeps the K/V of all context positions and flex saves the same tensors whatever the mask; the
window skips score blocks (compute). The saving is the draft cache's at inference
(dflash.drafter.draft_cache). Figures: benchmarks/results/block-mask_cpu-2core_2026-12-02.md.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dflash.drafter.attention import FLEX_TILE

if TYPE_CHECKING:
    from dflash.memory.workload import Workload

BLOCK_MASK_TABLES = 4       # partial and full blocks, for the query side and the transposed key side
INT32_BYTES = 4
INT64_BYTES = 8
MIB = 1024 * 1024           # the memory model's unit (dflash.memory.peak_estimate.MIB)
BUILD_ROW_INT64 = 9         # the 4 key ranges, one tile range's input, first/end and their where() outputs
BUILD_ROW_FLAGS = 2         # booleans per row: the ranges that meet, a tile range's "some"
BUILD_ROW_GRIDS = 2         # int32 [query tiles, key tiles + 1]: touched counts, covered steps
TRANSPOSE_BYTES_PER_TILE = 2 * INT32_BYTES + 1 + 2 * INT64_BYTES   # dense grid, valid indices, mask, index_put's indices
BUILD_FIXED_BYTES = 4096    # scalars, aranges and counts of a few hundred entries (bound)


def tile_grid(num_queries: int, num_keys: int) -> tuple[int, int]:
    """Query tiles x key tiles of flex's grid."""
    return math.ceil(num_queries / FLEX_TILE), math.ceil(num_keys / FLEX_TILE)


def block_mask_bytes(num_queries: int, num_keys: int) -> int:
    """One sequence's BlockMask: block counts and indices of its query/key block grid."""
    query_tiles, key_tiles = tile_grid(num_queries, num_keys)
    indices = BLOCK_MASK_TABLES * query_tiles * key_tiles             # [Qb, Kb] and [Kb, Qb], partial and full
    counts = 2 * (query_tiles + key_tiles)                            # per row of each, partial and full
    return INT32_BYTES * (indices + counts)


def block_mask_build_bytes(num_queries: int, num_keys: int) -> int:
    """One sequence's transient while `dflash.drafter.attention.block_mask` builds its BlockMask,
    above what was live before (the resident tables it leaves are part of the tables phase)."""
    query_tiles, key_tiles = tile_grid(num_queries, num_keys)
    grid = query_tiles * (key_tiles + 1)
    rows = num_queries * (BUILD_ROW_INT64 * INT64_BYTES + BUILD_ROW_FLAGS) + BUILD_ROW_GRIDS * INT32_BYTES * grid
    tables = block_mask_bytes(num_queries, num_keys) + TRANSPOSE_BYTES_PER_TILE * grid
    return max(rows, tables) + BUILD_FIXED_BYTES


def dense_mask_bytes(num_queries: int, num_keys: int) -> int:
    """The boolean [queries x keys] mask `create_block_mask` starts from (its int64 reductions
    and the mask_mod's intermediates come on top: ~10 to 13 bytes per element, measured)."""
    return num_queries * num_keys


def distinct_layer_rules(sliding_layers: int, drafter_layers: int) -> int:
    """Rules among the layers: full + sliding when both are present, else one."""
    return 1 + (0 < sliding_layers < drafter_layers)


def _mask_shape(workload: Workload) -> tuple[int, int]:
    queries = workload.block_tokens
    return queries, workload.max_length + queries


def block_masks_mib(workload: Workload) -> float:
    """Per sequence: every layer rule's BlockMask, resident from the forward through the backward."""
    rules = distinct_layer_rules(workload.sliding_layers, workload.drafter_layers)
    return rules * block_mask_bytes(*_mask_shape(workload)) / MIB


def mask_build_peak_mib(workload: Workload) -> float:
    """Per sequence, the moment the last rule's mask is built: the others resident, its transient."""
    rules = distinct_layer_rules(workload.sliding_layers, workload.drafter_layers)
    shape = _mask_shape(workload)
    return ((rules - 1) * block_mask_bytes(*shape) + block_mask_build_bytes(*shape)) / MIB
