"""Drafter checkpoints: `{run_dir}/train/checkpoints/step-N/` and the `latest` pointer.

Each checkpoint directory holds `model.safetensors` (the trainable drafter weights, reference
names), `config.json` (reference drafter format: `architectures: ["DFlashDraftModel"]`,
`block_size`, `dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers`, Qwen3
shape keys) and `training_state.pt` (optimizer, scheduler, step, agreed micro-batch). It is
written into a temporary sibling directory and renamed into place; `latest` (a text file naming
the directory) is replaced atomically after it, so a crash leaves the previous checkpoint usable.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import InputError
from core.fileio import atomic_directory, write_text_atomic

if TYPE_CHECKING:
    from dflash.drafter.model import DFlashDrafter

LATEST = "latest"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
STATE = "training_state.pt"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / "checkpoints"


def save_checkpoint(run_dir: str | Path, drafter: "DFlashDrafter", step: int, state: dict[str, Any]) -> Path:
    """Write step-N atomically, then point `latest` at it. Returns the checkpoint directory."""
    import torch
    from safetensors.torch import save_file

    root = checkpoints_dir(run_dir)
    target = root / f"step-{step}"
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    with atomic_directory(target) as staging:
        save_file(weights, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(drafter.config.to_json_string(use_diff=False), encoding="utf-8")
        torch.save({"step": step, **state}, staging / STATE)
    write_text_atomic(root / LATEST, f"step-{step}\n")
    return target


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The directory `latest` names, or None when there is no checkpoint yet."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.exists():
        return None
    target = pointer.parent / pointer.read_text(encoding="utf-8").strip()
    if not (target / WEIGHTS).exists():
        raise InputError(f"{pointer} names {target.name}, which has no {WEIGHTS}; remove the pointer or fix it")
    return target


def read_drafter_config(checkpoint_dir: str | Path) -> Any:
    from transformers import Qwen3Config

    path = Path(checkpoint_dir) / CONFIG
    if not path.exists():
        raise InputError(f"{path}: no drafter config here; expected a checkpoint directory step-N/")
    document = json.loads(path.read_text(encoding="utf-8"))
    if "DFlashDraftModel" not in document.get("architectures", []) or "dflash_config" not in document:
        raise InputError(f"{path}: not a DFlash drafter config (needs architectures DFlashDraftModel and dflash_config)")
    return Qwen3Config.from_dict(document)


def load_drafter(checkpoint_dir: str | Path, target_model: Any) -> "DFlashDrafter":
    """A drafter from `step-N/` (or a run's `checkpoints/` dir: its latest), attached to the target."""
    from safetensors.torch import load_file

    from dflash.drafter.model import DFlashDrafter

    checkpoint_dir = _resolve_checkpoint_dir(Path(checkpoint_dir))
    drafter = DFlashDrafter(read_drafter_config(checkpoint_dir))
    drafter.load_state_dict(load_file(str(checkpoint_dir / WEIGHTS)), strict=True)
    device = target_model.get_input_embeddings().weight.device
    return drafter.to(device).attach_target(target_model).eval()


def _resolve_checkpoint_dir(path: Path) -> Path:
    if (path / LATEST).exists():
        pointed = path / (path / LATEST).read_text(encoding="utf-8").strip()
        return pointed
    return path


def load_training_state(checkpoint_dir: Path) -> dict[str, Any]:
    import torch

    return torch.load(checkpoint_dir / STATE, map_location="cpu", weights_only=False)
