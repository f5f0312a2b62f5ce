"""The drafter's context K/V cache for in-process decoding.

A draft layer's keys and values of context position j depend only on the target's tap features
of j (fc -> hidden_norm -> the layer's k/v projections, k RMSNorm, RoPE at j): the context is the
same input to every layer, only the block's hidden state moves through them. So each layer's
context K/V are kept, extended with the features of the positions the verify step committed
(accepted draft tokens and the bonus token), and never recomputed. The block's own K/V are
computed per step and never enter the cache, so a rejection leaves nothing to undo; `crop`
drops positions if the committed sequence ever goes back. In a sliding layer only the last
`window` positions are kept (the block anchored at a sees positions > a - window).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from dflash.drafter.network import DFlashDrafter


@dataclass
class LayerKV:
    """One layer's cached context keys / values [1, kv heads, n, d] of positions start..start+n-1."""

    keys: "torch.Tensor"
    values: "torch.Tensor"
    start: int = 0
    window: Optional[int] = None     # a sliding layer keeps the last `window` positions

    def positions(self) -> "torch.Tensor":
        import torch

        return torch.arange(self.start, self.start + self.keys.shape[2], device=self.keys.device)


@dataclass
class DraftContextCache:
    """Context K/V of positions 0..length-1 for every draft layer (bounded in sliding layers)."""

    layers: list[LayerKV] = field(default_factory=list)
    length: int = 0

    def crop(self, length: int) -> bool:
        """Forget positions from `length` on; False (cache unchanged) when a sliding layer already
        dropped positions the block after `length` would see: rebuild it then."""
        if length >= self.length:
            return True
        if any(layer.start > max(0, length - (layer.window or length)) for layer in self.layers):
            return False
        for layer in self.layers:
            keep = length - layer.start
            layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
        self.length = length
        return True


def extend_cache(drafter: "DFlashDrafter", cache: DraftContextCache, features: "torch.Tensor",
                 context_k_norm_layer: Optional[int] = None) -> DraftContextCache:
    """Add the context K/V of the positions after `cache.length` whose tap features [1, n, L*H] are given;
    `context_k_norm_layer`: every layer's context keys normed with that layer's k_norm, as an engine that
    does so computes them (dflash.eval.engines.EngineDeviation), None: each layer's own."""
    import torch

    if features.shape[1] == 0:
        return cache
    context = drafter.project_context(features)
    positions = torch.arange(cache.length, cache.length + features.shape[1], device=features.device)[None]
    cos, sin = drafter.rotary_emb(context, positions)
    layers = list(drafter.decoder_layers)
    k_norm = None if context_k_norm_layer is None else layers[context_k_norm_layer].self_attn.k_norm
    for index, (layer, rule) in enumerate(zip(layers, drafter.layer_rules)):
        keys, values = layer.self_attn.project_kv(context, cos, sin, k_norm)
        if index < len(cache.layers):
            old = cache.layers[index]
            keys, values = torch.cat([old.keys, keys], dim=2), torch.cat([old.values, values], dim=2)
            start = old.start
        else:
            cache.layers.append(LayerKV(keys, values))
            start = 0
        drop = keys.shape[2] - rule.window if rule.window is not None and keys.shape[2] > rule.window else 0
        cache.layers[index] = LayerKV(keys[:, :, drop:], values[:, :, drop:], start + drop, rule.window)
    cache.length += features.shape[1]
    return cache
