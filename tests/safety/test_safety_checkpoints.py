"""Resume from damage (issue rows "resume when the latest checkpoint is damaged / of another shape",
"drafter.init_from of another shape", "eval --draft against another target"): what is wrong with a
checkpoint is found from its files before any rank loads the target, a damaged latest falls back to
the newest whole one, and a drafter of another shape is refused before torchrun starts (exit 2,
every difference listed), nothing changed on disk. Checkpoints here are real ones: the profile's
drafter built as the ranks build it, saved by the trainer's own save_checkpoint; the dcp/ part by a
real torch.distributed.checkpoint save (one process: DCP needs no process group)."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash.drafter.verify import dcp_problems, verify_checkpoint
from tests.safety.conftest import save_real_checkpoint, tree_digest
from tests.train.conftest import write_dataset, write_profile


@dataclass(frozen=True)
class Setup:
    target: Path
    dataset: Path
    profile: Path            # the run's profile
    wider: Path              # another drafter shape (wider attention) and block size
    source: Path             # a run directory with step-1 and step-2 of `profile` (latest -> step-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen3_target) -> Setup:
    root = tmp_path_factory.mktemp("ckpt")
    dataset = write_dataset(root / "dataset", rows=8)
    profile = write_profile(root / "p.toml", tiny_qwen3_target, dataset, root / "run", max_steps=10)
    wider = write_profile(root / "wide.toml", tiny_qwen3_target, dataset, root / "run", max_steps=10,
                          drafter={"num_attention_heads": 8, "head_dim": 16, "block_size": 8})
    for step in (1, 2):
        save_real_checkpoint(profile, root / "source", step)
    return Setup(tiny_qwen3_target, dataset, profile, wider, root / "source")


def fresh_run(setup: Setup, tmp_path: Path) -> Path:
    """A copy of the run with its two whole checkpoints (step-1, step-2; latest -> step-2)."""
    import shutil

    shutil.copytree(setup.source, tmp_path / "run")
    return tmp_path / "run"


def checkpoints(run_dir: Path) -> Path:
    return run_dir / "train" / "checkpoints"


def test_a_whole_checkpoint_has_no_problems(setup, tmp_path):
    run_dir = fresh_run(setup, tmp_path)
    assert verify_checkpoint(checkpoints(run_dir) / "step-2") == []       # the control the damage tests fail


def test_truncated_weights_are_found_from_the_header(setup, tmp_path):
    weights = checkpoints(fresh_run(setup, tmp_path)) / "step-2" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 1000])
    problems = verify_checkpoint(weights.parent)
    assert len(problems) == 1 and f"{weights}: truncated: its header describes" in problems[0]
    assert f"the file holds {size - 1000 - 8 - struct.unpack('<Q', weights.read_bytes()[:8])[0]:,}" in problems[0]


def test_a_garbage_header_and_a_stub_file_are_named(setup, tmp_path):
    weights = checkpoints(fresh_run(setup, tmp_path)) / "step-2" / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    assert "its header claims 1,000,000,000 bytes" in verify_checkpoint(weights.parent)[0]
    weights.write_bytes(b"abc")
    assert "shorter than a safetensors header (truncated)" in verify_checkpoint(weights.parent)[0]
    weights.write_bytes(struct.pack("<Q", 4) + b"[1,2")
    assert "the header is not JSON" in verify_checkpoint(weights.parent)[0]


def test_a_garbage_training_state_is_named_and_the_step_must_match(setup, tmp_path):
    import torch

    state = checkpoints(fresh_run(setup, tmp_path)) / "step-2" / "training_state.pt"
    good = torch.load(state, weights_only=True)
    state.write_bytes(b"\x00garbage" * 100)
    problems = verify_checkpoint(state.parent)
    assert len(problems) == 1 and f"{state}: torch cannot read it as a training state" in problems[0]
    torch.save({**good, "step": 7}, state)
    assert verify_checkpoint(state.parent) == [f"{state}: holds step 7, its directory says step 2"]
    torch.save({key: value for key, value in good.items() if key != "scheduler"}, state)
    assert verify_checkpoint(state.parent) == [f"{state}: no `scheduler`"]


def test_a_dcp_directory_is_read_through_its_metadata(tmp_path):
    """A real torch.distributed.checkpoint save (one process), whole, then damaged three ways."""
    import torch
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.randn(64, 64)}, "optimizer": {"m": torch.randn(256)}}, checkpoint_id=str(directory))
    assert dcp_problems(directory) == []
    shard = next(directory.glob("*.distcp"))
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    assert any(f"{shard}: {len(whole) // 2:,} bytes" in p and "(truncated)" in p for p in dcp_problems(directory))
    shard.unlink()
    assert any(f"{shard}: missing" in p for p in dcp_problems(directory))
    shard.write_bytes(whole)
    (directory / ".metadata").write_bytes(b"not a pickle")
    assert "its metadata (.metadata) cannot be read" in dcp_problems(directory)[0]


def test_verify_checkpoint_reads_the_dcp_beside_the_weights(setup, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    step = checkpoints(fresh_run(setup, tmp_path)) / "step-2"
    state = torch.load(step / "training_state.pt", weights_only=True)
    torch.save({key: value for key, value in state.items() if key != "optimizer"}, step / "training_state.pt")
    assert "no optimizer state" in verify_checkpoint(step)[0]       # neither in the state nor in dcp/
    dcp.save({"optimizer": {"m": torch.randn(128)}}, checkpoint_id=str(step / "dcp"))
    assert verify_checkpoint(step) == []
    shard = next((step / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert len(verify_checkpoint(step)) == 1 and "(truncated)" in verify_checkpoint(step)[0]


def test_the_newest_whole_checkpoint_is_chosen_and_latest_points_at_it(setup, tmp_path):
    from dflash.train.supervisor.resume import choose_checkpoint

    run_dir = fresh_run(setup, tmp_path)
    (checkpoints(run_dir) / "step-2" / "training_state.pt").write_bytes(b"garbage")
    said: list[str] = []
    assert choose_checkpoint(checkpoints(run_dir), said.append) == checkpoints(run_dir) / "step-1"
    assert (checkpoints(run_dir) / "latest").read_text() == "step-1\n"
    assert said[0].startswith("skipped step-2: damaged:") and "training_state.pt: torch cannot read it" in said[0]
    assert said[1].startswith("resuming from step-1, the newest whole checkpoint")
    assert (checkpoints(run_dir) / "step-2").is_dir()                  # left where it is: nothing deleted


def test_a_latest_naming_a_missing_or_older_step_is_repointed_and_said(cli, setup, tmp_path):
    """`latest` naming a step that is not there (deleted, or the pointer edited): `train --resume` says in one
    line what it named and what it names now, rather than repointing it silently; the same for an older whole
    step. Driven through the CLI up to the shape check (the wider profile's drafter is refused, exit 2, after
    the choice), so no rank starts."""
    from dflash.train.supervisor.resume import choose_checkpoint

    run_dir = fresh_run(setup, tmp_path)
    pointer = checkpoints(run_dir) / "latest"
    pointer.write_text("step-40\n")
    result = train_cli(cli, setup.wider, run_dir, "--resume")
    assert result.code == 2 and "holds a drafter of another shape" in result.err, result.err
    assert (f"{pointer} named step-40, which does not exist; it now names step-2, the newest whole checkpoint, "
            "which the run resumes") in result.err
    assert pointer.read_text() == "step-2\n"
    pointer.write_text("step-1\n")
    said: list[str] = []
    assert choose_checkpoint(checkpoints(run_dir), said.append) == checkpoints(run_dir) / "step-2"
    assert said == [f"{pointer} named step-1, not the newest whole checkpoint; it now names step-2, the newest "
                    "whole checkpoint, which the run resumes"]
    said.clear()
    assert choose_checkpoint(checkpoints(run_dir), said.append) == checkpoints(run_dir) / "step-2"
    assert said == []                                          # the control: a pointer already right is not said


def test_partial_saves_are_removed_and_said(setup, tmp_path):
    from dflash.train.supervisor.resume import remove_partial_saves

    run_dir = fresh_run(setup, tmp_path)
    partial = checkpoints(run_dir) / ".step-3.k2j4h1.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"x" * 5000)
    old = checkpoints(run_dir) / ".step-2.old-4242"
    old.mkdir()
    keep = checkpoints(run_dir) / ".step-notes"          # not a save's: left alone
    keep.write_text("mine")
    said: list[str] = []
    assert remove_partial_saves(checkpoints(run_dir), said.append) == [old, partial]
    assert not partial.exists() and not old.exists() and keep.exists()
    assert said[1] == f"removed {partial} (5,000 bytes (4.9 KiB)): a partial checkpoint an interrupted save left behind"


def test_a_save_killed_between_its_renames_gets_the_old_checkpoint_back(setup, tmp_path):
    from dflash.train.supervisor.resume import remove_partial_saves

    run_dir = fresh_run(setup, tmp_path)
    step = checkpoints(run_dir) / "step-2"
    before = tree_digest(step)
    step.rename(checkpoints(run_dir) / ".step-2.old-4242")
    said: list[str] = []
    assert remove_partial_saves(checkpoints(run_dir), said.append) == []
    assert tree_digest(step) == before and said[0].startswith(f"restored {step} from .step-2.old-4242")


def train_cli(cli, profile: Path, run_dir: Path, *flags: str):
    return cli("train", "--profile", profile, "--run-dir", run_dir, "--skip-preflight", *flags)


def test_resume_with_every_checkpoint_damaged_is_exit_4_before_torchrun(cli, setup, tmp_path):
    run_dir = fresh_run(setup, tmp_path)
    for step in ("step-1", "step-2"):
        (checkpoints(run_dir) / step / "training_state.pt").write_bytes(b"garbage")
    before = tree_digest(run_dir)
    result = train_cli(cli, setup.profile, run_dir, "--resume")
    assert result.code == 4, result.err
    assert f"error: no checkpoint under {checkpoints(run_dir)} can be resumed:" in result.err
    assert "skipped step-2: damaged:" in result.err and "skipped step-1: damaged:" in result.err
    assert "train without --resume to start over" in result.err and "Traceback" not in result.err
    assert not (run_dir / "train" / "logs").exists() and not (run_dir / "train" / "ranks").exists()
    assert {k: v for k, v in tree_digest(run_dir).items() if k != ".run.lock"} == before


def test_resume_with_a_drafter_of_another_shape_is_exit_2_listing_the_differences(cli, setup, tmp_path):
    run_dir = fresh_run(setup, tmp_path)
    before = tree_digest(run_dir)
    result = train_cli(cli, setup.wider, run_dir, "--resume")
    assert result.code == 2, result.err
    assert f"error: --resume: {checkpoints(run_dir) / 'step-2'} holds a drafter of another shape" in result.err
    assert "layers.0.self_attn.q_proj.weight: (64, 64) there, (128, 64) in the profile's drafter" in result.err
    assert "dflash_config.block_size: 4 there, 8 in the profile" in result.err
    assert not (run_dir / "train" / "logs").exists() and "Traceback" not in result.err
    assert {k: v for k, v in tree_digest(run_dir).items() if k != ".run.lock"} == before


def test_the_profile_a_checkpoint_was_trained_with_fits_it(setup, tmp_path):
    """The control of the shape refusal: the same check passes the checkpoint's own profile."""
    from dflash.train.supervisor.launch_checks import validate_profile_for_launch
    from dflash.train.supervisor.resume import prepare_checkpoints
    from launcher_core.profile import load_profile

    run_dir = fresh_run(setup, tmp_path)
    profile = load_profile(str(setup.profile))
    chosen = prepare_checkpoints(profile, validate_profile_for_launch(profile), run_dir, resume=True, log=print)
    assert chosen == checkpoints(run_dir) / "step-2"


def test_init_from_a_drafter_of_another_shape_is_exit_2_before_torchrun(cli, setup, tmp_path):
    source = checkpoints(setup.source) / "step-1"
    profile = write_profile(tmp_path / "init.toml", setup.target, setup.dataset, tmp_path / "run",
                            drafter={"init": "drafter", "init_from": str(source), "num_attention_heads": 8, "head_dim": 16})
    result = train_cli(cli, profile, tmp_path / "run")
    assert result.code == 2, result.err
    assert f"error: drafter.init_from {source}: does not fit profile init's drafter" in result.err
    assert "layers.0.self_attn.q_proj.weight:" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "run" / "train" / "logs").exists()


def test_eval_of_a_drafter_for_another_target_is_exit_2(cli, setup, tmp_path, qwen3_tokenizer_dir):
    from dflash.target_model import build_tiny_target

    other = build_tiny_target(tmp_path / "other", qwen3_tokenizer_dir, hidden=96, layers=8)
    profile = write_profile(tmp_path / "other.toml", other, setup.dataset, tmp_path / "run",
                            drafter={"target_layer_ids": [6]})
    drafter = save_real_checkpoint(profile, tmp_path / "other-run", 1)
    result = cli("eval", "--profile", setup.profile, "--draft", drafter, "--run-dir", tmp_path / "eval-run")
    assert result.code == 2, result.err
    assert f"error: --draft {drafter}: this drafter was trained for another target" in result.err
    assert "hidden_size 96 in the drafter, 64 in the target" in result.err
    assert "trained on a target of 8 layers, this one has 4" in result.err
    assert "tap layers [6] are not all inside the target's layers 0..3" in result.err
    assert not (tmp_path / "eval-run").exists() and "Traceback" not in result.err
