"""Drafter layers per `layer_types`: sliding-window layers (causal, as the published drafters and
every loader run them), RoPE scaling, their checkpoint keys, and starting from a drafter's weights.

The per-block reference here spells the sliding rule out by hand: slot k of a block anchored at a
sees context position j only when a + k - j < window, and slots 0..k of its own block.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.loss import block_loss, block_targets, decay_weights
from dflash.drafter.network import DFlashDrafter, drafter_config, forward_blocks
from dflash.drafter.taps import extract_taps
from launcher_core.errors import InputError

BLOCK, GAMMA, LAYERS, WINDOW = 4, 3.0, [1, 2], 5
MASK_ID = 151669
TYPES = ("sliding_attention", "full_attention")


def build(target, *, layer_types=TYPES, window=WINDOW, rope_scaling=None, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = drafter_config(target.config, num_layers=len(layer_types), block_size=BLOCK, target_layer_ids=LAYERS,
                            mask_token_id=MASK_ID, layer_types=layer_types, sliding_window=window,
                            rope_scaling=rope_scaling)
    model = DFlashDrafter(config).attach_target(target)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def sliding(tiny_target_model) -> DFlashDrafter:
    return build(tiny_target_model)


@pytest.fixture(scope="module")
def batch(tiny_target_model):
    torch.manual_seed(1)
    input_ids = torch.randint(100, 5000, (2, 20))
    loss_mask = torch.ones(2, 20, dtype=torch.long)
    loss_mask[1, 14:] = 0
    anchors = torch.tensor([[3, 9, 15], [2, 11, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    return input_ids, loss_mask, anchors, valid, extract_taps(tiny_target_model, input_ids, LAYERS)


def hand_mask(anchor: int, window, causal: bool) -> torch.Tensor:
    """[B, anchor + B] visibility of one block: context 0..anchor-1, then the block."""
    mask = torch.ones(BLOCK, anchor + BLOCK, dtype=torch.bool)
    for k in range(BLOCK):
        for j in range(anchor):
            if window is not None and anchor + k - j >= window:
                mask[k, j] = False
        for k2 in range(BLOCK):
            if causal and k2 > k:
                mask[k, anchor + k2] = False
    return mask


def hand_block_logits(drafter, features, anchor_id: int, anchor: int, window_matters: bool = True) -> torch.Tensor:
    rules = [(WINDOW if kind == "sliding_attention" and window_matters else None, kind == "sliding_attention")
             for kind in drafter.config.layer_types]
    attends = []
    for window, causal in rules:
        mask = hand_mask(anchor, window, causal)
        attends.append(lambda q, k, v, mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    block = drafter.block_input_ids(torch.tensor([[anchor_id]]))[0]
    positions = torch.cat([torch.arange(anchor), anchor + torch.arange(BLOCK)])[None]
    return drafter.logits(drafter(block, features[:, :anchor], positions, attends))[0]


@torch.no_grad()
def hand_loss(drafter, batch, window_matters=True):
    input_ids, loss_mask, anchors, valid, features = batch
    total, weights = torch.zeros(()), 0.0
    for row in range(2):
        for anchor, ok in zip(anchors[row].tolist(), valid[row].tolist()):
            if not ok:
                continue
            logits = hand_block_logits(drafter, features[row:row + 1], int(input_ids[row, anchor]), anchor, window_matters)
            for k in range(1, BLOCK):
                if anchor + k < 20 and loss_mask[row, anchor + k]:
                    weight = math.exp(-(k - 1) / GAMMA)
                    total, weights = total + weight * F.cross_entropy(logits[k], input_ids[row, anchor + k]), weights + weight
    return float(total / weights)


def batched(drafter, batch, backend="sdpa"):
    input_ids, loss_mask, anchors, valid, features = batch
    with torch.no_grad():
        hidden = forward_blocks(drafter, input_ids, anchors, features, backend)
        targets = block_targets(input_ids, loss_mask, anchors, valid, BLOCK)
        parts = block_loss(hidden, drafter.logits, targets, decay_weights(BLOCK, GAMMA), chunk_rows=5)
    return float(parts.weighted_ce / parts.weight_sum)


def test_sliding_layers_train_with_the_window_and_causal_block(sliding, batch):
    assert [(r.window, r.causal) for r in sliding.layer_rules] == [(WINDOW, True), (None, False)]
    ours = batched(sliding, batch)
    assert math.isclose(ours, hand_loss(sliding, batch), rel_tol=1e-5)
    assert not math.isclose(ours, hand_loss(sliding, batch, window_matters=False), rel_tol=1e-4)


def test_flex_and_sdpa_agree_on_sliding_layers(sliding, batch):
    assert math.isclose(batched(sliding, batch, "flex"), batched(sliding, batch, "sdpa"), rel_tol=1e-5)


def test_inference_drafts_what_training_saw(sliding, batch):
    """draft_logits (the in-process decoder's path) applies the same per-layer rule."""
    input_ids, _, _, _, features = batch
    anchor = 13
    ours = sliding.draft_logits(features[:1, :anchor], int(input_ids[0, anchor]), anchor)
    torch.testing.assert_close(ours, hand_block_logits(sliding, features[:1], int(input_ids[0, anchor]), anchor))


def test_checkpoint_carries_the_layer_keys_and_yarn_and_reloads(tiny_target_model, batch, tmp_path):
    from dflash.drafter.checkpoint_files import load_drafter, save_checkpoint

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    drafter = build(tiny_target_model, rope_scaling=yarn)
    saved = save_checkpoint(tmp_path, drafter, 1, {})
    config = json.loads((saved / "config.json").read_text())
    assert config["layer_types"] == list(TYPES) and config["sliding_window"] == WINDOW
    assert config["use_sliding_window"] is True and "is_causal" not in config
    assert config["rope_scaling"]["type"] == config["rope_scaling"]["rope_type"] == "yarn"
    assert config["rope_scaling"]["factor"] == 4.0 and config["rope_parameters"]["rope_type"] == "yarn"
    reloaded = load_drafter(saved, tiny_target_model)
    assert reloaded.layer_rules == drafter.layer_rules
    torch.testing.assert_close(reloaded.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq)
    assert reloaded.rotary_emb.attention_scaling == drafter.rotary_emb.attention_scaling != 1.0
    features = batch[4][:1, :12]
    torch.testing.assert_close(reloaded.draft_logits(features, 777, 12), drafter.draft_logits(features, 777, 12))


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ({"layer_types": ["sliding_attention"]}, "1 entries for 2 layers"),
    ({"sliding_window": None}, "sliding_window >= 1"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_parameters": None}, "'dynamic'"),
])
def test_unsupported_layer_or_rope_configs_are_refused_by_name(tiny_target_model, tmp_path, change, message):
    from dflash.drafter.checkpoint_files import load_drafter, save_checkpoint

    saved = save_checkpoint(tmp_path, build(tiny_target_model), 1, {})
    config = json.loads((saved / "config.json").read_text())
    config.update(change)
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=message) as raised:
        load_drafter(saved, tiny_target_model)
    assert "config.json" in str(raised.value)


def test_published_config_without_is_causal_runs_sliding_layers_causally(tiny_target_model, tmp_path):
    """A published z-lab-format config (auto_map, top-level rope_theta, no rope_parameters) with
    sliding layers loads for eval with the reference's rule for them."""
    from dflash.drafter.checkpoint_files import load_drafter, save_checkpoint

    drafter = build(tiny_target_model)
    saved = save_checkpoint(tmp_path, drafter, 1, {})
    config = json.loads((saved / "config.json").read_text())
    for key in ("rope_parameters", "use_sliding_window", "dtype"):
        config.pop(key, None)
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (saved / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(saved, tiny_target_model)
    assert [(r.window, r.causal) for r in loaded.layer_rules] == [(WINDOW, True), (None, False)]
    features = torch.randn(1, 11, len(LAYERS) * 64)
    torch.testing.assert_close(loaded.draft_logits(features, 5, 11), drafter.draft_logits(features, 5, 11))


def test_init_from_drafter_copies_the_weights_or_lists_every_difference(tiny_target_model, tmp_path):
    from dflash.drafter.checkpoint_files import init_from_drafter, save_checkpoint

    source = build(tiny_target_model, seed=1)
    saved = save_checkpoint(tmp_path, source, 3, {})
    fresh = build(tiny_target_model, seed=2)
    init_from_drafter(fresh, tmp_path / "train" / "checkpoints")     # the run's latest
    for name, value in source.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    torch.manual_seed(0)
    wider = DFlashDrafter(drafter_config(tiny_target_model.config, num_layers=3, block_size=BLOCK, target_layer_ids=[0, 2],
                                         mask_token_id=MASK_ID, layer_types=(*TYPES, "full_attention"),
                                         sliding_window=WINDOW))
    with pytest.raises(InputError) as raised:
        init_from_drafter(wider, saved)
    text = str(raised.value)
    assert "layers.2.self_attn.q_proj.weight: missing" in text and "target_layer_ids: [1, 2] there, [0, 2]" in text
    assert text.count("missing") == len([n for n in wider.state_dict() if n.startswith("layers.2.")])
