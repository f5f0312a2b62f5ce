"""Rows 5, 6, 11 and 19 of the safety table: export never writes over a folder it did not make or
over its own checkpoint; damaged checkpoints and targets are exit 2 naming the file; training
state loads without unpickling arbitrary objects (old checkpoints still load)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dflash.drafter.checkpoint_files import STATE, load_training_state, save_checkpoint
from launcher_core.errors import InputError
from tests.safety.conftest import tree_digest
from tests.train.test_export import make_drafter

pytestmark = pytest.mark.usefixtures("private_cache")  # crash reports go to a per-test cache


@pytest.fixture
def checkpoint(tmp_path, tiny_target_model) -> Path:
    drafter = make_drafter(tiny_target_model)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    drafter.fc.weight.sum().backward()            # a real step: AdamW then holds exp_avg tensors
    optimizer.step()
    scheduler.step()
    return save_checkpoint(tmp_path / "run", drafter, 3, {"optimizer": optimizer.state_dict(),
                                                         "scheduler": scheduler.state_dict(), "micro_batch": 2})


def test_export_refuses_a_users_folder(cli, checkpoint, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    before = tree_digest(folder)
    result = cli("export", checkpoint, "--for", "vllm", "-o", folder, "--force")
    assert result.code == 2 and f"-o {folder} is an existing folder that is not a drafter export" in result.err
    assert tree_digest(folder) == before


def test_export_refuses_its_own_checkpoint_and_keeps_resume_possible(cli, checkpoint):
    before = tree_digest(checkpoint)
    for output in (checkpoint, checkpoint.parent):
        result = cli("export", checkpoint, "--for", "vllm", "-o", output)
        assert result.code == 2 and "choose a new path" in result.err
    assert tree_digest(checkpoint) == before and (checkpoint / STATE).exists()


def test_export_replaces_an_export_only_with_force(cli, checkpoint, tmp_path):
    out = tmp_path / "exported"
    assert cli("export", checkpoint, "--for", "vllm", "-o", out).code == 0
    again = cli("export", checkpoint, "--for", "sglang", "-o", out)
    assert again.code == 2 and "is an existing drafter export; pass --force" in again.err
    assert cli("export", checkpoint, "--for", "sglang", "-o", out, "--force").code == 0


@pytest.mark.parametrize("damage", ["truncated_weights", "garbage_config", "config_list"])
def test_export_of_a_damaged_checkpoint_names_the_file(cli, checkpoint, tmp_path, damage):
    broken_ckpt = tmp_path / "broken"
    shutil.copytree(checkpoint, broken_ckpt)
    broken = broken_ckpt / ("model.safetensors" if damage == "truncated_weights" else "config.json")
    if damage == "truncated_weights":
        broken.write_bytes(broken.read_bytes()[:200])
    else:
        broken.write_text("{oops" if damage == "garbage_config" else "[]")
    result = cli("export", broken_ckpt, "--for", "vllm", "-o", tmp_path / "out")
    assert result.code == 2 and f"{broken}" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated_weights", "garbage_config"])
def test_eval_with_a_damaged_target_names_the_file(cli, checkpoint, tmp_path, tiny_qwen3_target, damage):
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3_target, target)
    broken = target / ("model.safetensors" if damage == "truncated_weights" else "config.json")
    if damage == "truncated_weights":
        broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    else:
        broken.write_text("{oops")
    profile = tmp_path / "p.toml"
    profile.write_text(f'extends = "cpu-demo"\n[model]\ntarget = "{target}"\n[paths]\nrun_dir = "{tmp_path / "run"}"\n')
    result = cli("eval", "--profile", profile, "--draft", checkpoint, "--num-prompts", "1")
    assert result.code == 2 and f"{broken}" in result.err and "Traceback" not in result.err


def test_training_state_round_trips_without_pickle(checkpoint):
    state = load_training_state(checkpoint)
    assert state["step"] == 3 and state["micro_batch"] == 2
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3)
    assert "last_epoch" in state["scheduler"]


def test_a_training_state_holding_an_arbitrary_object_is_refused(checkpoint):
    torch.save({"step": 1, "payload": Path("/")}, checkpoint / STATE)   # unpickling it would run a class
    with pytest.raises(InputError, match="not a training state this trainer loads safely"):
        load_training_state(checkpoint)



def test_export_of_a_checkpoints_folder_writes_next_to_its_latest(cli, checkpoint):
    before = tree_digest(checkpoint)
    result = cli("export", checkpoint.parent, "--for", "vllm")
    assert result.code == 0, result.err
    assert (checkpoint.parent / f"{checkpoint.name}-vllm" / "config.json").exists()
    assert tree_digest(checkpoint) == before


def test_a_garbage_latest_pointer_is_named_and_resume_replaces_it(cli, checkpoint):
    """`latest` holding binary garbage (or a path): eval and export are exit 2 naming the pointer, not a
    traceback, and the resume's choice says so and points it at the newest whole checkpoint."""
    from dflash.drafter.checkpoint_files import LATEST, latest_checkpoint, read_pointer
    from dflash.train.supervisor.resume import choose_checkpoint

    pointer = checkpoint.parent / LATEST
    for garbage in (b"\xff\xfe\x00garbage\x80", b"../../etc\n", b"\n"):
        pointer.write_bytes(garbage)
        with pytest.raises(InputError, match="not a checkpoint pointer"):
            latest_checkpoint(checkpoint.parent.parent.parent)
        result = cli("export", checkpoint.parent, "--for", "vllm")
        assert result.code == 2 and f"{pointer}: not a checkpoint pointer" in result.err, result.err
    state = load_training_state(checkpoint)
    torch.save({**state, "total_steps": 10}, checkpoint / STATE)       # what a training run's state holds
    said: list[str] = []
    assert choose_checkpoint(checkpoint.parent, said.append) == checkpoint
    assert said == [f"{pointer}: not a checkpoint pointer (it should hold one name, e.g. step-500); remove it or write "
                    "the step to use into it (`train --resume` points it at the newest whole checkpoint): replaced by "
                    "the newest whole checkpoint"]
    assert read_pointer(pointer) == checkpoint.name
