"""Sliding-window draft layers in the memory model: the extra BlockMask of a second layer rule,
sized from flex_attention's own BlockMask, and no activation saving in a training step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.memory.attention_masks import block_mask_bytes, extra_block_mask_mib
from dflash.memory.model import estimate, workload_from_profile
from launcher_core.profile import load_profile


def test_block_mask_bytes_are_what_flex_attention_allocates():
    from torch.nn.attention.flex_attention import create_block_mask

    queries, keys = 4 * 128, 7 * 128
    mask = create_block_mask(lambda b, h, q, k: q >= k - 300, 1, None, queries, keys, device="cpu")
    tensors = [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
               mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices]
    allocated = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    assert block_mask_bytes(queries, keys) == allocated


def test_the_flagships_sliding_layers_add_one_mask_per_sequence_and_no_activations():
    profile = load_profile("rtx6000-x8")
    workload = workload_from_profile(profile)
    assert (workload.sliding_layers, workload.sliding_window) == (4, 2048)
    full = dataclasses.replace(workload, sliding_layers=0, sliding_window=0)
    extra = extra_block_mask_mib(workload)
    assert extra == pytest.approx(block_mask_bytes(workload.block_tokens, workload.max_length + workload.block_tokens)
                                  / 2**20)
    assert 0 < extra < 1 and extra_block_mask_mib(full) == 0
    assert estimate(workload).drafter_activations == pytest.approx(estimate(full).drafter_activations + extra)
    all_sliding = dataclasses.replace(workload, sliding_layers=workload.drafter_layers)
    assert extra_block_mask_mib(all_sliding) == 0          # one rule, one mask, as an all-full drafter
    assert full.key() != workload.key()
