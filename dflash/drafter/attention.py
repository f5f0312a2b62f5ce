"""Block attention for DFlash training: which keys each block token may see, and two backends.

Queries are a sequence's N blocks of B tokens (block-major); keys are its S context positions
followed by the same N*B block tokens. Block b (anchor a_b) sees context positions strictly before
its anchor (`kv < a_b`) and all of its own block, nothing of another block; a layer's own rule
(`LayerAttention`: window, causal) narrows that by position (`position_rule_mask`, the same in both
backends and the in-process decoder). `flex`: flex_attention with a BlockMask counted from the
anchors (`block_mask`: `create_block_mask`'s tables without evaluating every (query, key) pair);
`sdpa`: the same visibility as a dense boolean mask. Details: docs/memory-model.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Literal

from launcher_core.layer_attention import LayerAttention

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

Backend = Literal["flex", "sdpa"]
Attend = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
MaskMod = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
FLEX_TILE = 128             # flex_attention's BlockMask tile (its default BLOCK_SIZE, queries and keys)
_COMPILED_FLEX: dict[str, Callable[..., "torch.Tensor"]] = {}


@dataclass(frozen=True)
class BlockLayout:
    """Anchors [b, N] (padded anchors are 0 and see no context), S context rows, block size B."""

    anchors: "torch.Tensor"
    context_len: int
    block_size: int

    @property
    def num_queries(self) -> int:
        return self.anchors.shape[1] * self.block_size

    def query_positions(self) -> "torch.Tensor":
        """Position ids of the block tokens: anchor + k, [b, N*B]."""
        import torch

        offsets = torch.arange(self.block_size, device=self.anchors.device)
        return (self.anchors[:, :, None] + offsets).flatten(1)

    def key_positions(self) -> "torch.Tensor":
        """Position ids of the keys: context 0..S-1, then the block tokens, [b, S + N*B]."""
        import torch

        batch = self.anchors.shape[0]
        context = torch.arange(self.context_len, device=self.anchors.device).expand(batch, -1)
        return torch.cat([context, self.query_positions()], dim=1)

    def dense_mask(self, rule: LayerAttention = LayerAttention()) -> "torch.Tensor":
        """Boolean visibility [b, 1, N*B, S + N*B] (True = may attend), narrowed by the layer's `rule`."""
        import torch

        device = self.anchors.device
        query_block = torch.arange(self.num_queries, device=device) // self.block_size
        query_anchor = self.anchors[:, query_block]                                   # [b, NB]
        context_visible = torch.arange(self.context_len, device=device) < query_anchor[:, :, None]
        own_block = query_block[:, None] == query_block[None, :]                      # [NB, NB]
        own_block = own_block.expand(self.anchors.shape[0], -1, -1)
        layout = torch.cat([context_visible, own_block], dim=2)[:, None]
        if not rule.restricts:
            return layout
        return layout & position_rule_mask(self.query_positions(), self.key_positions(), rule)

    def mask_mod(self, rule: LayerAttention = LayerAttention()) -> MaskMod:
        """The same visibility as a flex_attention mask_mod."""
        import torch

        anchors, context_len, block_size = self.anchors, self.context_len, self.block_size

        def visible(b: torch.Tensor, _h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            query_block = q_idx // block_size
            in_context = kv_idx < context_len
            sees_context = kv_idx < anchors[b, query_block]
            key_block = (kv_idx - context_len) // block_size
            same_block = key_block == query_block
            seen = torch.where(in_context, sees_context, same_block)
            if not rule.restricts:
                return seen
            query_pos = anchors[b, query_block] + q_idx % block_size
            key_in_block = anchors[b, key_block.clamp(min=0)] + (kv_idx - context_len) % block_size
            key_pos = torch.where(in_context, kv_idx, key_in_block)
            return seen & _rule_visible(query_pos, key_pos, rule)

        return visible


def _rule_visible(query_pos: "torch.Tensor", key_pos: "torch.Tensor", rule: LayerAttention) -> "torch.Tensor":
    """query/key positions (broadcastable) -> may attend under the layer's window / causal rule."""
    visible = key_pos <= query_pos if rule.causal else (key_pos == key_pos)
    if rule.window is not None:
        visible = visible & (query_pos - key_pos < rule.window)
        if not rule.causal:
            visible = visible & (key_pos - query_pos < rule.window)
    return visible


def position_rule_mask(query_positions: "torch.Tensor", key_positions: "torch.Tensor",
                       rule: LayerAttention) -> "torch.Tensor":
    """[b, Q] query and [b, K] key position ids -> boolean [b, 1, Q, K] of the layer's rule."""
    return _rule_visible(query_positions[:, :, None], key_positions[:, None, :], rule)[:, None]


def resolve_backend(choice: Literal["auto", "flex", "sdpa"], device_type: str) -> Backend:
    """train.attention (its choices are the profile schema's): `auto` -> flex on CUDA (compiled,
    trains), sdpa elsewhere (flex has no CPU backward)."""
    if choice != "auto":
        return choice
    return "flex" if device_type == "cuda" else "sdpa"


def make_attend(layout: BlockLayout, backend: Backend, rule: LayerAttention = LayerAttention()) -> Attend:
    """A function (q [b,hq,Q,d], k, v [b,hkv,K,d]) -> [b,hq,Q,d] with the layout's visibility
    narrowed by the layer's `rule`."""
    return _flex_attend(layout, rule) if backend == "flex" else _sdpa_attend(layout.dense_mask(rule))


def make_layer_attends(layout: BlockLayout, backend: Backend, rules: "list[LayerAttention]") -> "list[Attend]":
    """One attend per draft layer; layers with the same rule share one mask."""
    made: dict[LayerAttention, Attend] = {}
    for rule in rules:
        if rule not in made:
            made[rule] = make_attend(layout, backend, rule)
    return [made[rule] for rule in rules]


def _sdpa_attend(mask: "torch.Tensor") -> Attend:
    import torch.nn.functional as F

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def _flex_attend(layout: BlockLayout, rule: LayerAttention = LayerAttention()) -> Attend:
    mask = block_mask(layout, rule)
    flex = _flex_function(layout.anchors.device.type)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def _flex_function(device_type: str) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled once per process on CUDA (eager materialises all scores)."""
    import warnings

    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention
    if "cuda" not in _COMPILED_FLEX:
        _COMPILED_FLEX["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX["cuda"]


# --- flex's BlockMask from the anchors ---------------------------------------------------------

@dataclass(frozen=True)
class KeyRanges:
    """What each query row sees, [b, Q] key indices: the context keys [context_start, context_stop)
    and its own block's keys [block_start, block_stop) (empty where start >= stop)."""

    context_start: "torch.Tensor"
    context_stop: "torch.Tensor"
    block_start: "torch.Tensor"
    block_stop: "torch.Tensor"


def visible_key_ranges(layout: BlockLayout, rule: LayerAttention = LayerAttention()) -> KeyRanges:
    """The keys each query row may see (the visibility of `dense_mask` and `mask_mod`, row by row):
    context keys before the row's anchor (and, under a window, after position - window), its own
    block's keys within the window (and up to itself when causal). A key before the anchor is also
    before the query's position, so the causal rule and the window's forward side cut nothing there."""
    import torch

    size, context_len, window = layout.block_size, layout.context_len, rule.window
    slot = torch.arange(layout.num_queries, device=layout.anchors.device)
    query_block = slot // size
    slot -= query_block * size
    anchor = layout.anchors[:, query_block]                                 # [b, Q]
    context_stop = anchor.clamp(max=context_len)
    block_first = query_block.mul_(size).add_(context_len)                  # the row's block's first key
    context_start = torch.zeros((), dtype=anchor.dtype, device=anchor.device).expand_as(anchor)
    block_start = block_first
    if window is not None:
        context_start = (anchor + slot).sub_(window - 1).clamp_(min=0)
        block_start = block_first + (slot - (window - 1)).clamp_(min=0)
    del anchor
    if rule.causal:
        block_stop = block_first + slot + 1
    elif window is not None:
        block_stop = block_first + (slot + window).clamp_(max=size)
    else:
        block_stop = block_first + size
    context_start, block_start, block_stop = (t.expand_as(context_stop) for t in (context_start, block_start, block_stop))
    return KeyRanges(context_start, context_stop, block_start, block_stop)


def block_mask(layout: BlockLayout, rule: LayerAttention = LayerAttention()) -> "BlockMask":
    """flex's BlockMask of the layout under `rule`, the same tables as
    `create_block_mask(layout.mask_mod(rule), b, None, Q, K)` without its dense [b, Q, K] mask."""
    return block_mask_from_ranges(visible_key_ranges(layout, rule), layout, layout.mask_mod(rule))


def block_mask_from_ranges(ranges: KeyRanges, layout: BlockLayout, mask_mod: MaskMod) -> "BlockMask":
    """The BlockMask of rows that see `ranges`: a tile is full when all FLEX_TILE of its rows cover
    all FLEX_TILE of its keys, partial when some row sees some of its keys (flex applies `mask_mod`
    there), empty otherwise; the tables ordered as `create_block_mask` orders them."""
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = tile_kinds(ranges, layout.num_queries, layout.context_len + layout.num_queries)
    del ranges                                              # the rows' ranges: not needed for the tables
    partial_count, partial_index = _ordered(partial)
    full_count, full_index = _ordered(full)
    del partial, full
    return BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index,
                                    BLOCK_SIZE=(FLEX_TILE, FLEX_TILE), mask_mod=mask_mod,
                                    seq_lengths=(layout.num_queries, layout.context_len + layout.num_queries))


def tile_kinds(ranges: KeyRanges, num_queries: int, num_keys: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """Partial and full tiles, int32 [b, 1, query tiles, key tiles] (1 = that kind). Rows and keys
    past the ends (the last tiles' padding) see nothing, as in `create_block_mask`."""
    grid = (-(-num_queries // FLEX_TILE), -(-num_keys // FLEX_TILE))
    touched = _rows_per_tile(_touched_ranges(ranges), ranges.context_start.shape, grid)
    full = _rows_per_tile(_covered_ranges(ranges), ranges.context_start.shape, grid) == FLEX_TILE
    partial = (touched > 0) & ~full
    del touched
    return partial.int()[:, None], full.int()[:, None]


def _touched_ranges(ranges: KeyRanges) -> "Iterator[tuple[torch.Tensor, torch.Tensor]]":
    """Per row, the key tiles [first, end) holding some key it sees: one range per key range."""
    yield _tile_range(ranges.context_start, ranges.context_stop, covered=False)
    yield _tile_range(ranges.block_start, ranges.block_stop, covered=False)


def _covered_ranges(ranges: KeyRanges) -> "Iterator[tuple[torch.Tensor, torch.Tensor]]":
    """Per row, the key tiles [first, end) whose every key it sees: inside one key range, or inside
    both where they meet (block 0's rows when its anchor is S or beyond and no window cuts the
    context: not in training, where anchors lie inside the context, but the rule is the same)."""
    import torch

    joined = (ranges.context_start < ranges.context_stop) & (ranges.context_stop == ranges.block_start)
    yield _tile_range(ranges.context_start, torch.where(joined, ranges.block_stop, ranges.context_stop), covered=True)
    yield _tile_range(torch.where(joined, ranges.block_stop, ranges.block_start), ranges.block_stop, covered=True)


def _tile_range(start: "torch.Tensor", stop: "torch.Tensor", covered: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """Key tiles [first, end) with some key (`covered`: every key) in [start, stop); none: first = end = 0."""
    import torch

    if covered:
        first, end = (start + FLEX_TILE - 1) // FLEX_TILE, stop // FLEX_TILE
        some = first < end
    else:
        first, end = start // FLEX_TILE, (stop - 1) // FLEX_TILE + 1
        some = start < stop
    return torch.where(some, first, 0), torch.where(some, end, 0)


def _rows_per_tile(tile_ranges: "Iterable[tuple[torch.Tensor, torch.Tensor]]", rows_shape: "torch.Size",
                   grid: tuple[int, int]) -> "torch.Tensor":
    """[b, query tiles, key tiles]: how many rows of each query tile have the key tile in one of
    their [first, end) tile ranges ([b, Q] each, made one at a time): +1 at first, -1 at end,
    summed along the keys. Rows past the last query (the last tile's padding) have no range."""
    import torch
    import torch.nn.functional as F

    (batch, rows), (query_tiles, key_tiles) = rows_shape, grid
    pad = query_tiles * FLEX_TILE - rows
    steps: torch.Tensor | None = None
    for first, end in tile_ranges:
        if steps is None:
            steps = torch.zeros(batch, query_tiles, key_tiles + 1, dtype=torch.int32, device=first.device)
            up, down = (torch.tensor(value, dtype=torch.int32, device=first.device).expand(batch, query_tiles, FLEX_TILE)
                        for value in (1, -1))
        for index, step in ((first, up), (end, down)):
            if pad:
                index = F.pad(index, (0, pad))
            steps.scatter_add_(2, index.reshape(batch, query_tiles, FLEX_TILE), step)
        del first, end, index
    assert steps is not None, "no tile ranges"
    return steps.cumsum(2, dtype=torch.int32)[..., :key_tiles]


def _ordered(kinds: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """Tiles of one kind per query tile, as flex's tables: their count and the key tile indices,
    the tiles of that kind first, each part ascending (create_block_mask's stable descending sort)."""
    import torch

    count = kinds.sum(-1, dtype=torch.int32)
    return count, torch.argsort(kinds, dim=-1, descending=True, stable=True).to(torch.int32)
