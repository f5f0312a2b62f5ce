"""A DFlash 2 checkpoint we write (by training, or saved as training saves it) loads STRICTLY into the
reference `DFlash2DraftModel` (PyPI `dflash` 0.1.0 under the transformers it pins, in a scratch venv,
through its own `from_pretrained` and its codebook key mapping) and gives the same unary logits
(1e-4), the same greedy selector path and the same candidates as ours: on the tiny Qwen3 target
(a trained checkpoint), on SmolLM2-135M and on the flagship twin, with sliding-window layers over
a context longer than the window. Negative controls: one tensor perturbed, or the two codebooks
swapped, in the reference's copy, and the comparison fails."""
from __future__ import annotations

import shutil

import pytest
import torch

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile
from tests.train.reference_venv import assert_same_as_reference, run_dflash2_reference

pytestmark = pytest.mark.slow
DFLASH2 = {"kind": "dflash2", "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
           "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}


def random_dflash2(target, *, layers: tuple[str, ...], window: int, taps: list[int], block: int = 8, rank: int = 16,
                   top_k: int = 8, softcap: float = 0.0, seed: int = 0):
    """A DFlash 2 drafter for `target` whose every parameter is moved off its start (so the convolutions
    and the selector matter), with a selector strong enough to overrule the unary head."""
    from dflash.drafter.dflash2 import DFlash2Options, drafter_for_config, with_dflash2
    from dflash.drafter.network import drafter_config

    config = drafter_config(target.config, num_layers=len(layers), block_size=block, target_layer_ids=taps,
                            mask_token_id=2, layer_types=layers, sliding_window=window)
    config.num_target_layers = target.config.num_hidden_layers
    config = with_dflash2(config, DFlash2Options(conv_group_size=16, selector_rank=rank, selector_top_k=top_k,
                                                 output_multiplier=1.5, final_logit_softcapping=softcap))
    torch.manual_seed(seed)
    drafter = drafter_for_config(config).attach_target(target)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            scale = 1.0 if "codebook" in name or "hidden_projection" in name else 0.3 if "_conv." in name else 0.02
            parameter.add_(scale * torch.randn_like(parameter))
    return drafter


def saved(drafter, directory):
    from dflash.drafter.checkpoint_files import save_checkpoint

    return save_checkpoint(directory, drafter, 1, {})


def unary_path(result) -> list[int]:
    return result.ours_logits[1:].argmax(dim=-1).tolist()


@pytest.fixture(scope="module")
def trained_dflash2(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.train.supervisor.launch import run_training

    root = tmp_path_factory.mktemp("dflash2-run")
    profile = load_profile(str(write_profile(root / "p.toml", tiny_qwen3_target, tiny_dataset, root / "run",
                                             machine={"nproc_per_node": 1}, max_steps=3, save_every_steps=3,
                                             drafter={"num_layers": 2, "target_layer_ids": [1, 2], **DFLASH2})))
    assert run_training(profile, run_dir=root / "run") == 0
    return latest_checkpoint(root / "run")


def test_a_trained_dflash2_checkpoint_is_the_references_drafter(trained_dflash2, tiny_target_model, tmp_path):
    from safetensors import safe_open

    with safe_open(str(trained_dflash2 / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names          # the published names, bare codebooks
    result = run_dflash2_reference(trained_dflash2, tiny_target_model, tmp_path, context=12, first_token=1000)
    assert_same_as_reference(result)
    assert result.drafter.layer_rules[0].window == 5 < 12


def test_dflash2_on_smollm2_with_sliding_windows_matches_the_reference(smollm2_dir, tmp_path):
    from dflash.target_model import load_target

    target = load_target(smollm2_dir)
    drafter = random_dflash2(target, layers=("sliding_attention", "sliding_attention", "full_attention"), window=6,
                             taps=[1, 14, 27], softcap=30.0)
    result = run_dflash2_reference(saved(drafter, tmp_path / "run"), target, tmp_path, context=20, first_token=500)
    assert_same_as_reference(result)
    assert result.ours_path != unary_path(result)          # the selector overruled the head: its walk was compared


def test_dflash2_on_the_flagship_twin_matches_the_reference(flagship_twin_target, tmp_path):
    from dflash.target_model import load_target

    target = load_target(flagship_twin_target)
    drafter = random_dflash2(target, layers=("sliding_attention",) * 2 + ("full_attention",), window=5,
                             taps=[1, 3, 5], block=16)
    result = run_dflash2_reference(saved(drafter, tmp_path / "run"), target, tmp_path, context=14, first_token=2000)
    assert_same_as_reference(result)
    assert result.ours_path != unary_path(result) and result.drafter.layer_rules[0].window == 5 < 14


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir, tmp_path_factory):
    """SmolLM2 and a DFlash 2 checkpoint of it (for the negative controls)."""
    from dflash.target_model import load_target

    target = load_target(smollm2_dir)
    drafter = random_dflash2(target, layers=("sliding_attention", "full_attention"), window=6, taps=[5, 20], seed=1)
    return target, saved(drafter, tmp_path_factory.mktemp("neg") / "run")


def altered_copy(checkpoint, directory, change):
    """The checkpoint copied, its weights changed by `change(tensors)` (the reference reads the copy)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def test_one_perturbed_tensor_fails_the_equality(smollm2_pair, tmp_path):
    target, checkpoint = smollm2_pair

    def perturb(tensors):
        tensors["layers.1.mlp_conv.base_kernel"][1, 1] += 0.05          # the output side's second tap, one layer

    copy = altered_copy(checkpoint, tmp_path / "perturbed", perturb)
    result = run_dflash2_reference(checkpoint, target, tmp_path, context=20, first_token=500, reference_checkpoint=copy)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(result.reference_logits, result.ours_logits.float(), rtol=1e-4, atol=1e-4)
    same = run_dflash2_reference(checkpoint, target, tmp_path, context=20, first_token=500)
    assert_same_as_reference(same)                                   # the unaltered copy passes


def test_swapped_codebooks_fail_the_equality(smollm2_pair, tmp_path):
    target, checkpoint = smollm2_pair

    def swap(tensors):
        a, b = "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"
        tensors[a], tensors[b] = tensors[b], tensors[a]

    copy = altered_copy(checkpoint, tmp_path / "swapped", swap)
    result = run_dflash2_reference(checkpoint, target, tmp_path, context=20, first_token=500, reference_checkpoint=copy)
    torch.testing.assert_close(result.reference_logits, result.ours_logits.float(), rtol=1e-4, atol=1e-4)   # same head
    with pytest.raises(AssertionError):
        assert_same_as_reference(result)                             # another walk
