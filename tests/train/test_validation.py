"""Validation during training (dflash.train.rank.validation): held-out rows, balanced forwards on every
rank, eval's tau counted on the held-out blocks, the best step named and evaluated by the pipeline."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from dflash.data.validation_split import split_rows
from dflash.drafter.loss import counted_tau, leading_accepted, simulated_tau
from dflash.train.rank.validation import rank_batches


def test_the_held_out_rows_are_chosen_once_from_count_share_and_seed():
    split = split_rows(526, 0.05, seed=0)
    assert len(split.validation) == 26 and len(split.train) == 500
    assert sorted(split.train + split.validation) == list(range(526))        # a partition of the rows
    assert split_rows(526, 0.05, seed=0) == split                            # the same on every rank and restart
    assert split_rows(526, 0.05, seed=1).validation != split.validation      # control: the seed chooses them
    assert split_rows(10, 0.01, seed=0).validation and not split_rows(10, 0.0, seed=0).validation


@pytest.mark.parametrize("rows,world,micro_batch", [(5, 2, 1), (5, 2, 2), (1, 2, 4), (26, 2, 4), (7, 3, 2)])
def test_every_rank_runs_the_same_number_of_forwards_and_each_row_counts_once(rows, world, micro_batch):
    held = list(range(100, 100 + rows))
    plans = [rank_batches(held, rank, world, micro_batch) for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1
    counted = [row for plan in plans for batch, counts in plan if counts for row in batch]
    assert sorted(counted) == held
    assert all(batch for plan in plans for batch, _ in plan)                 # no empty forward
    naive = [[held[rank::world][i:i + micro_batch] for i in range(0, len(held[rank::world]), micro_batch)]
             for rank in range(world)]
    if rows % world:                                                          # control: a plain split is unbalanced
        assert len({len(plan) for plan in naive}) > 1 or any(not plan for plan in naive)


def test_held_out_tau_counts_the_leading_accepted_slots_as_eval_does():
    # 3 blocks of 4 slots: right, right, wrong, right -> 2; wrong first -> 0; a slot without a label ends the run -> 1
    correct_by_slot = [[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 1]]
    mask = torch.tensor([[[1.0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]])
    keep = mask.reshape(-1) > 0
    correct = torch.tensor([c for block, m in zip(correct_by_slot, mask[0]) for c, k in zip(block, m) if k > 0],
                           dtype=torch.float32)
    accepted, blocks = leading_accepted(correct, keep, mask)
    assert (float(accepted), float(blocks)) == (3.0, 3.0)
    assert counted_tau(float(accepted), float(blocks)) == pytest.approx(2.0)
    acc = [2 / 3, 2 / 3, 2 / 3, 1.0]
    assert simulated_tau(acc) != pytest.approx(2.0)           # the per-slot estimate is not the count: named apart
    assert counted_tau(0.0, 0.0) == 1.0


def test_a_block_whose_first_slot_has_no_label_is_not_counted():
    mask = torch.tensor([[[0.0, 1, 1], [1, 1, 1]]])
    keep = mask.reshape(-1) > 0
    accepted, blocks = leading_accepted(torch.ones(int(keep.sum())), keep, mask)
    assert (float(accepted), float(blocks)) == (3.0, 1.0)


def test_training_batch_tau_counts_the_bonus_token_as_eval_does():
    assert simulated_tau([0.0, 0.0]) == 1.0                   # always wrong: tau 1, as in eval
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0              # always right over B - 1 = 3 slots: tau B
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1.75)


def test_train_data_keeps_the_held_out_rows_out_of_every_step(tiny_dataset, tmp_path):
    from dflash.train.rank.data import TrainData
    from dflash.train.rank.parallel import WorkerEnv
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    profile = load_profile(str(write_profile(tmp_path / "p.toml", Path("unused"), tiny_dataset, tmp_path / "run",
                                             validation_share=0.25)))
    data = TrainData(tiny_dataset, profile, WorkerEnv(0, 1, 0))
    held = set(data.split.validation)
    assert len(held) == 8 and len(data.dataset) == 24 and data.steps_per_epoch == 6
    seen = set()
    for step in range(2 * data.steps_per_epoch):
        epoch, rows = data.step_rows(step)
        seen |= set(data.collate(rows, epoch).rows)
    assert seen == set(data.split.train) and not seen & held
    batch = data.collate_dataset_rows(sorted(held)[:2], 0)
    assert batch.rows == tuple(sorted(held)[:2])
    assert batch.input_ids[0, : batch.lengths[0]].tolist() == list(data.source[sorted(held)[0]]["input_ids"])


def test_the_validation_keys_have_their_ranges(tmp_path, tiny_dataset):
    from launcher_core.errors import ConfigError
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    for bad in ({"validation_share": 1.0}, {"validation_share": -0.1}, {"validation_every_steps": -1}):
        with pytest.raises(ConfigError) as error:
            load_profile(str(write_profile(tmp_path / "p.toml", Path("unused"), tiny_dataset, tmp_path, **bad)))
        assert f"train.{next(iter(bad))}" in str(error.value)


def test_held_out_series_reads_the_validation_lines_only():
    from dflash.eval.plots import held_out_series

    metrics = [{"step": 1, "loss": 5.0, "sim_tau": 1.1}, {"step": 2, "loss": 4.0, "sim_tau": 1.2, "val_loss": 4.5,
                                                          "val_tau": 1.3}, {"step": 3, "loss": 3.0}]
    assert held_out_series(metrics) == ([2], [4.5], [1.3])
    assert held_out_series(metrics[:1]) == ([], [], [])


def _manifest(run_dir: Path, **train: object) -> None:
    from launcher_core.manifest import update_stage

    update_stage(run_dir, "train", "done", steps=24, **train)


def test_the_pipeline_evaluates_the_best_step_or_says_why_it_takes_the_last(tmp_path):
    from dflash.drafter.checkpoint_files import WEIGHTS
    from dflash.stages import eval_checkpoint

    run_dir = tmp_path / "run"
    _manifest(run_dir)
    assert eval_checkpoint(run_dir) == (None, "the last step (no held-out rows: train.validation_share is 0)")
    best = run_dir / "train" / "checkpoints" / "step-12"
    _manifest(run_dir, validation_best_step=12, validation_best_tau=1.4, validation_best_checkpoint=str(best),
              validation_last_step=24, validation_last_tau=1.3)
    checkpoint, why = eval_checkpoint(run_dir)
    assert checkpoint is None and "best held-out step 12 has no checkpoint" in why   # control: its files are gone
    best.mkdir(parents=True)
    (best / WEIGHTS).write_bytes(b"")
    assert eval_checkpoint(run_dir) == (str(best), "step 12, the best by held-out tau (1.4; step 24, held-out tau 1.3)")


# --- the real thing: 2 gloo ranks under torchrun ------------------------------------------------

@pytest.fixture(scope="module")
def validated(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    """24 steps on 2 ranks, 5 of the 32 rows held out (3 on rank 0, 2 on rank 1), measured every 6
    steps; checkpoints at 12 and 24."""
    from dflash.train.supervisor.launch import run_training
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    root = tmp_path_factory.mktemp("validated")
    profile = load_profile(str(write_profile(root / "p.toml", tiny_qwen3_target, tiny_dataset, root / "run",
                                             validation_share=0.16, validation_every_steps=6, lr=3e-3)))
    assert run_training(profile, run_dir=root / "run") == 0
    return profile, root / "run"


@pytest.mark.slow
def test_validation_runs_on_every_rank_and_names_the_best_step(validated):
    _, run_dir = validated
    lines = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    measured = [line for line in lines if "val_tau" in line]
    assert [line["step"] for line in measured] == [6, 12, 18, 24]
    assert all(math.isfinite(line["val_loss"]) and 1.0 <= line["val_tau"] <= 4.0 for line in measured)
    assert measured[-1]["val_loss"] < measured[0]["val_loss"]
    record = json.loads((run_dir / "train" / "validation.json").read_text())
    assert len(record["rows"]) == 5 and [h["step"] for h in record["history"]] == [6, 12, 18, 24]
    best = max(record["history"], key=lambda h: (h["tau"], -h["loss"], -h["step"]))
    assert record["best"]["step"] == best["step"]
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert stage["validation_best_step"] == best["step"] and stage["validation_rows"] == 5
    saved = best["step"] in (12, 24)
    assert (stage["validation_best_checkpoint"] is not None) == saved
    assert any((run_dir / "train" / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_two_ranks_figures_equal_one_process_over_all_held_out_rows(validated, tmp_path):
    """The all-reduced held-out figures of step 12 (2 ranks, uneven shares) are those of one process
    measuring every held-out row with the step-12 weights; one rank's share alone is not (control)."""
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.validation import measure

    profile, run_dir = validated
    again = tmp_path / "again"
    shutil.copytree(run_dir / "train" / "checkpoints" / "step-12", again / "train" / "checkpoints" / "step-12")
    (again / "train" / "checkpoints" / "latest").write_text("step-12\n")
    state = build_state(profile, again, WorkerEnv(0, 1, 0), resume=True)
    assert state.step == 12
    rows = list(state.data.split.validation)
    alone = measure(state, state.data, rows)
    logged = next(json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["step"] == 12)
    assert alone.loss == pytest.approx(logged["val_loss"], rel=1e-5)
    assert alone.tau == pytest.approx(logged["val_tau"], rel=1e-6)
    share = measure(state, state.data, rows[0::2])
    assert share.blocks < alone.blocks and share.loss != pytest.approx(logged["val_loss"], rel=1e-5)
