"""A checkpoint written by training loads strictly into the reference `DFlashDraftModel` (PyPI
`dflash` 0.1.0 under the transformers it pins, in a scratch venv) and gives the same draft logits
as our drafter for the same inputs: the default drafter, and one with a sliding-window layer
(window shorter than the context, so the window matters) and YaRN-scaled RoPE, on the tiny
Qwen3 target and on SmolLM2-135M."""
from __future__ import annotations

import pytest
import torch

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile
from tests.train.reference_venv import compare_with_reference

pytestmark = pytest.mark.slow
CONTEXT = 11
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
           "rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 64}


def trained(root, target, dataset, drafter):
    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.train.supervisor.launch import run_training

    profile = load_profile(str(write_profile(root / "p.toml", target, dataset, root / "run",
                                             machine={"nproc_per_node": 1}, max_steps=3, save_every_steps=3,
                                             drafter={"num_layers": 2, "target_layer_ids": [1, 2], **drafter})))
    assert run_training(profile, run_dir=root / "run") == 0
    return latest_checkpoint(root / "run")


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    return trained(tmp_path_factory.mktemp("reference-run"), tiny_qwen3_target, tiny_dataset, {})


@pytest.fixture(scope="module")
def sliding_checkpoint(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    return trained(tmp_path_factory.mktemp("reference-swa"), tiny_qwen3_target, tiny_dataset, SLIDING)


def test_training_checkpoint_loads_strictly_into_the_reference_and_gives_the_same_logits(
        trained_checkpoint, tiny_target_model, tmp_path):
    compare_with_reference(trained_checkpoint, tiny_target_model, tmp_path, context=CONTEXT)


def without_window(drafter):
    from launcher_core.layer_attention import LayerAttention

    drafter.layer_rules = [LayerAttention() for _ in drafter.layer_rules]
    return drafter


def test_sliding_window_and_yarn_checkpoint_matches_the_reference(sliding_checkpoint, tiny_target_model, tmp_path):
    result = compare_with_reference(sliding_checkpoint, tiny_target_model, tmp_path, context=CONTEXT)
    assert result.drafter.layer_rules[0].window == 4 < CONTEXT and result.drafter.rotary_emb.attention_scaling > 1
    unwindowed = without_window(result.drafter).draft_logits(*result.inputs)
    assert not torch.allclose(unwindowed, result.reference, atol=1e-3)     # the window changed the logits


def test_sliding_window_drafter_on_smollm2_matches_the_reference(smollm2_dir, tmp_path):
    """SmolLM2-135M (the embedded default's target): a random drafter of its shape, saved as training saves it."""
    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.drafter.network import DFlashDrafter, drafter_config
    from dflash.target_model import load_target

    target = load_target(smollm2_dir)
    torch.manual_seed(0)
    config = drafter_config(target.config, num_layers=3, block_size=8, target_layer_ids=[1, 14, 27],
                            mask_token_id=2, layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                            sliding_window=6, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                            "original_max_position_embeddings": 4096})
    config.num_target_layers = target.config.num_hidden_layers
    drafter = DFlashDrafter(config).attach_target(target)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    checkpoint = save_checkpoint(tmp_path / "run", drafter, 1, {})
    result = compare_with_reference(checkpoint, target, tmp_path, context=20, first_token=500)
    assert not torch.allclose(without_window(result.drafter).draft_logits(*result.inputs), result.reference, atol=1e-3)
