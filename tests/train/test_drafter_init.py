"""`drafter.init = "drafter"`: training starts from a DFlash drafter directory (one of our
checkpoints here; published z-lab directories load through the same reader), on SmolLM2-135M:
the profile's drafter then holds the checkpoint's weights exactly, so it has the checkpoint's
loss on the same batch at step 0, and training goes on from there."""
from __future__ import annotations

import json

import pytest
import torch

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile

pytestmark = pytest.mark.slow
DRAFTER = {"num_layers": 2, "target_layer_ids": [1, 20], "mask_token_id": 16,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}


def profile_for(root, name, target, dataset, **drafter):
    path = write_profile(root / f"{name}.toml", target, dataset, root / name, machine={"nproc_per_node": 1},
                         max_steps=2, save_every_steps=2, drafter={**DRAFTER, **drafter})
    return load_profile(str(path))


def batch_loss(drafter, target, input_ids: torch.Tensor) -> float:
    from dflash.drafter.loss import block_loss, block_targets, decay_weights
    from dflash.drafter.network import forward_blocks
    from dflash.drafter.taps import extract_taps

    features = extract_taps(target, input_ids, drafter.target_layer_ids)
    anchors = torch.tensor([[3, 20, 37]])
    with torch.no_grad():
        hidden = forward_blocks(drafter, input_ids, anchors, features, "sdpa")
        targets = block_targets(input_ids, torch.ones_like(input_ids), anchors, torch.ones_like(anchors, dtype=torch.bool),
                                drafter.block_size)
        parts = block_loss(hidden, drafter.logits, targets, decay_weights(drafter.block_size, 3.0), chunk_rows=64)
    return float(parts.weighted_ce / parts.weight_sum)


def moved_off_its_init(drafter):
    """The drafter with every weight moved a little, as a few training steps would (the trainer's own
    checkpoint writer saves it; a second training run here would only cost a minute)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.01)
    return drafter


def test_training_continues_from_our_checkpoint_with_its_loss(tmp_path, smollm2_dir, tiny_dataset):
    from dflash.drafter.checkpoint_files import latest_checkpoint, load_drafter, read_weights, save_checkpoint
    from dflash.target_model import load_target
    from dflash.train.rank.setup import build_drafter
    from dflash.train.supervisor.launch import run_training

    first = profile_for(tmp_path, "first", smollm2_dir, tiny_dataset)
    target = load_target(smollm2_dir)
    source = save_checkpoint(tmp_path / "first", moved_off_its_init(build_drafter(first, target, [1, 20],
                                                                                   target.config.num_hidden_layers)), 2, {})
    then = profile_for(tmp_path, "then", smollm2_dir, tiny_dataset, init="drafter", init_from=str(source))
    started = build_drafter(then, target, [1, 20], target.config.num_hidden_layers)
    saved = load_drafter(source, target)
    input_ids = torch.tensor([[1000 + i % 50 for i in range(56)]])
    assert batch_loss(started, target, input_ids) == batch_loss(saved, target, input_ids)
    fresh = build_drafter(first, target, [1, 20], target.config.num_hidden_layers)
    assert batch_loss(fresh, target, input_ids) != batch_loss(saved, target, input_ids)

    assert run_training(then, run_dir=tmp_path / "then") == 0
    metrics = [json.loads(line) for line in (tmp_path / "then" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    moved = read_weights(latest_checkpoint(tmp_path / "then"))
    assert any(not torch.equal(value, moved[name]) for name, value in read_weights(source).items())


def test_a_checkpoint_of_another_shape_is_refused_with_every_difference(tmp_path, smollm2_dir, tiny_dataset):
    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.drafter.network import DFlashDrafter
    from dflash.target_model import load_target
    from dflash.train.rank.setup import build_drafter
    from launcher_core.errors import InputError

    target = load_target(smollm2_dir)
    other = profile_for(tmp_path, "other", smollm2_dir, tiny_dataset, num_layers=1, layer_types=["full_attention"],
                        sliding_window=0, target_layer_ids=[1])
    built = build_drafter(other, target, [1], target.config.num_hidden_layers)
    source = save_checkpoint(tmp_path / "src", built, 1, {})
    then = profile_for(tmp_path, "then", smollm2_dir, tiny_dataset, init="drafter", init_from=str(source))
    with pytest.raises(InputError) as raised:
        build_drafter(then, target, [1, 20], target.config.num_hidden_layers)
    message = str(raised.value)
    assert "fc.weight: (576, 576) there, (576, 1152) in the profile's drafter" in message
    assert "layers.1.mlp.down_proj.weight: missing" in message and "target_layer_ids: [1] there, [1, 20]" in message
    assert isinstance(built, DFlashDrafter)
