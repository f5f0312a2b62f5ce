"""Negative controls of the parity gate: a drafter export changed one way, to be served in place of the
trained one. The gate's benchmark (benchmarks/bench_parity_gate.py) measures how often each is caught and
the engine tests (tests/eval/test_engine_vllm*.py) serve them; nothing in `eval` uses them.

* `random-weights`: every matrix re-drawn at its own scale (norms kept);
* `taps-shifted`: the target layers the drafter reads, each moved one layer deeper;
* `sliding-rule-flipped`: sliding-window layers served bidirectional without a window (as SGLang
  0.5.11-0.5.13 ran every DFlash layer);
* `dead`: a vLLM export whose draft vocabulary maps every row to one token (`token`, default the mask
  token): the drafter proposes only that token, which the target never emits, so nothing is accepted.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

CHANGES = ("", "random-weights", "taps-shifted", "sliding-rule-flipped", "dead")
WEIGHTS = "model.safetensors"


def changed_export(exported: Path, change: str, out: Path, token: Optional[int] = None) -> Path:
    """A copy of the export `exported` at `out` with `change` made ('' = unchanged)."""
    if change not in CHANGES:
        raise ValueError(f"change {change!r}: one of {', '.join(repr(c) for c in CHANGES)}")
    shutil.copytree(exported, out)
    config: dict[str, Any] = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if change == "random-weights":
        _redraw_weights(out / WEIGHTS)
    elif change == "taps-shifted":
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    elif change == "sliding-rule-flipped":
        if set(config.get("layer_types") or []) != {"sliding_attention"} or "is_causal" in config:
            raise ValueError(f"{exported}: sliding-rule-flipped needs a drafter whose layers all slide")
        config.update(layer_types=["full_attention"] * len(config["layer_types"]), sliding_window=None,
                      use_sliding_window=False)
    elif change == "dead":
        _map_every_draft_row(out / WEIGHTS, config["dflash_config"]["mask_token_id"] if token is None else token)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


def _redraw_weights(path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(w.shape, generator=generator) * w.float().std() if w.ndim >= 2 else w
               for name, w in load_file(str(path)).items()}
    save_file({name: w.contiguous() for name, w in weights.items()}, str(path), metadata={"format": "pt"})


def _map_every_draft_row(path: Path, token: int) -> None:
    """vLLM's `d2t` (target id = draft index + d2t) rewritten so every draft index means `token`."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    if "d2t" not in weights:
        raise ValueError(f"{path}: 'dead' needs a vLLM export with a draft vocabulary (d2t)")
    rows = weights["d2t"].numel()
    weights["d2t"] = (token - torch.arange(rows)).to(weights["d2t"].dtype)
    save_file({name: w.contiguous() for name, w in weights.items()}, str(path), metadata={"format": "pt"})
