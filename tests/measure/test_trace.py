"""The traced step (dflash.measure.trace): the trainer's own state and step on fake tensors under the
fake process group, its exact byte counts, a buffer added to the trainer's step showing in it, the
shortened target forward, and the analytic model held to the trace on small Qwen3.5-shaped workloads.

The target forward's part of a trace is traced once per shape in this module (`target_forward_traced_once`)."""
from __future__ import annotations

import dataclasses

import pytest

from dflash.measure import fake, trace
from dflash.memory import peak_estimate as memory
from dflash.memory.target_shape import shape_from_config
from dflash.target_model import hybrid_layer_types
from launcher_core.profile import load_profile

# Qwen3.6-27B's proportions at 1/32 of its width: q 1.2 x hidden, MLP 3.4 x, GQA 6:1, 12 layers.
SMALL = dict(hidden_size=160, intermediate_size=544, num_hidden_layers=12, num_attention_heads=6,
             num_key_value_heads=1, head_dim=32, vocab_size=4096, linear_num_key_heads=4,
             linear_num_value_heads=12, linear_key_head_dim=16, linear_value_head_dim=16)
# The drafter's own attention, as rtx6000-x8's 32 x 128 / 8 KV is its own beside the target's 24 x 256 / 4:
# query width, KV width, head dim and query groups all differ from the small target's (192, 32, 32, 6).
SMALL_DRAFTER = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, mask_token_id=4000)
# Smaller still, for the tests that only need a real step to run: 8 target layers, 2 draft layers.
TINY = {**SMALL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8}
FP32 = {"compute_dtype": "float32", "activation_checkpointing": "none"}      # the step before the flagship's settings
TARGET_RISES: dict[tuple, tuple[int, int, int]] = {}


@pytest.fixture(autouse=True)
def target_forward_traced_once(monkeypatch):
    """The trace's target forward (`trace._target_forward_rise`, run after the step: its rise above what
    the step left alive, the taps' bytes, the layers run) depends on the target alone: its config and
    dtype, the batch's shape, the taps, the autocast rule and whether every layer runs; not on the
    drafter, its sharding or the step's settings. The parametrized tests below share two (micro-batch 1
    and 2 of the small target), so the real function runs once per such key in this module and its
    result is reused (about half of each trace's time is the target's Gated DeltaNet on fake tensors)."""
    real = trace._target_forward_rise

    def once(state, batch, full_target):
        key = (state.target.config.to_json_string(), next(state.target.parameters()).dtype,
               tuple(batch.input_ids.shape), tuple(state.layer_ids), state.autocast, full_target, state.loss.needs_teacher)
        if key not in TARGET_RISES:
            TARGET_RISES[key] = real(state, batch, full_target)
        return TARGET_RISES[key]

    monkeypatch.setattr(trace, "_target_forward_rise", once)


def small_profile(max_length: int = 512, anchors: int = 32, name: str = "rtx6000-x8", **drafter):
    """A GPU profile (rtx6000-x8: zero1 over 8 ranks, bf16 autocast) at a CPU-sized sequence, its
    drafter's own attention shape scaled down with the target (SMALL_DRAFTER)."""
    profile = load_profile(name)
    return dataclasses.replace(profile, data=dataclasses.replace(profile.data, max_length=max_length),
                               train=dataclasses.replace(profile.train, num_anchors=anchors),
                               drafter=dataclasses.replace(profile.drafter, **{**SMALL_DRAFTER, **drafter}))


def tiny_profile():
    """Two draft layers as the profile's shape: a sliding one (window shorter than the context) and a full one."""
    return small_profile(max_length=64, anchors=4, num_layers=2, target_layer_ids=(1, 5),
                         layer_types=("sliding_attention", "full_attention"), sliding_window=16)


def assert_drafter_has_its_own_shape(workload: memory.Workload) -> None:
    """The check below would pass with a target-shaped drafter on both sides: make sure it is not one."""
    own, target = workload.drafter_shape, workload.target
    assert (own.q_dim, own.kv_dim, own.head_dim) == (128, 64, 16)
    assert (own.q_dim, own.kv_dim, own.head_dim) != (target.q_dim, target.kv_dim, target.head_dim)


def exact_workload(profile, config, world_size: int) -> memory.Workload:
    """The model's workload with the small target's exact parameter count (hybrid layers)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = shape_from_config(config.to_dict(), "small Qwen3.5", param_count=count)
    return memory.workload_from_profile(profile, shape, world_size)


def test_a_hybrid_targets_linear_attention_mask_is_none_without_a_mask_read_from_no_tensor():
    """transformers 5.3's Qwen3.5 (the cu128 pin) reads `cache_position[0]` before the mask: a fake tensor has no value."""
    from torch import nn

    class Hybrid(nn.Module):
        def _update_linear_attn_mask(self, attention_mask, cache_position):
            if cache_position[0] > 0:           # what a fake tensor cannot answer
                raise AssertionError("read a tensor's value")
            return attention_mask

    model = nn.Sequential(Hybrid())
    fake.unmasked_linear_attention(model)
    assert model[0]._update_linear_attn_mask(None, object()) is None
    assert model[0]._update_linear_attn_mask("mask", [0]) == "mask"


def test_peak_deciding_layers_keep_taps_and_the_last_layer_of_each_type_with_its_input():
    types = hybrid_layer_types(64, 4)
    assert types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    layers = fake.peak_deciding_layers(types, [1, 16, 31, 46, 61])
    assert layers == [1, 16, 31, 46, 58, 59, 60, 61]      # full: 59 (input 58); linear: 61 (input 60)


def test_the_traced_state_is_the_trainers_sharded_by_fsdp2_at_the_profiles_world_size():
    """state_from_target under the fake process group: the drafter sharded by FSDP2 over 8 ranks,
    one unit per draft layer and the root, rank 0 holding ceil(dim 0 / 8) rows of every tensor (what
    the memory model counts), AdamW over those shards; the trainer's tap layers, truncated target
    and autocast rule."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflash.train.rank.parallel import fsdp_units, local_tensor

    config, profile = fake.qwen36_27b_config(**TINY), tiny_profile()
    workload = fake.workload_for_config(profile, config, 8)
    data = trace.WorstCaseData(profile, config.vocab_size)
    with trace.fake_process_group(8) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        state = trace.traced_state(profile, config, data, 8, mesh)
        assert len(list(fsdp_units(state.drafter))) == profile.drafter.num_layers + 1
        shards = [local_tensor(p) for p in state.drafter.parameters()]
        assert sum(t.numel() for t in shards) == memory.shard_numel(memory.drafter_tensors(workload), 8)
        assert sorted(t.shape[0] for t in shards) == sorted(-(-rows // 8) for rows, _ in memory.drafter_tensors(workload))
        owned = state.optimizer.param_groups[0]["params"]
        assert sum(local_tensor(p).numel() for p in owned) == sum(t.numel() for t in shards)
        assert state.layer_ids == [1, 5] and len(state.target.model.layers) == 6
        assert state.autocast == "bfloat16"                 # a CUDA profile: the trainer's bf16 autocast rule


def test_trace_counts_the_exact_bytes_of_weights_gradients_and_optimizer_shards():
    config, profile = fake.qwen36_27b_config(**TINY), tiny_profile()
    workload = exact_workload(profile, config, 8)
    traced = trace.trace_step(profile, 1, config=config)
    assert traced.world_size == 8
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        truncated = AutoModelForCausalLM.from_config(fake.truncated_config(config, workload.loaded_target_layers))
    assert traced.target_weights * memory.MIB == 2 * sum(p.numel() for p in truncated.parameters())   # bf16
    shards = memory.shard_numel(memory.drafter_tensors(workload), 8)
    assert traced.drafter_weights * memory.MIB == 4 * shards
    assert traced.drafter_grads == traced.drafter_weights
    states = 2 * 4 * shards / memory.MIB                                                # exp_avg, exp_avg_sq
    assert states <= traced.optimizer_states <= states + 4 * 64 / memory.MIB            # + a float32 step per tensor
    assert traced.tap_features * memory.MIB == 2 * 64 * len(workload.tap_layers) * TINY["hidden_size"]
    assert traced.peak_categories["Sharded Grad"] == traced.drafter_grads    # the second micro-batch: gradients alive
    unit = max(memory.gathered_numel(memory.layer_tensors(workload), 8), memory.gathered_numel(memory.root_tensors(workload), 8))
    assert traced.reduction_buffers * memory.MIB == 4 * unit <= memory.estimate(workload).reduction_buffers * memory.MIB
    assert traced.gathered_weights == pytest.approx(memory.estimate(workload).gathered_most, rel=0.01)


def test_a_buffer_added_to_the_trainers_step_appears_in_the_trace(monkeypatch):
    """The trace runs the trainer's functions, not a copy: a buffer held inside the real
    `accumulate_micro_batches` raises the micro-batches' peak, one inside `update` the update's."""
    import torch

    from dflash.train.rank import step

    config, profile = fake.qwen36_27b_config(**TINY), tiny_profile()
    before = trace.trace_step(profile, 1, config=config)
    forward_extra, update_extra = 3 * memory.MIB, 5 * memory.MIB
    real_accumulate, real_update = step.accumulate_micro_batches, step.update

    def accumulate_holding(*args, **kwargs):
        held = torch.empty(forward_extra, dtype=torch.uint8)
        result = real_accumulate(*args, **kwargs)
        del held
        return result

    def update_holding(state):
        held = torch.empty(update_extra, dtype=torch.uint8)
        real_update(state)
        del held

    monkeypatch.setattr(step, "accumulate_micro_batches", accumulate_holding)
    monkeypatch.setattr(step, "update", update_holding)
    after = trace.trace_step(profile, 1, config=config)
    assert after.step_peak - before.step_peak == pytest.approx(forward_extra / memory.MIB, abs=1e-6)
    assert after.update_peak - before.update_peak == pytest.approx(update_extra / memory.MIB, abs=1e-6)


@pytest.mark.slow
def test_shortened_target_forward_has_the_full_forwards_peak():
    config, profile = fake.qwen36_27b_config(**SMALL), small_profile(max_length=128, anchors=8)
    short, full = (trace.trace_step(profile, 2, config=config, full_target=f) for f in (False, True))
    assert short.target_layers_run < full.target_layers_run == 10
    assert (short.target_forward, short.target_peak, short.peak) == (full.target_forward, full.target_peak, full.peak)


@pytest.mark.slow
@pytest.mark.parametrize("name, world, train", [
    ("rtx6000-x8", 8, FP32), ("h200-x1", 1, FP32), ("rtx6000-x8", 8, {}), ("h200-x1", 1, {}),
    ("rtx6000-x8", 8, {**FP32, "gradient_sync": "last_micro_batch"}), ("rtx6000-x8", 8, {**FP32, "reshard_after_forward": False})])
def test_analytic_model_is_within_three_percent_of_the_trace_on_a_small_qwen35_workload(name, world, train):
    """Every component within 5 % (those of at least 1 MiB) and the peak within 3 %, at micro-batch 1
    and 2: the drafter sharded by FSDP2 over 8 fake ranks and over one, in float32 compute and with
    the profile's own settings (bf16 compute, each draft layer recomputed); gradients held unsharded
    until the last micro-batch; layers kept gathered from forward to backward. Loss chunks of 128
    rows, so one sequence fills a chunk, as at the flagship's size. (Float32 compute under autocast
    with recomputed layers, a setting no profile uses, is over-estimated by 5-6 % at this shape:
    docs/memory-trace.md.)"""
    config = fake.qwen36_27b_config(**SMALL)
    profile = small_profile(name=name)
    profile = dataclasses.replace(profile, train=dataclasses.replace(profile.train, loss_chunk_rows=128, **train))
    workload = exact_workload(profile, config, world)
    assert_drafter_has_its_own_shape(workload)
    assert_model_holds_to_the_trace(profile, config, workload, world)


def assert_model_holds_to_the_trace(profile, config, workload: memory.Workload, world: int) -> list[fake.ComparedFigure]:
    """The test above's tolerances at micro-batch 1 and 2; returns the micro-batches' peaks compared."""
    peaks = []
    for micro_batch in (1, 2):
        traced = trace.trace_step(profile, micro_batch, config=config)
        assert traced.world_size == world
        figures = fake.compare(traced, workload)
        peak = next(f for f in figures if f.name == "micro-batches' peak (forward/backward)")
        assert abs(peak.error) < 0.03, peak
        peaks.append(peak)
        # Every component but one: the target forward's working set cannot be held to 5 % at this shape. At 1/32 of
        # the flagship's width, transformers' PyTorch Gated DeltaNet keeps per-chunk [value heads, 64, 64] float32
        # matrices that do not scale with the value width the model counts (LINEAR_ATTENTION_FP32_COPIES, fitted at
        # the flagship, where they are under 1 % of it): the model is ~45 % under here. It is held at the flagship's
        # shape instead (benchmarks/bench_memory_trace.py: -0.5 %); for the same reason the overall peak is held
        # where the drafter's step decides it (the micro-batches' peak above).
        # The reduction's own buffers: the model counts the reduce-scatter's input and output with the unit's
        # gradients still held, as 2 real gloo ranks measure it (tests/measure/test_measured_memory.py, exact
        # there); under the fake process group FSDP2 has freed the gradients before the output, so the trace
        # shows the input alone: the model may be above it by the output's share, 1 / world size.
        reduction = next(f for f in figures if f.name == "a gradient reduction's own buffers")
        assert -0.05 < reduction.error <= 0.05 + 1 / world, reduction
        # On one rank the layer's backward is over-counted by about the retained reduction input's size at micro-batch
        # 1 (+6 % of the activations here, +1.3 % of the peak at h200-x1's own shape:
        # benchmarks/results/fsdp2-drafter_cpu-2core_2026-12-02.md), never under.
        working = next(f for f in figures if f.name == "at the step's peak: activations + loss")
        assert -0.05 < working.error < (0.08 if world == 1 else 0.05), working
        off = [f for f in figures if f.traced >= 1 and abs(f.error) >= 0.05
               and f.name not in ("target forward working set", "peak", reduction.name, working.name)]
        assert off == [], off
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("name, world, train", [("rtx6000-x8", 8, {}), ("h200-x1", 1, FP32)])
def test_the_model_counts_dflash2s_convolutions_and_selector_as_the_trace_does(name, world, train):
    """drafter.kind = "dflash2" at the same small shape and tolerances (the selector's rank-256 codebooks over
    the 4,096-token vocabulary are most of the drafter here): the convolutions in every draft layer, the
    selector as its own FSDP2 unit (its shards, gradients, AdamW states, its gathering and its gradient
    reduction), its saved tensors per sequence. Negative control: the same workload without DFlash 2's terms
    (the DFlash model) misses the traced peak by far more than the tolerance, under. Two of the four
    settings of the test above: the flagship's own (8 ranks, bf16 compute, each draft layer recomputed) and
    their opposite (one rank, float32, nothing recomputed): DFlash 2's own terms depend on the precision
    (the convolutions' saved inputs) and on the world size (the selector's shards), each on its own, and
    both change between the two; the DFlash terms of all four pairs are held by the test above."""
    config = fake.qwen36_27b_config(**SMALL)
    profile = small_profile(name=name, kind="dflash2")
    profile = dataclasses.replace(profile, train=dataclasses.replace(profile.train, loss_chunk_rows=128, **train))
    workload = exact_workload(profile, config, world)
    assert workload.dflash2 is not None and memory.dflash2_parameter_counts(workload)["codebooks"] == 2 * 4096 * 256
    peaks = assert_model_holds_to_the_trace(profile, config, workload, world)
    without = memory.estimated_peak_model(dataclasses.replace(workload, dflash2=None))
    for micro_batch, peak in zip((1, 2), peaks):
        dflash_step = max(line.at(micro_batch) for line in without.lines if line.moment != "the target's forward")
        dflash_step += without.accumulation_mib if micro_batch < without.rank_share else 0.0
        assert (dflash_step - peak.traced) / peak.traced < -0.2, (micro_batch, dflash_step, peak)


@pytest.mark.slow
def test_the_model_counts_distillations_target_logits_as_the_trace_does():
    """train.loss = "distill" at the same small shape and tolerances, the flagship's settings (8 ranks, bf16
    compute, each draft layer recomputed): the whole target loaded, its last layer's output kept beside the
    taps, its logits of a chunk beside the drafter's in the loss (dflash.drafter.loss._chunk_kl). Negative
    control: the same workload counted as train.loss = "ce" misses the traced peak by more than the
    tolerance, under."""
    config = fake.qwen36_27b_config(**SMALL)
    profile = small_profile()
    profile = dataclasses.replace(profile, train=dataclasses.replace(profile.train, loss_chunk_rows=128, loss="distill"))
    workload = exact_workload(profile, config, 8)
    assert workload.distill and workload.loaded_target_layers == config.num_hidden_layers
    peaks = assert_model_holds_to_the_trace(profile, config, workload, 8)
    without = memory.estimated_peak_model(dataclasses.replace(workload, distill=False))
    for micro_batch, peak in zip((1, 2), peaks):
        ce_step = max(line.at(micro_batch) for line in without.lines if line.moment != "the target's forward")
        ce_step += without.accumulation_mib if micro_batch < without.rank_share else 0.0
        assert (ce_step - peak.traced) / peak.traced < -0.04, (micro_batch, ce_step, peak)
