"""A checkpoint written by training loads strictly into the reference `DFlashDraftModel` (PyPI
`dflash` 0.1.0 under the transformers it pins, in a scratch venv) and gives the same draft logits
as our drafter for the same inputs."""
from __future__ import annotations

import pytest

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile
from tests.train.reference_venv import compare_with_reference

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
    compare_with_reference(trained_checkpoint, tiny_target_model, tmp_path, context=CONTEXT)
