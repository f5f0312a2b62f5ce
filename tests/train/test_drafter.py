"""The drafter, its block attention and loss, checked against a per-block reference computation.

The reference drafts each block on its own, the way inference does (`draft_logits` path: the
context rows it may see, the block, no mask). Its toggles produce the four known wrong variants
(labels shifted by one, `<=` context visibility, exp(-k/gamma) decay, causal attention inside
the block); each test shows the batched training computation matches the right reference and
differs from the wrong one.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter.attention import BlockLayout, make_attend
from dflash.drafter.loss import block_loss, block_targets, decay_weights
from dflash.drafter.network import DFlashDrafter, drafter_config, forward_blocks
from dflash.drafter.taps import default_target_layer_ids, extract_taps

BLOCK, GAMMA, LAYERS = 4, 3.0, [1, 2]
MASK_ID = 151669


@pytest.fixture(scope="module")
def drafter(tiny_target_model) -> DFlashDrafter:
    torch.manual_seed(0)
    config = drafter_config(tiny_target_model.config, num_layers=1, block_size=BLOCK,
                            target_layer_ids=LAYERS, mask_token_id=MASK_ID)
    model = DFlashDrafter(config).attach_target(tiny_target_model)
    with torch.no_grad():   # a less uniform start than the default init, so variants differ clearly
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def batch(tiny_target_model):
    """Two right-padded sequences (lengths 20 and 14) with anchors, one padded anchor slot."""
    torch.manual_seed(1)
    input_ids = torch.randint(100, 5000, (2, 20))
    loss_mask = torch.ones(2, 20, dtype=torch.long)
    loss_mask[0, :3] = 0
    loss_mask[0, 12] = 0
    loss_mask[1, 14:] = 0
    input_ids[1, 14:] = 0
    anchors = torch.tensor([[3, 7, 16], [0, 5, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    features = extract_taps(tiny_target_model, input_ids, LAYERS)
    return input_ids, loss_mask, anchors, valid, features


def batched_loss(drafter, batch, backend="sdpa"):
    input_ids, loss_mask, anchors, valid, features = batch
    hidden = forward_blocks(drafter, input_ids, anchors, features, backend)
    targets = block_targets(input_ids, loss_mask, anchors, valid, BLOCK)
    return block_loss(hidden, drafter.logits, targets, decay_weights(BLOCK, GAMMA), chunk_rows=5)


def reference_loss(drafter, batch, *, label_shift=0, context_inclusive=False, decay_from=1, causal=False):
    """Each block alone: weighted CE sum and weight sum, with toggles for the wrong variants."""
    input_ids, loss_mask, anchors, valid, features = batch
    total, weight_sum = torch.zeros(()), 0.0
    for row in range(input_ids.shape[0]):
        for anchor, ok in zip(anchors[row].tolist(), valid[row].tolist()):
            if ok:
                logits = _reference_block_logits(drafter, features[row:row + 1], int(input_ids[row, anchor]), anchor,
                                                 context_inclusive, causal)
                for k in range(1, BLOCK):
                    position = anchor + k + label_shift
                    if position >= input_ids.shape[1] or not loss_mask[row, anchor + k]:
                        continue
                    weight = math.exp(-(k - decay_from) / GAMMA)
                    total = total + weight * F.cross_entropy(logits[k], input_ids[row, position])
                    weight_sum += weight
    return total, weight_sum


def _reference_block_logits(drafter, features, anchor_id, anchor, context_inclusive, causal):
    visible = anchor + 1 if context_inclusive else anchor
    context = features[:, :visible]
    block = drafter.block_input_ids(torch.tensor([[anchor_id]]))[0]
    positions = torch.cat([torch.arange(visible), anchor + torch.arange(BLOCK)])[None]
    mask = torch.ones(BLOCK, visible + BLOCK, dtype=torch.bool)
    if causal:
        mask[:, visible:] = torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return drafter.logits(drafter(block, context, positions, attend))[0]


def close(a, b) -> bool:
    return math.isclose(float(torch.as_tensor(a).detach()), float(torch.as_tensor(b).detach()), rel_tol=1e-5, abs_tol=1e-6)


def test_batched_loss_matches_per_block_reference(drafter, batch):
    parts = batched_loss(drafter, batch)
    expected, expected_weight = reference_loss(drafter, batch)
    assert close(parts.weighted_ce, expected)
    assert close(parts.weight_sum, expected_weight)


def test_labels_are_the_tokens_at_anchor_plus_k_not_shifted(drafter, batch):
    parts = batched_loss(drafter, batch)
    shifted, _ = reference_loss(drafter, batch, label_shift=1)
    assert not close(parts.weighted_ce, shifted)
    input_ids, loss_mask, anchors, valid, _ = batch
    targets = block_targets(input_ids, loss_mask, anchors, valid, BLOCK)
    assert targets.labels[0, 0].tolist() == input_ids[0, 4:7].tolist()     # anchor 3: tokens 4, 5, 6


def test_context_is_strictly_before_the_anchor(drafter, batch):
    parts = batched_loss(drafter, batch)
    inclusive, _ = reference_loss(drafter, batch, context_inclusive=True)
    assert not close(parts.weighted_ce, inclusive)
    layout = BlockLayout(torch.tensor([[3, 7]]), 10, BLOCK)
    context_rows = layout.dense_mask()[0, 0, :, :10]
    assert context_rows[0].tolist() == [True] * 3 + [False] * 7            # anchor 3 sees 0..2 only
    assert context_rows[BLOCK].tolist() == [True] * 7 + [False] * 3        # anchor 7 sees 0..6


def test_decay_starts_at_one_for_slot_one(drafter, batch):
    weights = decay_weights(16, 7.0)
    assert weights[0].item() == 1.0 and math.isclose(weights[1].item(), math.exp(-1 / 7), rel_tol=1e-6)
    parts = batched_loss(drafter, batch)
    off_by_one, _ = reference_loss(drafter, batch, decay_from=0)            # exp(-k/gamma)
    assert not close(parts.weighted_ce, off_by_one)


def test_attention_inside_the_block_is_bidirectional(drafter, batch):
    parts = batched_loss(drafter, batch)
    causal, _ = reference_loss(drafter, batch, causal=True)
    assert not close(parts.weighted_ce, causal)
    own_block = BlockLayout(torch.tensor([[3, 7]]), 10, BLOCK).dense_mask()[0, 0, :, 10:]
    assert own_block[0, :BLOCK].all() and not own_block[0, BLOCK:].any()     # slot 0 sees slot 3, not block 2


def test_gradients_reach_only_trainable_parameters(drafter, batch, tiny_target_model):
    drafter.zero_grad(set_to_none=True)
    parts = batched_loss(drafter, batch)
    (parts.weighted_ce / parts.weight_sum).backward()
    names = {name for name, _ in drafter.named_parameters()}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert all(p.grad is None and not p.requires_grad for p in tiny_target_model.parameters())
    assert drafter.fc.weight.shape == (64, 64 * len(LAYERS))
    drafter.zero_grad(set_to_none=True)


def test_flex_and_sdpa_give_the_same_outputs(drafter, batch):
    with torch.no_grad():
        flex = batched_loss(drafter, batch, backend="flex")
        sdpa = batched_loss(drafter, batch, backend="sdpa")
    assert close(flex.weighted_ce, sdpa.weighted_ce)
    assert torch.equal(flex.correct, sdpa.correct)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention has no backward on CPU")
def test_flex_and_sdpa_give_the_same_gradients_on_gpu():
    torch.manual_seed(0)
    anchors = torch.tensor([[3, 9], [1, 4]], device="cuda")
    layout = BlockLayout(anchors, 16, BLOCK)
    q = torch.randn(2, 4, layout.num_queries, 16, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, 16 + layout.num_queries, 16, device="cuda", requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grads = []
    for backend in ("flex", "sdpa"):
        out = make_attend(layout, backend)(q, k, v)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for flex, sdpa in zip(*grads):
        torch.testing.assert_close(flex, sdpa, rtol=2e-3, atol=2e-3)


def test_truncated_extraction_equals_full_forward_hidden_states(tiny_target_model):
    input_ids = torch.randint(100, 5000, (2, 12))
    calls = {"layer3": 0, "lm_head": 0}
    hooks = [tiny_target_model.model.layers[3].register_forward_hook(lambda *_: calls.__setitem__("layer3", calls["layer3"] + 1)),
             tiny_target_model.lm_head.register_forward_hook(lambda *_: calls.__setitem__("lm_head", calls["lm_head"] + 1))]
    try:
        taps = extract_taps(tiny_target_model, input_ids, [0, 2])
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"layer3": 0, "lm_head": 0}
    with torch.no_grad():
        full = tiny_target_model(input_ids, output_hidden_states=True).hidden_states
    assert torch.equal(taps, torch.cat([full[1], full[3]], dim=-1))


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(8, 2) == [1, 5]


def test_checkpoint_reload_reproduces_logits(drafter, batch, tiny_target_model, tmp_path):
    from dflash.drafter.checkpoint_files import load_drafter, save_checkpoint

    saved = save_checkpoint(tmp_path, drafter, 7, {"note": "test"})
    assert (tmp_path / "train" / "checkpoints" / "latest").read_text().strip() == "step-7"
    config = __import__("json").loads((saved / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": LAYERS, "block_size": BLOCK}
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and config["rope_scaling"] is None
    assert config["num_target_layers"] == 4 and config["hidden_size"] == 64 and config["num_hidden_layers"] == 1
    reloaded = load_drafter(saved, tiny_target_model)
    features = batch[4][:1, :9]
    torch.testing.assert_close(reloaded.draft_logits(features, 1234, 9), drafter.draft_logits(features, 1234, 9),
                               rtol=0, atol=0)


def test_drafter_norm_init_sets_the_final_norm_only(tiny_target_model):
    import dataclasses

    from dflash.train.rank.setup import build_drafter
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, drafter=dataclasses.replace(
        profile.drafter, block_size=4, mask_token_id=MASK_ID, norm_init=0.25, init="random", draft_vocab_size=0))
    drafter = build_drafter(profile, tiny_target_model, [1], tiny_target_model.config.num_hidden_layers)
    assert torch.equal(drafter.norm.weight, torch.full_like(drafter.norm.weight, 0.25))
    assert torch.equal(drafter.hidden_norm.weight, torch.ones_like(drafter.hidden_norm.weight))
    assert drafter.norm.weight.requires_grad  # still trained


def test_profile_drafter_init_target_starts_from_the_layer_after_the_deepest_tap(tiny_target_model):
    import dataclasses

    from dflash.train.rank.setup import build_drafter
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, drafter=dataclasses.replace(
        profile.drafter, num_layers=1, block_size=4, mask_token_id=MASK_ID, init="target", norm_init=1.0,
        draft_vocab_size=40))
    with pytest.raises(ValueError, match="needs the draft vocabulary"):
        build_drafter(profile, tiny_target_model, [1], tiny_target_model.config.num_hidden_layers)
    vocab = list(range(1000, 1040))
    drafter = build_drafter(profile, tiny_target_model, [1], tiny_target_model.config.num_hidden_layers, vocab)
    assert drafter.draft_vocab.tolist() == vocab and drafter.config.dflash_config["draft_vocab_size"] == 40
    source = tiny_target_model.model.layers[2]
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, source.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.gate_proj.weight, source.mlp.gate_proj.weight)
    assert torch.equal(drafter.norm.weight, tiny_target_model.model.norm.weight)


@pytest.fixture()
def target_with_distinct_norms(tiny_target_model):
    """A copy of the tiny target whose RMSNorm weights are no longer all ones (so copying them shows)."""
    import copy

    model = copy.deepcopy(tiny_target_model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1.0 + 0.5 * torch.rand(parameter.shape, generator=generator))
    return model


def test_target_init_gives_the_context_the_keys_and_values_of_the_next_target_layer(target_with_distinct_norms):
    """drafter.init = "target": draft layer 0 starts as target layer (deepest tap + 1), so the keys
    and values it computes for the context are exactly what that target layer computes there."""
    from dflash.drafter.network import init_from_target

    target = target_with_distinct_norms
    config = drafter_config(target.config, num_layers=2, block_size=BLOCK, target_layer_ids=[1],
                            mask_token_id=MASK_ID)
    drafter = DFlashDrafter(config).attach_target(target)
    assert init_from_target(drafter, target, norm_scale=0.5) == [2, 3]
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tap = target(input_ids=ids, output_hidden_states=True).hidden_states[2]        # output of layer 1
        context = drafter.hidden_norm(drafter.fc(extract_taps(target, ids, [1])))
        source = target.model.layers[2]
        for proj in ("k_proj", "v_proj"):
            expected = getattr(source.self_attn, proj)(source.input_layernorm(tap))
            assert torch.allclose(getattr(drafter.layers[0].self_attn, proj)(context), expected, atol=1e-5), proj
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, target.model.layers[3].mlp.down_proj.weight)
    assert torch.equal(drafter.layers[1].self_attn.k_norm.weight, target.model.layers[3].self_attn.k_norm.weight)
    assert torch.allclose(drafter.norm.weight, 0.5 * target.model.norm.weight)
    drafter.layers[0].self_attn.q_proj.weight.data.add_(1.0)         # a copy: the target is untouched
    assert not torch.equal(drafter.layers[0].self_attn.q_proj.weight, source.self_attn.q_proj.weight)


def test_target_init_with_several_taps_starts_fc_as_their_mean(tiny_target_model):
    from dflash.drafter.network import init_from_target

    config = drafter_config(tiny_target_model.config, num_layers=1, block_size=BLOCK, target_layer_ids=[0, 3],
                            mask_token_id=MASK_ID)
    drafter = DFlashDrafter(config).attach_target(tiny_target_model)
    assert init_from_target(drafter, tiny_target_model) == [3]          # past the last layer: the last one
    first, second = torch.randn(3, 64), torch.randn(3, 64)
    assert torch.allclose(drafter.fc(torch.cat([first, second], dim=-1)), (first + second) / 2, atol=1e-6)


def test_target_init_refuses_a_truncated_target(tiny_target_model):
    import copy

    from dflash.drafter.network import init_from_target

    truncated = copy.deepcopy(tiny_target_model)
    truncated.model.layers = truncated.model.layers[:2]
    config = drafter_config(tiny_target_model.config, num_layers=1, block_size=BLOCK, target_layer_ids=[1],
                            mask_token_id=MASK_ID)
    drafter = DFlashDrafter(config).attach_target(truncated)
    with pytest.raises(ValueError, match="needs the target.s layers up to 2"):
        init_from_target(drafter, truncated)
