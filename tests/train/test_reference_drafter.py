"""A checkpoint written by training loads strictly into the reference `DFlashDraftModel` (PyPI
`dflash` 0.1.0 under the transformers it pins, in a scratch venv) and gives the same draft logits
as our drafter for the same inputs."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile
from tests.train.reference_venv import reference_python

pytestmark = pytest.mark.slow
CONTEXT = 11


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    from dflash.drafter.checkpoint import latest_checkpoint
    from dflash.train.launch import run_training

    root = tmp_path_factory.mktemp("reference-run")
    profile = load_profile(str(write_profile(root / "p.toml", tiny_qwen3_target, tiny_dataset, root / "run",
                                             machine={"nproc_per_node": 1}, max_steps=3, save_every_steps=3,
                                             drafter={"num_layers": 2, "target_layer_ids": [1, 2]})))
    assert run_training(profile, run_dir=root / "run") == 0
    return latest_checkpoint(root / "run")


def test_training_checkpoint_loads_strictly_into_the_reference_and_gives_the_same_logits(
        trained_checkpoint, tiny_target_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash.drafter.checkpoint import load_drafter
    from dflash.drafter.taps import extract_taps

    python = reference_python()
    drafter = load_drafter(trained_checkpoint, tiny_target_model)
    input_ids = torch.arange(1000, 1000 + CONTEXT + 1)[None]
    features = extract_taps(tiny_target_model, input_ids, drafter.target_layer_ids)[:, :CONTEXT]
    ours = drafter.draft_logits(features, int(input_ids[0, CONTEXT]), CONTEXT)
    block = drafter.block_input_ids(input_ids[:, CONTEXT])
    inputs = {"target_hidden": features.contiguous(), "position_ids": torch.arange(CONTEXT + drafter.block_size)[None],
              "noise_embedding": tiny_target_model.get_input_embeddings()(block).contiguous(),
              "lm_head": tiny_target_model.get_output_embeddings().weight.detach().contiguous()}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    done = subprocess.run([str(python), "tests/train/reference_logits.py", str(trained_checkpoint),
                           str(tmp_path / "inputs.safetensors"), str(tmp_path / "logits.safetensors")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(not keys for keys in seen["loading_info"].values()), seen["loading_info"]
    config = drafter.config
    assert (seen["block_size"], seen["mask_token_id"], seen["target_layer_ids"]) == (
        drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids)
    assert seen["rope_theta"] == config.rope_parameters["rope_theta"]
    torch.testing.assert_close(torch.tensor(seen["inv_freq"]), drafter.rotary_emb.inv_freq.float())
    reference = load_file(str(tmp_path / "logits.safetensors"))["logits"][0]
    torch.testing.assert_close(reference, ours.float(), rtol=1e-4, atol=1e-4)
