"""Per-layer attention of the drafter: `layer_types` (`full_attention`, `sliding_attention`),
`sliding_window`, `is_causal`. The rule each layer is trained with is launcher_core.layer_attention's (the
reference's, which vLLM 0.32 and every SGLang from 0.5.14 share, so our drafters leave `is_causal` out);
what each engine release runs instead is envcheck.engine_releases'. A query at position p sees a key at j when
`p - j < w` in a window (also `j - p < w` when not causal) and `j <= p` when causal. transformers keeps
`sliding_window` only with `use_sliding_window: true`, so a config with sliding layers carries both.
No torch here: the launcher validates profiles with it. Rules: docs/drafter.md "Drafter layers".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, TypedDict

from launcher_core.layer_attention import FULL, LAYER_TYPES, SLIDING, LayerAttention, config_draft_layers, reference_rules

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from launcher_core.schema import DrafterSection


def layer_attention(config: PretrainedConfig | Mapping[str, object]) -> list[LayerAttention]:
    """The rule of each of the config's `num_hidden_layers` layers (a config object or a mapping)."""
    return reference_rules(config_draft_layers(config))


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
