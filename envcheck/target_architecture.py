"""The profile's target as the audit sees it: its config.json's layer kinds, read without loading
anything (no transformers, no weights). A builtin target (`builtin:...`) is the workload's business
(`dflash.target_model`); the audit does not build it and says so."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launcher_core.schema import Profile


@dataclass(frozen=True)
class TargetArchitecture:
    """`path`'s config.json: how many decoder layers, which of them are linear attention."""

    path: str
    model_type: str = ""
    num_layers: int = 0
    linear_attention_layers: list[int] = field(default_factory=list)
    error: str = ""              # why the facts are missing (no such directory, unreadable config)


def read_target_architecture(profile: Profile) -> Optional[TargetArchitecture]:
    """None for a builtin target; facts (or the reason there are none) for a directory."""
    spec = profile.model.target
    if spec.startswith("builtin:"):
        return None
    path = Path(spec).expanduser()
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return TargetArchitecture(path=str(path), error=f"cannot read {config_path}: {error}")
    text = config.get("text_config") or config
    kinds = text.get("layer_types") or []
    return TargetArchitecture(path=str(path), model_type=str(text.get("model_type") or config.get("model_type") or ""),
                              num_layers=int(text.get("num_hidden_layers") or len(kinds)),
                              linear_attention_layers=[i for i, kind in enumerate(kinds) if kind == "linear_attention"])
