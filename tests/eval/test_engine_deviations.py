"""An engine that computes the drafter otherwise than trained (dflash/eval/engine_deviations.py): the probe
of vLLM's CPU kernel, our drafter decoding the same way, and the served check comparing like with like.

The engine tests start the real vLLM CPU build: its grouped rms_norm gives every draft layer's context keys
layer 0's k_norm weight; a drafter whose layers' k_norm weights differ is served as another drafter, and
only an in-process side that norms its context keys the same way decodes step for step as vLLM does."""
from __future__ import annotations

import shutil

import pytest

from dflash.eval.engine_deviations import VLLM_CPU_CONTEXT_K_NORM, engine_deviations, grouped_norm_probe
from launcher_core.profile import load_profile

K_NORM = "layers.{}.self_attn.k_norm.weight"


def tiny_drafter(target, layers: int = 3):
    """A random drafter of the tiny target whose layers' k_norm weights all differ."""
    import torch

    from dflash.drafter.network import DFlashDrafter, drafter_config

    torch.manual_seed(0)
    config = drafter_config(target.config, num_layers=layers, block_size=4, target_layer_ids=[1], mask_token_id=151669)
    drafter = DFlashDrafter(config).attach_target(target).eval()
    with torch.no_grad():
        for index, layer in enumerate(drafter.decoder_layers):
            layer.self_attn.k_norm.weight.copy_(1 + 0.5 * index * torch.rand(layer.self_attn.k_norm.weight.shape))
    return drafter


def test_the_context_keys_of_every_layer_are_normed_with_the_named_layers_k_norm(tiny_qwen3_model):
    import torch

    from dflash.drafter.draft_cache import DraftContextCache, extend_cache

    drafter = tiny_drafter(tiny_qwen3_model)
    features = torch.randn(1, 7, drafter.fc.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = extend_cache(drafter, DraftContextCache(), features)
        first = extend_cache(drafter, DraftContextCache(), features, context_k_norm_layer=0)
        layers = list(drafter.decoder_layers)
        context = drafter.project_context(features)
        cos, sin = drafter.rotary_emb(context, torch.arange(7)[None])
        by_hand = layers[2].self_attn.project_kv(context, cos, sin, layers[0].self_attn.k_norm)
    torch.testing.assert_close(first.layers[0].keys, own.layers[0].keys)            # layer 0: its own anyway
    torch.testing.assert_close(first.layers[2].keys, by_hand[0])
    torch.testing.assert_close(first.layers[2].values, own.layers[2].values)        # values are not normed
    assert not torch.allclose(first.layers[2].keys, own.layers[2].keys)             # the weights differ


def test_a_drafter_decoding_as_the_engine_computes_drafts_otherwise_only_where_its_k_norms_differ(tiny_qwen3_model):
    import torch

    from dflash.eval.dflash_drafter import DFlashDraft

    drafter = tiny_drafter(tiny_qwen3_model)
    features = torch.randn(9, drafter.fc.in_features, generator=torch.Generator().manual_seed(2))

    def logits(model, layer) -> torch.Tensor:
        draft = DFlashDraft(model=model, context_k_norm_layer=layer)
        return draft._block_logits(features, 5)

    assert not torch.allclose(logits(drafter, None), logits(drafter, 0))
    with torch.no_grad():
        for layer in drafter.decoder_layers:
            layer.self_attn.k_norm.weight.copy_(list(drafter.decoder_layers)[0].self_attn.k_norm.weight)
    torch.testing.assert_close(logits(drafter, None), logits(drafter, 0))
    with pytest.raises(ValueError, match="needs the context K/V cache"):
        DFlashDraft(model=drafter, use_cache=False, context_k_norm_layer=0)._block_logits(features, 5)


def test_nothing_is_probed_on_a_gpu_profile_or_for_sglang():
    assert engine_deviations("vllm", load_profile("rtx6000-x8")) == []
    assert engine_deviations("sglang", load_profile("cpu-demo")) == []


@pytest.mark.engine
@pytest.mark.slow
def test_the_probe_finds_that_vllms_cpu_rms_norm_reads_only_the_first_row_of_a_grouped_weight(vllm_python):
    assert grouped_norm_probe(str(vllm_python)) == "first"
    assert engine_deviations("vllm", load_profile("cpu-demo")) == [VLLM_CPU_CONTEXT_K_NORM]


@pytest.mark.engine
@pytest.mark.slow
def test_served_by_vllm_a_drafter_with_other_k_norms_per_layer_decodes_as_the_engine_norms_its_context_keys(
        engine_profile, demo_drafter, tmp_path):
    """The demo drafter with its layers' k_norm weights pulled apart, served by vLLM: the in-process side as
    trained departs from it on several prompts; normed as the engine norms context keys, it accepts the same
    drafts at every step of every prompt (each side decodes the target alone and DFlash only: prompt lookup is
    not compared)."""
    import torch
    from engine_vllm_common import NUM_PROMPTS, inprocess_of, served_settings
    from safetensors.torch import load_file, save_file

    from dflash.eval.engines import run_engines
    from dflash.eval.options import eval_prompts_path
    from dflash.eval.served import export_for_engine
    from dflash.target_model import resolve_model_path

    checkpoint = tmp_path / "apart"
    shutil.copytree(demo_drafter, checkpoint)
    weights = load_file(str(checkpoint / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for index in (1, 2):
        weight = weights[K_NORM.format(index)]
        weights[K_NORM.format(index)] = weight * (1 + 0.6 * index * torch.rand(weight.shape, generator=generator))
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    prompts = eval_prompts_path(engine_profile, None)
    trained = inprocess_of(engine_profile, checkpoint, prompts)
    alike = inprocess_of(engine_profile, checkpoint, prompts, context_k_norm_layer=0)
    settings = served_settings(engine_profile, trained)
    target = resolve_model_path(engine_profile.model.target)
    drafter = export_for_engine("vllm", checkpoint, target, tmp_path, None)
    served = run_engines("vllm", engine_profile, target, drafter, settings.block_size, trained.prompt_ids, settings,
                         tmp_path / "logs", methods=("dflash",))["dflash"].prompts

    def same(side) -> int:
        return sum(theirs.per_step == ours.per_step for theirs, ours in zip(served, side.side("dflash").prompts))

    assert same(alike) == NUM_PROMPTS
    assert same(trained) <= NUM_PROMPTS - 3, "the control: as trained, the served drafter departs"
