"""The traced step (dflash.memory.trace): exact byte counts, the shortened target forward, and the
analytic model held to the trace on a small Qwen3.5-shaped workload."""
from __future__ import annotations

import dataclasses

import pytest

from dflash.memory import model as memory
from dflash.memory import trace
from launcher_core.profile import load_profile

# Qwen3.6-27B's proportions at 1/32 of its width: q 1.2 x hidden, MLP 3.4 x, GQA 6:1, 12 layers.
SMALL = dict(hidden_size=160, intermediate_size=544, num_hidden_layers=12, num_attention_heads=6,
             num_key_value_heads=1, head_dim=32, vocab_size=4096, linear_num_key_heads=4,
             linear_num_value_heads=12, linear_key_head_dim=16, linear_value_head_dim=16)
# The drafter's own attention, as rtx6000-x8's 32 x 128 / 8 KV is its own beside the target's 24 x 256 / 4:
# query width, KV width, head dim and query groups all differ from the small target's (192, 32, 32, 6).
SMALL_DRAFTER = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16)


def small_profile(max_length: int = 512, anchors: int = 32):
    """rtx6000-x8 (zero1 over 8 ranks, bf16 autocast) at a CPU-sized sequence, its drafter's own
    attention shape scaled down with the target (SMALL_DRAFTER)."""
    profile = load_profile("rtx6000-x8")
    return dataclasses.replace(profile, data=dataclasses.replace(profile.data, max_length=max_length),
                               train=dataclasses.replace(profile.train, num_anchors=anchors),
                               drafter=dataclasses.replace(profile.drafter, **SMALL_DRAFTER))


def assert_drafter_has_its_own_shape(workload: memory.Workload) -> None:
    """The check below would pass with a target-shaped drafter on both sides: make sure it is not one."""
    own, target = workload.drafter_shape, workload.target
    assert (own.q_dim, own.kv_dim, own.head_dim) == (128, 64, 16)
    assert (own.q_dim, own.kv_dim, own.head_dim) != (target.q_dim, target.kv_dim, target.head_dim)


def small_workload(profile, config) -> memory.Workload:
    """The model's workload with the small target's exact parameter count (hybrid layers)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = memory.shape_from_config(config.to_dict(), "small Qwen3.5", param_count=count)
    return memory.workload_from_profile(profile, shape)


def test_peak_deciding_layers_keep_taps_and_the_last_layer_of_each_type_with_its_input():
    types = trace.hybrid_layer_types(64, 4)
    assert types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    layers = trace.peak_deciding_layers(types, [1, 16, 31, 46, 61])
    assert layers == [1, 16, 31, 46, 58, 59, 60, 61]      # full: 59 (input 58); linear: 61 (input 60)


def test_fullest_zero1_shard_is_the_fullest_rank_of_the_greedy_partition():
    import torch

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 7, 5, 4, 1)]
    shard = memory.fullest_zero1_shard(params, 2)
    assert sorted(p.numel() for p in shard) == [4, 10]       # 10 | 7 -> 5 on rank 1 (12), 4 on rank 0 (14), 1 on rank 1
    assert sum(p.numel() for p in shard) == max(memory.zero_shard_sizes([10, 7, 5, 4, 1], 2))


def test_trace_counts_the_exact_bytes_of_weights_gradients_and_optimizer_shard():
    config = trace.qwen36_27b_config(**SMALL)
    profile = small_profile(max_length=128, anchors=8)
    workload = trace.workload_for_config(profile, config)
    assert_drafter_has_its_own_shape(workload)
    traced = trace.trace_step(profile, 1, config=config)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        truncated = AutoModelForCausalLM.from_config(trace.truncated_config(config, workload.loaded_target_layers))
    target_bytes = 2 * sum(p.numel() for p in truncated.parameters())               # bf16
    assert traced.target_weights * memory.MIB == target_bytes
    assert traced.drafter_weights * memory.MIB == 4 * memory.drafter_params(workload)
    assert traced.drafter_grads == traced.drafter_weights
    states = 2 * 4 * memory.largest_shard_params(workload) / memory.MIB               # exp_avg, exp_avg_sq
    assert states <= traced.optimizer_states <= states + 4 * 64 / memory.MIB            # + a float32 step per tensor
    assert traced.tap_features * memory.MIB == 2 * 128 * len(workload.tap_layers) * SMALL["hidden_size"]
    assert traced.peak >= traced.step_peak > traced.target_weights + traced.drafter_weights


@pytest.mark.slow
def test_shortened_target_forward_has_the_full_forwards_peak():
    config = trace.qwen36_27b_config(**SMALL)
    profile = small_profile(max_length=128, anchors=8)
    short, full = (trace.trace_step(profile, 2, config=config, full_target=f) for f in (False, True))
    assert short.target_layers_run < full.target_layers_run == 10
    assert (short.target_forward, short.step_peak, short.peak) == (full.target_forward, full.step_peak, full.peak)


@pytest.mark.slow
def test_analytic_model_is_within_ten_percent_of_the_trace_on_a_small_qwen35_workload():
    config = trace.qwen36_27b_config(**SMALL)
    profile = small_profile()
    workload = small_workload(profile, config)
    assert_drafter_has_its_own_shape(workload)
    for micro_batch in (1, 2):
        figures = {f.name: f for f in trace.compare(trace.trace_step(profile, micro_batch, config=config), workload)}
        assert abs(figures["peak"].error) < 0.10, figures["peak"]
        assert figures["drafter weights (fp32)"].error == 0.0, figures["drafter weights (fp32)"]
        assert abs(figures["AdamW states (this rank)"].error) < 0.01, figures["AdamW states (this rank)"]
        assert abs(figures["drafter forward (+ autocast copies)"].error) < 0.10, figures["drafter forward (+ autocast copies)"]
        assert abs(figures["step peak (forward/backward)"].error) < 0.10, figures["step peak (forward/backward)"]
