"""Per-layer attention of the drafter: `layer_types` (`full_attention`, `sliding_attention`),
`sliding_window`, `is_causal`, resolved as the reference (PyPI `dflash` 0.1.0,
`Qwen3DFlashAttention`) and vLLM 0.32 resolve them: a sliding layer has the window and is causal, a
full layer is bidirectional, unless `is_causal` says otherwise. Every SGLang from 0.5.14 agrees, so
our drafters leave `is_causal` out; `sglang_serving_problems` names the layers an older release
would run otherwise (envcheck/engines.py). A query at position p sees a key at j when `p - j < w`
in a window (also `j - p < w` when not causal) and `j <= p` when causal. transformers keeps
`sliding_window` only with `use_sliding_window: true`, so a config with sliding layers carries both.
No torch here: the launcher validates profiles with it. Rules: docs/drafter.md "Drafter layers".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, TypedDict

from envcheck.engines import SGLANG_DFLASH2, DraftLayers, reference_rules, sglang_problems

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from launcher_core.schema import DrafterSection

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True)
class LayerAttention:
    """One draft layer's visibility rule beyond the block layout: a window (None: unbounded), causal."""

    window: Optional[int] = None
    causal: bool = False

    @property
    def restricts(self) -> bool:
        """False for plain full, bidirectional attention (no extra mask needed)."""
        return self.window is not None or self.causal


def _value(config: PretrainedConfig | Mapping[str, object], key: str) -> Any:
    """A config key's value (a parsed config.json value or a config attribute: untyped)."""
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def layer_attention(config: PretrainedConfig | Mapping[str, object]) -> list[LayerAttention]:
    """The rule of each of the config's `num_hidden_layers` layers (a config object or a mapping)."""
    return [LayerAttention(window=rule.window, causal=rule.causal) for rule in reference_rules(draft_layers(config))]


def layer_type_problems(layer_types: Sequence[str], num_layers: int, sliding_window: int) -> list[str]:
    """What is wrong with a `layer_types` / `sliding_window` pair for `num_layers` layers ([] if fine)."""
    problems = []
    if layer_types and len(layer_types) != num_layers:
        problems.append(f"layer_types has {len(layer_types)} entries for {num_layers} layers (one per layer)")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types {unknown} unknown; valid: {', '.join(LAYER_TYPES)}")
    if SLIDING in layer_types and sliding_window < 1:
        problems.append(f"sliding_attention layers need sliding_window >= 1, got {sliding_window}")
    if sliding_window and SLIDING not in layer_types:
        problems.append(f"sliding_window {sliding_window} is set but no layer is sliding_attention")
    return problems


def config_layer_keys(layer_types: Sequence[str], num_layers: int, sliding_window: int,
                      is_causal: Optional[bool] = None) -> dict[str, Any]:
    """The config.json keys for the layers: `layer_types` always (vLLM and SGLang want the list),
    `sliding_window` + `use_sliding_window` when a layer slides, and `is_causal` only when given
    (None, our drafters: left out, the convention of the module doc)."""
    types = list(layer_types) or [FULL] * num_layers
    sliding = SLIDING in types
    keys: dict[str, Any] = {"layer_types": types, "use_sliding_window": sliding,
                            "sliding_window": int(sliding_window) if sliding else None}
    if is_causal is not None:
        keys["is_causal"] = bool(is_causal)
    return keys


def profile_rope_scaling(drafter_section: DrafterSection) -> Optional[dict[str, object]]:
    """`[drafter]` rope_scaling keys -> transformers' rope_parameters entries (None: plain RoPE)."""
    kind = drafter_section.rope_scaling
    if kind == "none":
        return None
    scaling: dict[str, object] = {"rope_type": kind, "factor": float(drafter_section.rope_scaling_factor)}
    if kind == "yarn" and drafter_section.rope_original_max_position_embeddings:
        scaling["original_max_position_embeddings"] = int(drafter_section.rope_original_max_position_embeddings)
    return scaling


class LayerOptions(TypedDict):
    """The `drafter_config` keywords of the layer and RoPE-scaling keys."""

    layer_types: tuple[str, ...]
    sliding_window: int
    rope_scaling: Optional[dict[str, object]]


def profile_layer_options(drafter_section: DrafterSection) -> LayerOptions:
    """The `drafter_config` keywords of the profile's `[drafter]` layer and RoPE-scaling keys."""
    return {"layer_types": tuple(drafter_section.layer_types), "sliding_window": int(drafter_section.sliding_window),
            "rope_scaling": profile_rope_scaling(drafter_section)}


def profile_layer_problems(drafter_section: DrafterSection) -> list[tuple[str, str]]:
    """(key, problem) for the `[drafter]` layer and RoPE-scaling keys; [] when they are usable
    (the schema's own rules, such as sliding_window >= 0, are checked when the profile loads)."""
    problems = [("drafter.layer_types", problem) for problem in layer_type_problems(
        list(drafter_section.layer_types), drafter_section.num_layers, drafter_section.sliding_window)]
    if drafter_section.rope_scaling != "none" and drafter_section.rope_scaling_factor <= 1.0:
        problems.append(("drafter.rope_scaling_factor", f"{drafter_section.rope_scaling_factor} with rope_scaling "
                         f"{drafter_section.rope_scaling!r}; a scaling factor must be > 1"))
    if drafter_section.rope_scaling == "none" and drafter_section.rope_original_max_position_embeddings:
        problems.append(("drafter.rope_original_max_position_embeddings", "set without rope_scaling = \"yarn\""))
    return problems


def mixes_sliding_and_full(layer_types: Sequence[str]) -> bool:
    """Some layers slide and some do not (vLLM serves that only with its V2 model runner)."""
    return SLIDING in layer_types and any(kind != SLIDING for kind in layer_types)



def draft_layers(config: PretrainedConfig | Mapping[str, object]) -> DraftLayers:
    """The keys of `config` (a config object or a parsed config.json) that decide its attention."""
    types = _value(config, "layer_types")
    window = _value(config, "sliding_window")
    explicit = _value(config, "is_causal")
    return DraftLayers(num_layers=int(_value(config, "num_hidden_layers")),
                       layer_types=list(types) if types else None,
                       sliding_window=int(window) if window else None,
                       is_causal=None if explicit is None else bool(explicit))


def sglang_serving_problems(version: tuple[int, ...], config: PretrainedConfig | Mapping[str, object]) -> list[str]:
    """The layers SGLang `version` would run with other attention than the drafter was trained with
    ([]: every layer as trained), and a DFlash 2 drafter before the release that knows it;
    envcheck.engines holds each release's rule."""
    problems = sglang_problems(version, draft_layers(config))
    if "DFlash2DraftModel" in (_value(config, "architectures") or []) and version < SGLANG_DFLASH2:
        problems.append(f"a DFlash 2 drafter (DFlash2DraftModel), which SGLang serves from "
                        f"{'.'.join(map(str, SGLANG_DFLASH2))} on")
    return problems
