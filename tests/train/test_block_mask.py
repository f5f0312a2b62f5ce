"""flex's BlockMask built from the anchors (`dflash.drafter.attention.block_mask`) is the one
`create_block_mask` builds from the dense mask_mod, table for table, and means what the SDPA
backend's dense mask means, element for element.

Cases: the full rule, sliding windows smaller and larger than the context, causal and not;
anchors as the trainer collates them (sampled, sorted, padded with 0), anchors at 0 and next to
the end, on tile boundaries (multiples of 128 and one before); block sizes 8 and 16; micro-batches
of 1 to 8 sequences; query and key counts off the 128 grid (padded tiles).

Negative controls: the same construction with the context rule off by one (`kv <= anchor` instead
of `kv < anchor`) fails the table check, and its mask_mod fails the forward check; a BlockMask
whose tiles are all full (mask_mod skipped) fails the compiled forward check.

flex_attention on CPU runs forward only; eagerly it evaluates the mask_mod over every (query, key)
pair and reads no table, so the eager forward check holds the mask_mod and the table check holds
the tables; the compiled CPU forward (`slow`) reads the tables as the GPU kernel does.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from dflash.drafter.attention import FLEX_TILE, BlockLayout, KeyRanges, block_mask, block_mask_from_ranges, make_attend, visible_key_ranges
from dflash.train.rank.data import collate_rows
from launcher_core.layer_attention import LayerAttention

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
RULES = {"full": LayerAttention(), "causal": LayerAttention(causal=True),
         "window 100": LayerAttention(window=100), "window 100 causal": LayerAttention(window=100, causal=True),
         "window 5": LayerAttention(window=5), "window 5000 (> context)": LayerAttention(window=5000),
         "window 5000 causal": LayerAttention(window=5000, causal=True)}


def layout_of(anchors: list[list[int]], context_len: int, block_size: int) -> BlockLayout:
    """Anchors per sequence, right-padded with 0 to the longest (as the trainer pads them)."""
    width = max(1, max(map(len, anchors)))
    rows = torch.zeros(len(anchors), width, dtype=torch.long)
    for i, sequence in enumerate(anchors):
        rows[i, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    return BlockLayout(rows, context_len, block_size)


def collated_layout(lengths: list[int], num_anchors: int, block_size: int, seed: int) -> BlockLayout:
    """Anchors as the trainer samples and pads them (`collate_rows`), prompts without loss."""
    rng = random.Random(seed)
    ids = [[1000 + j for j in range(length)] for length in lengths]
    masks = [[0] * (prompt := rng.randint(0, length // 3)) + [1] * (length - prompt) for length in lengths]
    batch = collate_rows(ids, masks, list(range(len(lengths))), num_anchors, seed=seed, epoch=0)
    return BlockLayout(batch.anchors, batch.input_ids.shape[1], block_size)


def edge_layout(block_size: int) -> BlockLayout:
    """Anchors at 0, on tile boundaries, next to the end; one sequence of padding only; 600 keys of
    context (not a multiple of 128) and 17 blocks (queries off the grid too at block 8)."""
    context = 600
    return layout_of([[0, 1, 127, 128, 255, 256, 300, 383, 384, 511, 512, 597, 598],
                      [],                                                            # every anchor padded
                      [0, 598],
                      [5, 60, 130, 131, 132, 133, 134, 135, 136, 137, 138, 139, 140, 141, 142, 143, 598]],
                     context, block_size)


def layouts() -> dict[str, BlockLayout]:
    return {
        "edges, block 16": edge_layout(16),
        "edges, block 8": edge_layout(8),
        "collated 8 sequences, block 8": collated_layout([700, 650, 600, 420, 300, 129, 128, 40], 40, 8, seed=1),
        "collated 3 sequences, block 16": collated_layout([1100, 900, 257], 64, 16, seed=2),
        "one sequence, block 16": collated_layout([513], 48, 16, seed=3),
    }


LAYOUTS = layouts()


def eager_block_mask(layout: BlockLayout, rule: LayerAttention) -> BlockMask:
    """What the trainer built before: create_block_mask over the dense mask_mod."""
    keys = layout.context_len + layout.num_queries
    return create_block_mask(layout.mask_mod(rule), layout.anchors.shape[0], None, layout.num_queries, keys,
                             device="cpu")


def table_mismatches(built: BlockMask, reference: BlockMask) -> list[str]:
    """Every table, shape, dtype and length where `built` differs from `reference` (the tables are
    compared whole, entries past each row's count included: both sort the same way)."""
    found = [name for name in TABLES
             if not (isinstance(getattr(built, name), torch.Tensor) and getattr(built, name).dtype == getattr(reference, name).dtype
                     and torch.equal(getattr(built, name), getattr(reference, name)))]
    found += [name for name in ("seq_lengths", "BLOCK_SIZE") if getattr(built, name) != getattr(reference, name)]
    return found


def inclusive_context(ranges: KeyRanges, layout: BlockLayout) -> KeyRanges:
    """The negative control's rows: context keys up to and including the anchor (`<=`)."""
    query_block = torch.arange(layout.num_queries) // layout.block_size
    anchor = layout.anchors[:, query_block]
    stop = torch.where(ranges.context_start <= anchor, (anchor + 1).clamp(max=layout.context_len), ranges.context_stop)
    return dataclasses.replace(ranges, context_stop=stop)


def inclusive_mask_mod(layout: BlockLayout, rule: LayerAttention):
    """The negative control's mask_mod: the layout's, plus the anchor's own context key."""
    visible, anchors, size = layout.mask_mod(rule), layout.anchors, layout.block_size

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(b, h, q_idx, kv_idx) | ((kv_idx < layout.context_len) & (kv_idx == anchors[b, q_idx // size]))

    return mask_mod


def elementwise(mask: BlockMask, layout: BlockLayout) -> torch.Tensor:
    """What flex computes through `mask`: full tiles visible, partial tiles through its mask_mod,
    empty tiles hidden, [b, 1, Q, K]."""
    queries, keys = mask.seq_lengths
    full = BlockMask.from_kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE,
                                    seq_lengths=mask.seq_lengths)

    def expand(tiles: torch.Tensor) -> torch.Tensor:
        return tiles.bool().repeat_interleave(FLEX_TILE, -2).repeat_interleave(FLEX_TILE, -1)[..., :queries, :keys]

    modded = create_mask(mask.mask_mod, layout.anchors.shape[0], None, queries, keys, device="cpu")
    return expand(full.to_dense()) | (expand(mask.to_dense()) & modded)


@pytest.mark.parametrize("rule_name", list(RULES))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_the_tables_are_create_block_masks(layout_name, rule_name):
    layout, rule = LAYOUTS[layout_name], RULES[rule_name]
    built, reference = block_mask(layout, rule), eager_block_mask(layout, rule)
    assert table_mismatches(built, reference) == []
    assert built.mask_mod is not None and (built.kv_num_blocks > 0).any()


def test_the_cases_have_full_partial_and_empty_tiles():
    """Otherwise the table check would not tell the three kinds apart."""
    kinds = {"full": 0, "partial": 0, "empty": 0}
    for layout in LAYOUTS.values():
        for rule in RULES.values():
            mask = block_mask(layout, rule)
            full, partial = int(mask.full_kv_num_blocks.sum()), int(mask.kv_num_blocks.sum())
            kinds["full"] += full
            kinds["partial"] += partial
            kinds["empty"] += mask.kv_indices.numel() - full - partial
    assert all(count > 100 for count in kinds.values()), kinds


@pytest.mark.parametrize("rule_name", list(RULES))
def test_flex_computes_the_dense_masks_visibility(rule_name):
    rule = RULES[rule_name]
    for layout in LAYOUTS.values():
        assert torch.equal(elementwise(block_mask(layout, rule), layout), layout.dense_mask(rule))


def test_the_off_by_one_context_rule_fails_the_table_check():
    failed = {}
    for name, layout in LAYOUTS.items():
        for rule_name in ("full", "window 100 causal"):
            rule = RULES[rule_name]
            wrong = block_mask_from_ranges(inclusive_context(visible_key_ranges(layout, rule), layout), layout,
                                           inclusive_mask_mod(layout, rule))
            failed[name, rule_name] = table_mismatches(wrong, eager_block_mask(layout, rule))
            assert not torch.equal(elementwise(wrong, layout), layout.dense_mask(rule))
    # the tables change where the extra key crosses a tile edge (padded anchors at 0, anchors at
    # 127 + 128 k): the edge layouts have them, sampled anchors may not
    assert all(failed[name, rule] for name in LAYOUTS if name.startswith("edges")
               for rule in ("full", "window 100 causal")), failed


def attention_inputs(layout: BlockLayout, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, 2, Q, 8], k and v [b, 1, K, 8] (grouped query attention, as the drafter's)."""
    generator = torch.Generator().manual_seed(seed)
    batch, keys = layout.anchors.shape[0], layout.context_len + layout.num_queries
    q = torch.randn(batch, 2, layout.num_queries, 8, generator=generator)
    k = torch.randn(batch, 1, keys, 8, generator=generator)
    return q, k, torch.randn(batch, 1, keys, 8, generator=generator)


@pytest.mark.parametrize("rule_name", ["full", "window 100 causal", "window 5000 (> context)"])
def test_flex_forward_equals_sdpa_with_the_dense_mask(rule_name):
    rule = RULES[rule_name]
    for layout in (LAYOUTS["edges, block 8"], LAYOUTS["one sequence, block 16"]):
        q, k, v = attention_inputs(layout)
        flex = make_attend(layout, "flex", rule)(q, k, v)
        sdpa = make_attend(layout, "sdpa", rule)(q, k, v)
        torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
        wrong = dataclasses.replace(visible_key_ranges(layout, rule))       # the right rows, the wrong mask_mod
        wrong = block_mask_from_ranges(wrong, layout, inclusive_mask_mod(layout, rule))
        off_by_one = flex_attention(q, k, v, block_mask=wrong, enable_gqa=True)
        assert not torch.allclose(off_by_one, sdpa, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_compiled_flex_reads_the_tables_and_equals_sdpa():
    """The compiled CPU kernel skips empty tiles and the mask_mod of full ones, as the GPU's does:
    with the built tables it equals SDPA; with every visible tile declared full it does not."""
    layout, rule = LAYOUTS["edges, block 16"], RULES["window 100 causal"]
    q, k, v = attention_inputs(layout, seed=1)
    compiled = torch.compile(flex_attention, dynamic=False)
    mask = block_mask(layout, rule)
    sdpa = make_attend(layout, "sdpa", rule)(q, k, v)
    torch.testing.assert_close(compiled(q, k, v, block_mask=mask, enable_gqa=True), sdpa, rtol=1e-4, atol=1e-4)
    visible = mask.to_dense()
    count, index = visible.sum(-1, dtype=torch.int32), torch.argsort(visible, dim=-1, descending=True, stable=True).int()
    none = torch.zeros_like(count)
    # (a tensor of its own per table: the CPU template cannot take one tensor as two tables)
    all_full = BlockMask.from_kv_blocks(none, index.clone(), count, index, BLOCK_SIZE=FLEX_TILE, mask_mod=mask.mask_mod,
                                        seq_lengths=mask.seq_lengths)
    assert not torch.allclose(compiled(q, k, v, block_mask=all_full, enable_gqa=True), sdpa, rtol=1e-3, atol=1e-3)
