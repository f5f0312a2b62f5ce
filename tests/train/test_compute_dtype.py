"""train.compute_dtype = "bfloat16": FSDP2 gathers the drafter's float32 parameter shards as bf16
(MixedPrecisionPolicy.param_dtype), the forward runs in bf16, and the float32 shards get float32
gradients (reduce_dtype) close to float32 compute's."""
from __future__ import annotations

import copy

import torch

from dflash.drafter.loss import block_loss, block_targets, decay_weights
from dflash.drafter.network import DFlashDrafter, drafter_config, forward_blocks
from dflash.drafter.taps import extract_taps
from dflash.train.rank.parallel import drafter_mesh, shard_drafter

BLOCK, LAYERS, MASK_ID = 4, [1, 2], 151669


def loss_and_grads(drafter: DFlashDrafter, target) -> tuple[float, dict[str, torch.Tensor], torch.dtype]:
    torch.manual_seed(1)
    input_ids = torch.randint(100, 5000, (2, 24))
    anchors, valid = torch.tensor([[2, 9, 15], [4, 11, 18]]), torch.ones(2, 3, dtype=torch.bool)
    features = extract_taps(target, input_ids, LAYERS)
    drafter.zero_grad(set_to_none=True)
    hidden = forward_blocks(drafter, input_ids, anchors, features, "sdpa")
    targets = block_targets(input_ids, torch.ones_like(input_ids), anchors, valid, BLOCK)
    parts = block_loss(hidden, drafter.logits, targets, decay_weights(BLOCK, 3.0), chunk_rows=8)
    (parts.weighted_ce / parts.weight_sum).backward()
    grads = {name: p.grad.full_tensor() for name, p in drafter.named_parameters()}
    return float(parts.weighted_ce / parts.weight_sum), grads, hidden.dtype


def test_bf16_compute_is_bf16_inside_and_gives_float32_gradients_close_to_float32(tiny_target_model):
    torch.manual_seed(0)
    config = drafter_config(tiny_target_model.config, num_layers=1, block_size=BLOCK, target_layer_ids=LAYERS,
                            mask_token_id=MASK_ID)
    base = DFlashDrafter(config).attach_target(tiny_target_model)
    mesh = drafter_mesh(torch.device("cpu"), "gloo")
    fp32 = shard_drafter(copy.deepcopy(base).attach_target(tiny_target_model), mesh, compute_dtype="float32")
    bf16 = shard_drafter(copy.deepcopy(base).attach_target(tiny_target_model), mesh, compute_dtype="bfloat16")
    loss32, grads32, dtype32 = loss_and_grads(fp32, tiny_target_model)
    loss16, grads16, dtype16 = loss_and_grads(bf16, tiny_target_model)
    assert (dtype32, dtype16) == (torch.float32, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())           # the shards stay float32
    assert all(g.dtype == torch.float32 for g in grads16.values()) and grads16.keys() == grads32.keys()
    assert abs(loss16 - loss32) < 0.02 * abs(loss32) and loss16 != loss32
    for name, grad in grads32.items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), grads16[name].flatten(), dim=0)
        assert cosine > 0.98 or grad.norm() < 1e-6, (name, float(cosine))
