"""A step whose loss cannot train the drafter stops the run before its weights are saved
(dflash.train.rank.loss_check): a non-finite loss or gradient norm, or more steps without a supervised position
in a row than train.max_skipped_steps (fewer are skipped and counted), ends a real 2-rank
gloo run with exit 4 and one line naming the cause and the keys that decide it; the last good checkpoint
stays `latest`. A profile whose data.max_length leaves every row of the dataset
without a block is refused before any rank starts (exit 2, the key named; exit 4 when the data itself has none)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import write_dataset, write_profile


def with_data(profile: Path, **data: object) -> Path:
    """Add a [data] section to a profile written by write_profile."""
    profile.write_text(profile.read_text(encoding="utf-8") + "[data]\n" + "".join(f"{k} = {v}\n" for k, v in data.items()),
                       encoding="utf-8")
    return profile


def ended(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]


def checkpoint_steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "train" / "checkpoints").iterdir() if p.name != "latest")


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_a_loss_that_turns_nan_stops_the_run_and_sends_the_user_to_start_over(tmp_path, tiny_qwen3_target):
    """train.lr = 1e30: step 1 trains (its checkpoint is written), its update throws the weights to ~1e30,
    and step 2's loss is NaN. Every rank stops after step 2, before its save: exit 4, one line naming train.lr;
    step-1 stays `latest`. step-1's weights are wrecked (their RMS 9e30 x the run's initial), so the line says
    no checkpoint can train and to start over, not to continue from step-1 with --resume (which fails again at
    step 2 whatever train.lr is). Following the advice with a sane lr trains past step 2."""
    from dflash.drafter.checkpoint_files import read_weights
    from tests.safety.runs import finish, start_train

    run_dir = tmp_path / "run"
    data = write_dataset(tmp_path / "data")
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, data, run_dir, max_steps=4, save_every_steps=1, lr=1e30)
    code, out = finish(start_train(profile, run_dir))
    assert code == 4, out
    [line] = error_lines(out)
    assert line.startswith("error: rank ") and ": step 2: the loss is nan" in line, out
    assert "train.lr = 1e+30 too high" in line and "--resume" not in line
    assert re.search(r"once the key named is changed, no checkpoint of this run can train \(step-1: its weights cannot "
                     r"train: their RMS is 1e\+30, \d\.\d+e\+30 x the run's initial 0\.\d+ \(more than 50 x: an update "
                     r"that diverged wrecked them; a run that trains stays near 1 x\)\): start over with --start-over "
                     r"\(the old train/ is kept as train\.prev-\*\)$", line), line
    assert "Traceback" not in out and "FAILED" not in out
    assert checkpoint_steps(run_dir) == ["step-1"]
    assert (run_dir / "train" / "checkpoints" / "latest").read_text().strip() == "step-1"
    assert all(bool(tensor.isfinite().all()) for tensor in read_weights(run_dir / "train" / "checkpoints" / "step-1").values())
    assert ended(run_dir)["ended_by"] == "loss unusable"
    records = [json.loads(p.read_text()) for p in (run_dir / "train" / "failures").glob("rank-*.json")]
    assert {r["kind"] for r in records} == {"loss_unusable"} and len(records) == 2     # every rank stopped alike

    write_profile(profile, tiny_qwen3_target, data, run_dir, max_steps=4, save_every_steps=1, lr=1e-2)
    code, out = finish(start_train(profile, run_dir, "--start-over"))
    assert code == 0, out
    assert sorted(metrics_lines(run_dir)) == [1, 2, 3, 4] and all(math.isfinite(line["loss"]) for line in metrics_lines(run_dir).values())


@pytest.mark.slow
def test_the_nan_advice_names_the_newest_checkpoint_that_can_train_and_resume_takes_it(tmp_path, tiny_qwen3_target):
    """2 healthy steps at lr 1e-2; resumed at lr 1e30 (the profile's lr applies over the checkpoint's),
    step 3's update wrecks the weights step-3 holds and step 4 is NaN: exit 4 naming step-2, the newest checkpoint
    whose weights can train, and that --resume skips step-3. Following it at lr 1e-2, --resume skips step-3
    (said), resumes step-2 and trains to step 5: exit 0. The advice judges each checkpoint's weights, not only its
    age."""
    from tests.safety.runs import finish, start_train

    run_dir, data = tmp_path / "run", write_dataset(tmp_path / "data")

    def train(lr: float, max_steps: int, *extra: str) -> tuple[int, str]:
        profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, data, run_dir, max_steps=max_steps,
                                save_every_steps=1, keep_checkpoints=0, lr=lr)
        return finish(start_train(profile, run_dir, *extra))

    assert train(1e-2, 2)[0] == 0
    code, out = train(1e30, 5, "--resume")
    assert code == 4, out
    assert "train.lr = 1e+30 from step 3 on (the checkpoint was trained at 0.01;" in out
    [line] = error_lines(out)
    assert ": step 4: the loss is nan" in line and checkpoint_steps(run_dir) == ["step-1", "step-2", "step-3"]
    assert ("once the key named is changed, the last complete checkpoint the run can train from is step-2: continue "
            "from it with --resume (it skips step-3: its weights cannot train: their RMS is ") in line, line
    code, out = train(1e-2, 5, "--resume")
    assert code == 0, out
    assert "skipped step-3: its weights cannot train: their RMS is " in out
    assert "resuming from step-2, the newest whole checkpoint whose weights can train" in out
    assert f"resumed from {run_dir / 'train' / 'checkpoints' / 'step-2'} (step 2)" in out
    assert sorted(metrics_lines(run_dir)) == [1, 2, 3, 4, 5] and all(math.isfinite(line["loss"]) for line in metrics_lines(run_dir).values())


@pytest.mark.parametrize("rms, initial, wrecked", [
    (0.11, 0.108, False), (2.5, 0.108, False), (5.39, 0.108, False), (5.41, 0.108, True), (1e30, 0.108, True),
    (math.nan, 0.108, True), (math.inf, 0.108, True), (3.0, 0.0, False),
])
def test_a_checkpoint_is_wrecked_past_50_times_the_runs_initial_weights_rms(rms, initial, wrecked):
    """The rule's bound: the healthy runs measured stay within 1.1 x (24 x at lr 1.0, still learning), the
    wrecked ones start at 93 x; not finite is wrecked; without an initial RMS only finiteness is judged."""
    from dflash.train.supervisor.resume import WeightsRecord

    assert WeightsRecord(rms, initial, None).wrecked() is wrecked


def rows_with_late_answers(path: Path, seed: int, global_batch: int) -> Path:
    """8 rows whose trained tokens start at position 20, except one that starts at 2 and falls in the
    first step of epoch 0 (TrainData's order for `seed`): at data.max_length 12 only step 1 has a block."""
    from dflash.data.dataset_io import save_token_rows

    first_step = set(np.random.default_rng([seed, 0]).permutation(8)[:global_batch].tolist())
    early = min(first_step)
    rows = [([1000 + j for j in range(40)], [0] * (2 if row == early else 20) + [1] * (38 if row == early else 20))
            for row in range(8)]
    return save_token_rows(path, rows)


def metrics_lines(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    return {line["step"]: line for line in map(json.loads, lines)}


def late_answer_profile(tmp_path: Path, target: Path, **train: object) -> tuple[Path, Path]:
    """data.max_length = 12 cuts seven of the eight rows before their first trained pair; with seed 0 the
    steps' rows hold a supervised position at steps 1, 4, 5, 8 and none at 2, 3, 6, 7 (rows_with_late_answers)."""
    run_dir = tmp_path / "run"
    data = rows_with_late_answers(tmp_path / "data", seed=0, global_batch=4)
    profile = with_data(write_profile(tmp_path / "p.toml", target, data, run_dir, save_every_steps=1, seed=0, **train),
                        max_length=12, min_loss_tokens=1)
    return profile, run_dir


@pytest.mark.slow
def test_steps_without_a_supervised_position_are_skipped_and_counted(tmp_path, tiny_qwen3_target):
    """Steps 2 and 3 have no supervised position (loss weight 0 on every rank): fewer than
    train.max_skipped_steps, so they do not stop the run; both are skipped on every rank alike (no forward, no update:
    their checkpoints hold step 1's weights, which AdamW's momentum would have moved), counted in
    metrics.jsonl, the manifest and the launcher's last line, and step 4 trains: exit 0."""
    from dflash.drafter.checkpoint_files import read_weights
    from tests.safety.runs import finish, start_train

    profile, run_dir = late_answer_profile(tmp_path, tiny_qwen3_target, max_steps=4, keep_checkpoints=0)
    code, out = finish(start_train(profile, run_dir))
    assert code == 0, out
    lines = metrics_lines(run_dir)
    assert [step for step, line in lines.items() if line.get("skipped")] == [2, 3]
    assert [lines[step]["skipped_steps"] for step in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert lines[2]["loss"] is None and lines[4]["loss"] > 0 and lines[1]["loss"] > 0
    assert "step 2: skipped, no supervised position in its 4 rows (loss weight 0; 1 in a row, train.max_skipped_steps = 8; " \
           "1 in this run); the profile decides it: data.max_length = 12 cuts" in out, out
    assert "step 3: skipped, no supervised position in its 4 rows (loss weight 0; 2 in a row" in out
    assert f"train: 2 step(s) skipped without a supervised position (no update; \"skipped\": true in " \
           f"{run_dir / 'train' / 'metrics.jsonl'}" in out
    assert ended(run_dir)["state"] == "done" and ended(run_dir)["skipped_steps"] == 2
    weights = {step: read_weights(run_dir / "train" / "checkpoints" / f"step-{step}") for step in (1, 2, 3, 4)}
    for step in (2, 3):
        assert all(bool((weights[step][name] == tensor).all()) for name, tensor in weights[1].items()), step
    assert any(not bool((weights[4][name] == tensor).all()) for name, tensor in weights[1].items())


@pytest.mark.slow
def test_more_steps_without_a_supervised_position_in_a_row_than_the_bound_stop_the_run(tmp_path, tiny_qwen3_target):
    """train.max_skipped_steps = 1: step 2 is skipped, step 3 is the second in a row and stops the run on every
    rank: exit 4 naming both steps, the bound and data.max_length with the position of the rows' first trained
    pair; no checkpoint of step 3, step-2 (step 1's weights) stays `latest`."""
    from tests.safety.runs import finish, start_train

    profile, run_dir = late_answer_profile(tmp_path, tiny_qwen3_target, max_steps=8, max_skipped_steps=1)
    code, out = finish(start_train(profile, run_dir))
    assert code == 4, out
    [line] = error_lines(out)
    assert ("steps 2..3 (2 in a row) trained on nothing: no supervised position in each one's 4 rows (loss weight 0); "
            "the profile decides it: data.max_length = 12 cuts each of rank ") in line, out
    assert "(the earliest at position 20)" in line and "at least 22" in line and "Traceback" not in out
    assert "The run stopped before saving (train.max_skipped_steps = 1 skipped in a row at most)" in line
    assert checkpoint_steps(run_dir) == ["step-1", "step-2"] and ended(run_dir)["ended_by"] == "loss unusable"
    assert metrics_lines(run_dir)[2]["skipped"] is True and 3 not in metrics_lines(run_dir)
    assert ended(run_dir)["skipped_steps"] == 1


def test_data_max_length_below_every_rows_first_trained_pair_is_refused_before_launch(cli, tmp_path, tiny_qwen3_target,
                                                                                        private_cache):
    """The issue's run: data.max_length = 2 on a dataset whose rows' answers start at 5..14: no row of any
    step can hold a block. Refused before any rank starts, naming the key, the earliest position and the
    length to set; nothing of a run is written."""
    run_dir = tmp_path / "run"
    profile = with_data(write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data"), run_dir),
                        max_length=2, min_loss_tokens=0)
    result = cli("train", "--profile", profile, "--skip-preflight")
    assert result.code == 2, result.err
    assert f"{profile}: key 'data.max_length': 2 cuts every row of the dataset {tmp_path / 'data'} (32 rows of up to" in result.err
    assert "before its first two consecutive trained tokens (the earliest at position 5)" in result.err
    assert "at least 7" in result.err and "Traceback" not in result.err
    assert not (run_dir / "train").exists()


def test_a_dataset_without_two_consecutive_trained_tokens_is_refused_before_launch(tmp_path, tiny_qwen3_target):
    """No row holds a block at any max_length: the data's problem (DataError, exit 4), not a key's."""
    from dflash.data.dataset_io import save_token_rows
    from dflash.train.supervisor.launch_checks import validate_profile_for_launch
    from launcher_core.errors import EXIT_DATA, DataError
    from launcher_core.profile import load_profile

    data = save_token_rows(tmp_path / "data", [([1000 + j for j in range(30)], [0, 1] * 15) for _ in range(8)])
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, data, tmp_path / "run")
    with pytest.raises(DataError) as refused:
        validate_profile_for_launch(load_profile(str(profile)), source=str(profile))
    assert refused.value.exit_code == EXIT_DATA
    assert str(refused.value).startswith(f"{data}: none of its 8 rows has two consecutive trained tokens")


@pytest.mark.parametrize("scan_rows", [256, 2])
def test_the_launch_check_reads_rows_until_one_holds_a_block(tmp_path, monkeypatch, scan_rows):
    """A late first pair is found at a max_length that reaches it, not below; the same whether the rows
    are read in one slice or across slices of a record batch."""
    from dflash.data.dataset_io import save_token_rows
    from dflash.train.supervisor import launch_checks
    from dflash.train.supervisor.launch_checks import AnchorScan, anchors_within

    monkeypatch.setattr(launch_checks, "SCAN_ROWS", scan_rows)

    data = save_token_rows(tmp_path / "d", [([7] * 30, [0] * 25 + [1] * 5), ([7] * 6, [0] * 6), ([7] * 12, [0] * 9 + [1] * 3)])
    assert anchors_within(data, 11).usable and not anchors_within(data, 10).usable
    assert anchors_within(data, 10) == AnchorScan(usable=False, rows=3, longest=30, earliest=9)
    assert anchors_within(tmp_path / "missing", 10) is None


@pytest.mark.parametrize("masks, max_length, cause", [
    ([[0, 1, 0, 1], [0, 0, 0]], 512, "the data decides it: none of rank 1's 2 row(s) of 3..4 tokens has two consecutive trained tokens"),
    ([[0] * 20 + [1] * 5, [0] * 30 + [1] * 5], 16, "the profile decides it: data.max_length = 16 cuts each of rank 1's row(s) of "
                                                   "25..35 tokens before its first two consecutive trained tokens (the earliest at position 20)"),
    ([[0, 1, 1, 1]], 512, "the profile decides it: drafter.draft_vocab_size = 64 leaves every trained label"),
])
def test_the_cause_of_a_step_without_supervision_is_named(masks, max_length, cause):
    from dflash.train.rank.loss_check import supervision_cause

    assert supervision_cause(masks, max_length, 64, rank=1).startswith(cause)


def test_a_finite_step_passes_and_a_non_finite_gradient_norm_alone_stops_it():
    """The loss may still be finite when the gradients overflow: the norm stops the run as well."""
    from types import SimpleNamespace

    from dflash.train.rank.loss_check import UnusableLoss, check_step
    from dflash.train.rank.step import StepStats
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    state = SimpleNamespace(step=3)
    stats = StepStats(loss=2.5, acc=[], sim_tau=1.0, tokens=10, weight_sum=4.0, seconds=0.1, grad_norm=1.5)
    check_step(state, stats, profile)
    stats.grad_norm = math.inf
    with pytest.raises(UnusableLoss) as stopped:
        check_step(state, stats, profile)
    assert stopped.value.exit_code == 4
    assert str(stopped.value).startswith("step 3: the loss is 2.5 and the gradient norm inf, not finite")
    assert "train.lr = 0.002 too high" in str(stopped.value) and "this run computes in float32" in str(stopped.value)
