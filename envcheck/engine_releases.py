"""What a serving engine release does with a DFlash drafter's layers, read from each release's code:
which SGLang has DFLASH at all, and the attention (window, causal) it gives each draft layer of a
config. The audit (check engine.sglang), `export --for sglang` and `eval --engine sglang` ask it.

A drafter is trained with the reference's rule (launcher_core.layer_attention). SGLang's
(`python/sglang/srt/models/dflash.py` of each wheel) changed across releases, one constant below
per change: 0.5.11-0.5.13 run every layer ENCODER_ONLY (bidirectional) without a window and read no
layer key; from 0.5.14 a sliding layer is DECODER (causal) with window_left = sliding_window - 1;
0.5.17 honours `is_causal` for full layers, 0.5.18 for both kinds. Every release runs a config
without `layer_types` all ENCODER_ONLY without a window. Summary: docs/drafter.md "Drafter layers".
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from launcher_core.layer_attention import SLIDING, DraftLayers, LayerAttention, config_draft_layers, profile_draft_layers, reference_rules
from launcher_core.schema import DrafterSection

SGLANG_FIRST_DFLASH = (0, 5, 11)        # the DFLASH speculative algorithm
SGLANG_SLIDING = (0, 5, 14)             # sliding layers causal with their window (before: all bidirectional)
SGLANG_FULL_IS_CAUSAL = (0, 5, 17)      # a full layer honours is_causal = true
SGLANG_IS_CAUSAL = (0, 5, 18)           # is_causal honoured for both kinds
SGLANG_DFLASH2 = (0, 5, 19)             # DFlash2DraftModel (the candidate selector)


def sglang_rules(version: tuple[int, ...], layers: DraftLayers) -> Optional[list[LayerAttention]]:
    """The attention SGLang `version` gives each layer (None: that release has no DFLASH)."""
    if version < SGLANG_FIRST_DFLASH:
        return None
    if version < SGLANG_SLIDING or layers.layer_types is None:
        return [LayerAttention(window=None, causal=False)] * layers.num_layers
    explicit = layers.is_causal
    rules = []
    for kind in layers.layer_types:
        if kind == SLIDING:
            causal = True if version < SGLANG_IS_CAUSAL or explicit is None else bool(explicit)
            window = int(layers.sliding_window) if layers.sliding_window else None
            rules.append(LayerAttention(window=window, causal=causal))
        else:
            rules.append(LayerAttention(window=None, causal=bool(explicit) if version >= SGLANG_FULL_IS_CAUSAL else False))
    return rules


def sglang_problems(version: tuple[int, ...], layers: DraftLayers) -> list[str]:
    """The layers SGLang `version` would run with other attention than trained ([]: all as trained)."""
    served = sglang_rules(version, layers)
    if served is None:
        return [f"SGLang {'.'.join(map(str, version))} has no DFLASH speculative algorithm (from "
                f"{'.'.join(map(str, SGLANG_FIRST_DFLASH))} on)"]
    return [f"layer {index} ({kind}): trained {trained.describe()}, served {rule.describe()}"
            for index, (kind, trained, rule) in enumerate(zip(layers.kinds(), reference_rules(layers), served))
            if trained != rule]


def release(version: str) -> tuple[int, ...]:
    """`0.5.13.post1` -> (0, 5, 13): the release a version belongs to (a local label is ignored)."""
    numbers = [int(part) for part in re.findall(r"\d+", version.split("+", 1)[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def sglang_drafter_problems(version: str, drafter: DrafterSection) -> list[str]:
    """What SGLang `version` would serve otherwise than a profile's drafter is trained ([]: nothing)."""
    return _serving_problems(release(version), profile_draft_layers(drafter), drafter.kind == "dflash2")


def sglang_config_problems(version: str, config: Mapping[str, Any]) -> list[str]:
    """What SGLang `version` would serve otherwise than the drafter of `config` (its parsed config.json) is
    trained ([]: nothing)."""
    dflash2 = "DFlash2DraftModel" in (config.get("architectures") or [])
    return _serving_problems(release(version), config_draft_layers(config), dflash2)


def _serving_problems(version: tuple[int, ...], layers: DraftLayers, dflash2: bool) -> list[str]:
    """The layers' attention, and a DFlash 2 drafter before the release that knows DFlash2DraftModel."""
    problems = sglang_problems(version, layers)
    if dflash2 and version < SGLANG_DFLASH2:
        problems.append(f"a DFlash 2 drafter (DFlash2DraftModel), which SGLang serves from "
                        f"{'.'.join(map(str, SGLANG_DFLASH2))} on")
    return problems
