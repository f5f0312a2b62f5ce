"""Block attention for DFlash training: which keys each block token may see, and two backends.

Layout of one sequence in a training forward: queries are the N blocks of B tokens
(block-major, N*B rows); keys are the S context positions followed by the same N*B block tokens.
Block b (anchor a_b) sees context positions strictly before its anchor (`kv < a_b`) and all B
tokens of its own block (bidirectional), nothing of any other block.

`flex`: torch flex_attention with a BlockMask (compiled on GPU; on CPU it runs forward only).
`sdpa`: scaled_dot_product_attention with the same visibility as a dense boolean mask.

A layer's own rule (`dflash.drafter.layers.LayerAttention`: a sliding window, causal) narrows that
visibility further by position: a query at position p sees a key at position j only where
`p - j < window` (and `j - p < window` when not causal) and, when causal, `j <= p`
(`position_rule_mask`, the same in both backends and in the in-process decoder).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from dflash.drafter.layers import LayerAttention

if TYPE_CHECKING:
    import torch

Backend = Literal["flex", "sdpa"]
Attend = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
MaskMod = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
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
    from torch.nn.attention.flex_attention import create_block_mask

    device = layout.anchors.device
    keys = layout.context_len + layout.num_queries
    block_mask = create_block_mask(layout.mask_mod(rule), layout.anchors.shape[0], None,
                                   layout.num_queries, keys, device=str(device))
    flex = _flex_function(device.type)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

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
