"""The memory model: target shapes from disk, the worst-case estimate, calibration, storage."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dflash.drafter.taps import default_target_layer_ids
from dflash.memory import peak_estimate as memory
from dflash.memory.calibration_record import fit_calibration, load_calibration, save_calibration
from dflash.memory.offline import offline_storage
from dflash.memory.target_shape import QWEN36_27B_LIKE, shape_from_config, shape_from_directory, target_shape
from launcher_core.errors import InputError
from launcher_core.profile import load_profile

QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
}


def rtx_workload(**changes) -> memory.Workload:
    return dataclasses.replace(memory.workload_from_profile(load_profile("rtx6000-x8")), **changes)


def test_tap_layers_follow_the_dflash_spacing():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_shape_is_read_from_config_json_with_nested_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "text_config": QWEN3_8B_CONFIG}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16_381_470_720}}))
    shape = shape_from_directory(tmp_path, dtype_bytes=2)
    assert (shape.hidden, shape.num_layers, shape.q_dim, shape.kv_dim) == (4096, 36, 4096, 1024)
    assert shape.total_params() == 8_190_735_360           # from the index, not the formula
    assert str(tmp_path) in shape.source


def test_config_without_required_key_names_the_file_and_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(InputError, match=r"config\.json.*num_attention_heads"):
        shape_from_directory(tmp_path, dtype_bytes=2)
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B_CONFIG, "num_hidden_layers": "36"}))
    with pytest.raises(InputError, match=r"config\.json: key 'num_hidden_layers' must be an integer, got '36'"):
        shape_from_directory(tmp_path, dtype_bytes=2)


def test_parameter_formula_matches_a_real_qwen3_model(tiny_qwen3_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True)
    shape = shape_from_directory(tiny_qwen3_target, dtype_bytes=4)
    assert shape.param_count == 0                           # single file: computed from the dimensions
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    assert shape.layer_params() == sum(p.numel() for p in model.model.layers[0].parameters())


def test_profile_without_local_target_uses_the_27b_like_shape_marked_assumed():
    shape = target_shape(load_profile("rtx6000-x8"))
    assert dataclasses.replace(shape, source=QWEN36_27B_LIKE.source) == QWEN36_27B_LIKE
    assert shape.hidden == 5120 and shape.num_layers == 64 and shape.assumed
    assert shape.source == ("assumed dimensions: model.target '/models/Qwen3.6-27B' is not on this machine, so "
                            "Qwen3.6-27B's published text config stands in for it")


def test_plan_says_its_dimensions_are_assumed_for_a_target_not_here_and_refuses_one_that_is_no_model(cli, tmp_path):
    """`plan` with a model.target this machine does not have: the plan is for Qwen3.6-27B's dimensions, and
    its text and JSON say so plainly (before: a confident plan, the stand-in named nowhere but the JSON's
    workload). A model.target that is here but is not a model directory is exit 2 naming it."""
    def profile_for(target: str) -> Path:
        path = tmp_path / "p.toml"
        path.write_text(f'extends = "cpu-demo"\n[model]\ntarget = "{target}"\n', encoding="utf-8")
        return path

    missing = tmp_path / "no-such-model"
    result = cli("plan", "--profile", profile_for(str(missing)))
    assert result.code == 0, result.err
    line = next(line for line in result.out.splitlines() if line.startswith("target: "))
    assert line.startswith(f"target: ASSUMED DIMENSIONS: model.target '{missing}' is not on this machine, so "
                           "Qwen3.6-27B's published text config stands in for it (hidden 5120, 64 layers, 24 x 256 "
                           "attention, vocabulary 248,320, 27 B parameters); the plan holds only for a target of this "
                           "shape"), line
    document = json.loads(cli("plan", "--profile", profile_for(str(missing)), "--json").out)["plan"]["target"]
    assert document["assumed"] is True and document["model_target"] == str(missing)
    assert document["source"].startswith("assumed dimensions: ") and document["line"] == line

    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    for target, what in ((tmp_path / "empty", "a directory without config.json"), (tmp_path / "weights.bin",
                                                                                  "not a directory")):
        refused = cli("plan", "--profile", profile_for(str(target)))
        assert refused.code == 2 and "Traceback" not in refused.err
        assert refused.err.startswith(f"error: model.target '{target}': {target} is {what}; set model.target to a "
                                      "model directory"), refused.err

    control = json.loads(cli("plan", "--profile", "cpu-demo", "--json").out)["plan"]["target"]
    assert control["assumed"] is False and "ASSUMED" not in control["line"]


def test_the_flagship_shape_is_its_published_config_and_the_trace_builds_the_same():
    """One definition (dflash.target_model.QWEN36_27B_TEXT): the model's shape, the trace's transformers config
    and the twin's architecture ratios all come from it."""
    from dflash.measure import fake
    from dflash.target_model import FLAGSHIP_TEXT, QWEN36_27B_TEXT

    s = QWEN36_27B_LIKE
    assert (s.hidden, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate, s.vocab) == \
        (5120, 64, 24, 4, 256, 17408, 248320)
    assert s.linear_value_dim == 48 * 128 and s.rope_theta == 1e7 and not s.tie_embeddings
    assert shape_from_config(fake.qwen36_27b_config().to_dict(), "trace") == \
        dataclasses.replace(s, param_count=0, source="trace")
    flagship, twin = QWEN36_27B_TEXT, FLAGSHIP_TEXT                  # the twin keeps what is architecture
    ratio = lambda text, a, b: text[a] / text[b]  # noqa: E731
    for a, b in (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads")):
        assert ratio(twin, a, b) == ratio(flagship, a, b)
    for key in ("vocab_size", "full_attention_interval", "linear_conv_kernel_dim", "attn_output_gate"):
        assert twin[key] == flagship[key]
    for key in ("rope_theta", "partial_rotary_factor", "mrope_interleaved"):
        assert twin["rope_parameters"][key] == flagship["rope_parameters"][key]


def test_builtin_targets_resolve_through_one_directory_function(tmp_path, monkeypatch, tiny_qwen3_target):
    """The memory model (and its trace) look for a builtin target where the loader converts it
    (dflash.target_model.local_model_dir): the SmolLM2 conversion's config.json, once there, gives the shape."""
    import shutil

    from dflash.measure import fake
    from dflash.target_model import SMOLLM2, local_model_dir

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    profile = load_profile("cpu-demo")
    assert profile.model.target == SMOLLM2
    assert target_shape(profile).source == "SmolLM2-135M defaults"       # nothing converted yet
    shutil.copytree(tiny_qwen3_target, local_model_dir(SMOLLM2))
    shape = target_shape(profile)
    assert shape.source == str(local_model_dir(SMOLLM2) / "config.json") and shape.hidden == 64
    assert fake.target_config(profile).hidden_size == 64


def test_the_drafter_has_the_profiles_own_attention_shape_not_the_targets():
    """rtx6000-x8: 32 x 128 query heads, 8 KV heads on a 24 x 256 / 4 KV target; 0 derives head dim 128
    with the target's query and KV widths. Parameters and saved activations follow the drafter's shape."""
    from dflash.drafter.shape import DrafterShape

    own = rtx_workload()
    assert own.drafter_shape == DrafterShape(32, 8, 128, 10_000_000.0)
    q_proj, k_proj, v_proj, o_proj = memory.layer_tensors(own)[:4]
    assert (q_proj, k_proj, v_proj, o_proj) == ((4096, 5120), (1024, 5120), (1024, 5120), (5120, 4096))
    derived = rtx_workload(drafter_shape=DrafterShape(48, 8, 128, 10_000_000.0))
    assert memory.workload_from_profile(dataclasses.replace(
        load_profile("rtx6000-x8"), drafter=dataclasses.replace(load_profile("rtx6000-x8").drafter,
                                                                num_attention_heads=0, num_key_value_heads=0,
                                                                head_dim=0))).drafter_shape == derived.drafter_shape
    width_difference = 5 * 2 * 5120 * (6144 - 4096) + 5 * 2 * (128 - 128)     # q_proj and o_proj, five layers
    assert memory.drafter_params(derived) - memory.drafter_params(own) == width_difference
    assert memory.estimate(derived).drafter_activations > memory.estimate(own).drafter_activations
    assert own.key() != derived.key()


def test_a_drafter_shape_that_cannot_group_its_heads_is_a_profile_error():
    from launcher_core.errors import ConfigError

    profile = load_profile("rtx6000-x8")
    bad = dataclasses.replace(profile, drafter=dataclasses.replace(profile.drafter, num_key_value_heads=5))
    with pytest.raises(ConfigError, match=r"drafter\.num_key_value_heads: 5 does not divide drafter\.num_attention_heads 32"):
        memory.workload_from_profile(bad)


def test_static_memory_counts_target_to_deepest_tap_and_this_ranks_fp32_shards_with_adamw():
    workload = rtx_workload()
    figures = memory.estimate(workload)
    shard = memory.shard_numel(memory.drafter_tensors(workload), 8)
    assert sum(rows * rest for rows, rest in memory.drafter_tensors(workload)) == memory.drafter_params(workload)
    assert memory.drafter_params(workload) / 8 <= shard < 1.001 * memory.drafter_params(workload) / 8   # padding only
    assert figures.drafter_weights == pytest.approx(shard * 4 / memory.MIB)
    assert figures.optimizer_states == pytest.approx(2 * figures.drafter_weights)
    assert figures.drafter_grads == figures.drafter_weights
    assert figures.static == figures.target_weights + figures.drafter_weights + figures.optimizer_states
    dropped = 64 - (max(workload.tap_layers) + 1)
    assert figures.target_weights == pytest.approx(
        (27_000_000_000 - dropped * QWEN36_27B_LIKE.layer_params()) * 2 / memory.MIB)


def test_fsdp2_sharding_is_what_frees_the_flagships_memory():
    """One rank holding everything vs 1/8 of the drafter: 8 x (weights + AdamW) becomes 1 x, the
    gradients are shards too, and what a forward/backward gathers is the root and two layers."""
    sharded, alone = memory.estimate(rtx_workload(compute_dtype="float32")), memory.estimate(rtx_workload(world_size=1))
    assert alone.drafter_weights == pytest.approx(8 * sharded.drafter_weights, rel=0.001)
    assert alone.static - sharded.static == pytest.approx(3 * (alone.drafter_weights - sharded.drafter_weights))
    assert alone.static - sharded.static > 17_000               # MiB: 3 x 7/8 of the 6,600 MiB of weights
    layer = memory.gathered_numel(memory.layer_tensors(rtx_workload()), 8) * 4 / memory.MIB
    root = memory.gathered_numel(memory.root_tensors(rtx_workload()), 8) * 4 / memory.MIB
    assert sharded.gathered_weights == pytest.approx(root + 2 * layer)
    assert memory.estimate(rtx_workload(compute_dtype="bfloat16")).gathered_weights == pytest.approx((root + 2 * layer) / 2)
    held = memory.estimate(rtx_workload(compute_dtype="float32", reshard_after_forward=False))
    assert held.held_weights == pytest.approx(root + 5 * layer)
    assert rtx_workload().key() == rtx_workload(world_size=2).key()    # a calibration on 2 ranks serves 8


def test_fsdp2_shards_are_the_ones_torch_makes():
    """FSDP2 splits dim 0 in chunks of ceil(rows / N), rank 0 the fullest (padded): checked against
    fully_shard's own shards on a fake 3-rank process group (no real ranks needed to shard)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shapes = [(7, 5), (300, 2), (5, 1), (64, 64), (1000, 3), (3, 1)]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        module = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(*shape)) for shape in shapes])
        fully_shard(module, mesh=init_device_mesh("cpu", (3,)))
        local = sum(p.to_local().numel() for p in module.parameters())
    finally:
        dist.destroy_process_group()
    assert memory.shard_numel(shapes, 3) == local == sum(-(-rows // 3) * rest for rows, rest in shapes)
    assert memory.gathered_numel(shapes, 3) == 3 * local


def test_between_steps_peaks_update_and_checkpoint_gather():
    workload = rtx_workload(max_length=256, num_anchors=8)                  # tiny activations
    figures = memory.estimate(workload)
    shard = figures.drafter_weights
    assert figures.update_peak == pytest.approx(figures.static + shard + shard)       # + foreach AdamW's temporary
    fc = 5120 * 5 * 5120 * 4 / memory.MIB                                  # the largest tensor, gathered whole
    assert figures.checkpoint_gather == pytest.approx(fc)
    assert figures.checkpoint_peak == pytest.approx(figures.static + fc)
    model = memory.estimated_peak_model(workload)
    assert model.between_steps_mib == figures.between_steps
    assert model.largest_fitting(model.between_steps_mib - 1, ceiling=8) == 0


def test_worst_case_grows_with_length_and_anchors_but_static_does_not():
    base = memory.estimate(rtx_workload())
    longer = memory.estimate(rtx_workload(max_length=16384))
    fewer_anchors = memory.estimate(rtx_workload(num_anchors=128))
    assert longer.per_sequence > base.per_sequence and longer.static == base.static
    assert fewer_anchors.drafter_activations < base.drafter_activations / 2
    short = rtx_workload(max_length=64)                     # anchors are capped by the length
    assert short.anchors == 63 and short.block_tokens == 63 * 16


def test_peak_is_the_higher_moment_linear_in_the_micro_batch_and_largest_fitting_respects_the_budget():
    model = memory.estimated_peak_model(rtx_workload())
    assert [line.moment for line in model.lines] == ["the loss's backward", "a draft layer's backward", "the target's forward"]
    line = model.deciding_line(3)
    assert model.peak_mib(3) - model.peak_mib(2) == pytest.approx(line.slope_mib)
    budget = model.peak_mib(2) + 1
    assert model.largest_fitting(budget, ceiling=8) == 2
    assert model.largest_fitting(budget, ceiling=1) == 1
    assert model.largest_fitting(model.peak_mib(1) - 1, ceiling=8) == 0


def test_with_checkpointed_layers_the_two_moments_differ_per_sequence():
    """Activation checkpointing: the loss's backward holds each layer's input only, a layer's
    backward one layer's activations more (its recomputation); the peak is the higher line."""
    figures = memory.estimate(rtx_workload(activation_checkpointing="layers"))
    loss, layer, target = figures.moment_lines()
    assert layer.slope_mib > loss.slope_mib and layer.slope_mib > target.slope_mib
    assert figures.drafter_activations < memory.estimate(rtx_workload(activation_checkpointing="none")).drafter_activations / 3
    model = memory.estimated_peak_model(rtx_workload(activation_checkpointing="layers"))
    assert model.step_mib(1) == max(loss.at(1), layer.at(1), target.at(1)) + figures.accumulated


def test_calibration_fits_the_line_through_two_measured_peaks_and_only_applies_to_its_workload():
    workload = rtx_workload()
    calibration = fit_calibration({2: 70_000.0, 1: 60_000.0}, workload, device_name="H200", world_size=2,
                                  micro_batches_per_step=2)
    assert (calibration.slope_mib, calibration.intercept_mib) == (10_000.0, 50_000.0)
    calibrated = memory.peak_model(workload, calibration)
    assert calibrated.source == "calibration"
    other = rtx_workload(max_length=4096)
    assert memory.peak_model(other, calibration).source == "estimate"
    with pytest.raises(ValueError, match="exactly two"):
        fit_calibration({1: 1.0}, workload)


def test_a_calibration_of_the_estimates_own_line_is_the_estimate_and_carries_its_accumulated_gradients():
    """Measured on 2 ranks in steps of 2 micro-batches (so the first micro-batch's gradients are in
    the measured peak): fed the estimate's own figures for THAT step, the calibrated plan for 8
    ranks is the estimate for 8 ranks, accumulated gradients, shard share and reduction buffers
    included; a measured miss of 1,000 MiB moves every micro-batch's peak by exactly that."""
    from dataclasses import replace

    workload = rtx_workload(num_anchors=256)
    measured_step = replace(workload, world_size=2, rank_share=3)
    line = memory.estimated_peak_model(measured_step)
    own = fit_calibration({1: line.step_mib(1), 2: line.step_mib(2)}, workload, world_size=2, micro_batches_per_step=2)
    calibrated, estimated = memory.peak_model(workload, own), memory.estimated_peak_model(workload)
    for m in (1, 2, 4, 8):
        assert calibrated.peak_mib(m) == pytest.approx(estimated.peak_mib(m)), m
    assert calibrated.accumulation_mib == estimated.accumulation_mib > 0
    assert calibrated.step_mib(8) < calibrated.step_mib(4) + 4 * calibrated.deciding_line(8).slope_mib  # 8 = the rank's share:
    missed = fit_calibration({1: line.step_mib(1) + 1000, 2: line.step_mib(2) + 1000}, workload, world_size=2,
                             micro_batches_per_step=2)                                      # no accumulation
    for m in (1, 2, 4):
        assert memory.peak_model(workload, missed).step_mib(m) == pytest.approx(estimated.step_mib(m) + 1000)


def test_calibration_is_stored_inside_the_baseline_and_read_back(tmp_path):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"gpus": [{"index": 0}], "hostname": "node"}))
    calibration = fit_calibration({1: 100.0, 3: 160.0}, rtx_workload())
    save_calibration(baseline, calibration)
    document = json.loads(baseline.read_text())
    assert document["hostname"] == "node" and document["memory_calibration"]["slope_mib"] == 30.0
    assert load_calibration(document, str(baseline)) == calibration
    assert load_calibration({"gpus": []}, "x") is None
    with pytest.raises(InputError, match="memory_calibration"):
        load_calibration({"memory_calibration": {"peaks_mib": [1]}}, str(baseline))


def test_offline_storage_reproduces_the_seeds_90_terabytes():
    storage = offline_storage(rtx_workload())
    assert storage.layers == 5 and storage.hidden == 5120 and storage.dtype_bytes == 2
    assert storage.bytes == 902_087 * 2000 * 5 * 5120 * 2
    assert 85e12 < storage.bytes < 95e12


def dflash2_profile(name: str = "rtx6000-x8", **drafter):
    profile = load_profile(name)
    return dataclasses.replace(profile, drafter=dataclasses.replace(profile.drafter, kind="dflash2", **drafter))


def test_dflash2s_additions_at_the_flagship_shape_are_the_published_counts():
    """rtx6000-x8 as DFlash 2 (kernel 2, groups of 16, rank 256 over the 248,320-token vocabulary, five
    layers): convolutions 65.7 M, codebooks 127.1 M (each 254 MB in float32), projection 1.3 M
    (benchmarks/results/dflash2-vs-dflash_cpu-2core_2026-12-04.md); the drafter's count grows by exactly that, and a
    DFlash workload keeps its calibration key."""
    dflash, dflash2 = memory.workload_from_profile(load_profile("rtx6000-x8")), memory.workload_from_profile(dflash2_profile())
    counts = memory.dflash2_parameter_counts(dflash2)
    assert counts == {"convolutions": 5 * 2 * (2 * 2 * 5120 + 2 * 2 * 320 * 5120), "codebooks": 2 * 248_320 * 256,
                      "projection": 256 * 5120}
    assert [round(n / 1e6, 1) for n in counts.values()] == [65.7, 127.1, 1.3]
    assert 248_320 * 256 * 4 / 1e6 == pytest.approx(254.3, abs=0.1)
    assert memory.drafter_params(dflash2) - memory.drafter_params(dflash) == sum(counts.values())
    assert memory.dflash2_parameter_counts(dflash) == {"convolutions": 0, "codebooks": 0, "projection": 0}
    assert dflash.key() == dataclasses.replace(dflash2, dflash2=None).key() != dflash2.key()
    static = memory.estimate(dflash2).static - memory.estimate(dflash).static
    added = 5 * memory.shard_numel(memory.conv_tensors(dflash2), 8) + memory.shard_numel(memory.selector_tensors(dflash2), 8)
    assert static == pytest.approx(3 * 4 * added / memory.MIB)      # this rank's fp32 shards and both AdamW states
    assert added > sum(counts.values()) / 8                         # base_kernel's 2 rows pad to 8: one row each


def test_dflash2s_tensors_are_the_real_modules_parameters_on_a_meta_build():
    """The model's tensors, per FSDP2 unit, are those of DFlash2Drafter built as the trainer builds it
    (drafter_config + with_dflash2), on the meta device at a small shape: each draft layer with its two
    convolutions, the selector (its own unit) with both codebooks and the projection."""
    import torch
    from transformers import Qwen3Config

    from dflash.drafter.dflash2 import DFlash2Drafter, drafter_for_config, profile_dflash2_options, with_dflash2
    from dflash.drafter.network import drafter_config
    from dflash.drafter.shape import profile_shape
    from dflash.memory.target_shape import shape_from_config

    target = Qwen3Config(hidden_size=160, intermediate_size=544, num_hidden_layers=12, num_attention_heads=6,
                         num_key_value_heads=1, head_dim=32, vocab_size=4096)
    profile = dflash2_profile(num_layers=3, target_layer_ids=(1, 5, 9), num_attention_heads=8, num_key_value_heads=4,
                              head_dim=16, layer_types=(), conv_kernel_size=3, conv_group_size=32, selector_rank=64)
    config = drafter_config(target, num_layers=3, block_size=16, target_layer_ids=[1, 5, 9], mask_token_id=4000,
                            shape=profile_shape(profile.drafter))
    with torch.device("meta"):
        drafter = drafter_for_config(with_dflash2(config, profile_dflash2_options(profile.drafter)))
    assert isinstance(drafter, DFlash2Drafter)
    workload = memory.workload_from_profile(profile, shape_from_config(target.to_dict(), "small"), 8)

    def shapes(module: torch.nn.Module) -> list[memory.Tensor]:
        return sorted((p.shape[0], p[0].numel()) for p in module.parameters(recurse=True))

    assert shapes(drafter.layers[0]) == sorted(memory.layer_tensors(workload))
    assert shapes(drafter.candidate_selector) == sorted(memory.selector_tensors(workload))
    assert sum(p.numel() for p in drafter.parameters()) == memory.drafter_params(workload)
    counts = memory.dflash2_parameter_counts(workload)
    selector = drafter.candidate_selector
    assert counts["codebooks"] == selector.predecessor_codebook.numel() + selector.successor_codebook.numel()
    assert counts["projection"] == selector.hidden_projection.weight.numel()
    assert counts["convolutions"] == sum(p.numel() for name, p in drafter.named_parameters() if "_conv." in name)
