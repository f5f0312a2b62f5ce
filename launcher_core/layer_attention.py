"""The attention each draft layer is trained with, from the config keys that decide it: `layer_types`
(`full_attention`, `sliding_attention`), `sliding_window`, `is_causal`, resolved as the reference (PyPI
`dflash` 0.1.0, `Qwen3DFlashAttention`) and vLLM 0.32 resolve them: a sliding layer has the window and is
causal, a full layer is bidirectional, unless `is_causal` says otherwise.

One rule, read by both floors above: the drafter builds its masks from it (dflash.drafter.layers) and the
engine rules (envcheck.engine_releases) hold what each serving engine release runs against it. Here because the
machine floor (envcheck) may not import the workload (dflash). Rules: docs/drafter.md "Drafter layers".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from launcher_core.schema import DrafterSection

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class LayerAttention:
    """One draft layer's visibility rule beyond the block layout: a window (None: unbounded), causal or not."""

    window: Optional[int] = None
    causal: bool = False

    @property
    def restricts(self) -> bool:
        """False for plain full, bidirectional attention (no extra mask needed)."""
        return self.window is not None or self.causal

    def describe(self) -> str:
        window = f"window {self.window}" if self.window is not None else "no window"
        return f"{'causal' if self.causal else 'bidirectional'}, {window}"


@dataclass(frozen=True)
class DraftLayers:
    """The config.json keys that decide a drafter's attention."""

    num_layers: int
    layer_types: Optional[Sequence[str]] = None     # None: the key is absent (every layer full attention)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None

    def kinds(self) -> list[str]:
        return list(self.layer_types) if self.layer_types is not None else [FULL] * self.num_layers


def reference_rules(layers: DraftLayers) -> list[LayerAttention]:
    """The attention the drafter is trained with (the reference's rule; module doc)."""
    rules = []
    for kind in layers.kinds():
        sliding = kind == SLIDING
        causal = sliding if layers.is_causal is None else bool(layers.is_causal)
        window = int(layers.sliding_window) if sliding and layers.sliding_window else None
        rules.append(LayerAttention(window=window, causal=causal))
    return rules


def _value(config: object, key: str) -> Any:
    """A config key's value (a parsed config.json value or a config object's attribute: untyped)."""
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def config_draft_layers(config: object) -> DraftLayers:
    """The keys of `config` (a transformers config object or a parsed config.json) that decide its attention."""
    types = _value(config, "layer_types")
    window = _value(config, "sliding_window")
    explicit = _value(config, "is_causal")
    return DraftLayers(num_layers=int(_value(config, "num_hidden_layers")),
                       layer_types=list(types) if types else None,
                       sliding_window=int(window) if window else None,
                       is_causal=None if explicit is None else bool(explicit))


def profile_draft_layers(drafter: DrafterSection) -> DraftLayers:
    """The attention keys a profile's drafter is trained with (its config.json writes the same)."""
    return DraftLayers(num_layers=drafter.num_layers, layer_types=list(drafter.layer_types) or None,
                       sliding_window=drafter.sliding_window or None)
