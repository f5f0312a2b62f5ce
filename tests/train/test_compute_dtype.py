"""train.compute_dtype = "bfloat16": the drafter on bf16 copies of its float32 parameters
(dflash.drafter.model.ComputeIn) computes in bf16, close to float32, and its float32 parameters
get float32 gradients close to float32 compute's."""
from __future__ import annotations

import torch

from dflash.drafter.loss import block_loss, block_targets, decay_weights
from dflash.drafter.model import ComputeIn, DFlashDrafter, drafter_config, forward_blocks
from dflash.drafter.taps import extract_taps

BLOCK, LAYERS, MASK_ID = 4, [1, 2], 151669


def loss_and_grads(drafter: DFlashDrafter, model: torch.nn.Module, target) -> tuple[float, dict[str, torch.Tensor], torch.dtype]:
    torch.manual_seed(1)
    input_ids = torch.randint(100, 5000, (2, 24))
    anchors, valid = torch.tensor([[2, 9, 15], [4, 11, 18]]), torch.ones(2, 3, dtype=torch.bool)
    features = extract_taps(target, input_ids, LAYERS)
    drafter.zero_grad(set_to_none=True)
    hidden = forward_blocks(model, input_ids, anchors, features, "sdpa")
    targets = block_targets(input_ids, torch.ones_like(input_ids), anchors, valid, BLOCK)
    parts = block_loss(hidden, drafter.logits, targets, decay_weights(BLOCK, 3.0), chunk_rows=8)
    (parts.weighted_ce / parts.weight_sum).backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    return float(parts.weighted_ce / parts.weight_sum), grads, hidden.dtype


def test_bf16_compute_is_bf16_inside_and_gives_float32_gradients_close_to_float32(tiny_target_model):
    torch.manual_seed(0)
    config = drafter_config(tiny_target_model.config, num_layers=1, block_size=BLOCK, target_layer_ids=LAYERS,
                            mask_token_id=MASK_ID)
    drafter = DFlashDrafter(config).attach_target(tiny_target_model)
    loss32, grads32, dtype32 = loss_and_grads(drafter, drafter, tiny_target_model)
    loss16, grads16, dtype16 = loss_and_grads(drafter, ComputeIn(drafter, torch.bfloat16), tiny_target_model)
    assert (dtype32, dtype16) == (torch.float32, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    assert all(g.dtype == torch.float32 for g in grads16.values()) and grads16.keys() == grads32.keys()
    assert abs(loss16 - loss32) < 0.02 * abs(loss32)
    for name, grad in grads32.items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), grads16[name].flatten(), dim=0)
        assert cosine > 0.98 or grad.norm() < 1e-6, (name, float(cosine))
