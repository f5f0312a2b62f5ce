"""The demo's checkpoint retention and the pipeline's eval step: at cpu-demo's train.keep_checkpoints the best
step by held-out tau survives every prune and is the one the pipeline evaluates. Kept apart from
tests/train/test_retention.py, which is in the torch compat lane: what a rank runs, not the pipeline."""
from __future__ import annotations

from dflash.drafter.checkpoint_files import LATEST, checkpoints_dir
from dflash.stages import eval_checkpoint
from dflash.train.rank.retention import complete_checkpoints, prune_checkpoints
from launcher_core.manifest import update_stage
from launcher_core.profile import load_profile
from tests.train.test_retention import fake_checkpoint


def test_the_demo_keeps_at_the_default_the_best_step_the_pipeline_evaluates(tmp_path):
    """cpu-demo sets no train.keep_checkpoints: at the default (3) its 13 saves (every 50 of 650 steps, held-out tau
    measured at each) leave at most the newest 3 and the best, and the best step the pipeline evaluates is among
    them after every save, however early it came."""
    train = load_profile("cpu-demo").train
    assert train.keep_checkpoints == 3 and train.validation_share > 0 and train.validation_every_steps == 0
    for step in range(train.save_every_steps, 651, train.save_every_steps):
        fake_checkpoint(tmp_path, step)
        (checkpoints_dir(tmp_path) / LATEST).write_text(f"step-{step}\n")
        prune_checkpoints(tmp_path, train.keep_checkpoints, best=100 if step >= 100 else step)
        assert len(complete_checkpoints(tmp_path)) <= train.keep_checkpoints + 1
    assert sorted(complete_checkpoints(tmp_path)) == [100, 550, 600, 650]
    best = checkpoints_dir(tmp_path) / "step-100"
    update_stage(tmp_path, "train", "done", validation_best_step=100, validation_best_tau=1.5,
                 validation_best_checkpoint=str(best), validation_last_step=650, validation_last_tau=1.4)
    assert eval_checkpoint(tmp_path)[0] == str(best)
