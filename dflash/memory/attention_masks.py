"""What flex attention's BlockMasks cost in a training step, and what sliding-window layers save.

Training (flex_attention on CUDA) builds one BlockMask per distinct layer rule
(`dflash.drafter.attention.make_layer_attends`) at the start of every micro-batch's drafter
forward, and keeps it through the backward: a drafter with sliding layers and full ones holds two.

Resident (`block_mask_bytes`): a BlockMask stores, per sequence, int32 block counts and block
indices of the partial and the full tiles, for the query side and again transposed for the key
side: 4 x (query tiles x key tiles) x 4 bytes plus the per-row counts, tiles of FLEX_TILE = 128
(queries: anchors x B block tokens; keys: context + block tokens). 0.13 MiB a sequence at 512
anchors x 16 and 8,192 tokens.

Transient (`block_mask_build_bytes`): `dflash.drafter.attention.block_mask` builds the tables from
the anchors, never from a dense [queries x keys] mask, in two phases, the larger of which is the
build's peak above what was live before it:
* rows: per query row, int64 key ranges and tile ranges (`visible_key_ranges`, `tile_kinds`: at
  most BUILD_ROW_INT64 of them alive at once, and BUILD_ROW_FLAGS booleans) while two int32
  counting grids of query tiles x (key tiles + 1) fill (the touched tiles', then the covered ones');
* tables: `BlockMask.from_kv_blocks` transposes the partial and the full tables for the key side
  (torch's `_ordered_to_dense`: an int32 dense grid, the valid indices, their boolean mask and
  index_put's two int64 index grids, TRANSPOSE_BYTES_PER_TILE in all) beside the tables made so far
  (counted here as all four: a bound).
0.64 MiB a sequence at 512 anchors x 16 and 8,192 tokens (measured: 0.58 to 0.64 MiB, by the rule,
tests/memory/test_attention_masks.py), where `create_block_mask` made 1,280 MiB (full rule) and
1,665 MiB (sliding) of dense mask and its reductions (benchmarks/results/block-mask_cpu-2core_2026-12-02.md). The row
phase's [queries] position tensors are shared by the micro-batch's sequences: per sequence, the
figure is exact at one sequence and a bound above.

The model (`dflash.memory.activations.drafter_activations_mib`) counts, per sequence, every rule's
resident mask beside the drafter's saved activations, and the moment the last mask is built (the
others resident, the build's transient) when that is larger: it never is at a real shape, the
transient being a few hundred KiB against GiBs of activations.

Saving: none in a training step's memory. Every context position is some block's window (the
anchors spread over the whole sequence), so every layer still projects and keeps the K/V of all
S context positions, and flex_attention saves q, k, v, its output and the log-sum-exp whatever
the mask; the window only skips score blocks (compute, not memory). The saving is at inference:
the draft cache keeps `window` positions per sliding layer (`dflash.drafter.draft_cache`).
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
MIB = 1024 * 1024           # the memory model's unit (dflash.memory.model.MIB)
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
