"""train.async_save under a kill, on 2 real gloo ranks: the ranks train on while a checkpoint's shards are
written, and a SIGKILL of the whole run while they are being written leaves `latest` on the previous
whole checkpoint; `--resume` removes the partial save, resumes from that checkpoint and finishes. The
intermediate checkpoints hold no model.safetensors: their weights are read from the DCP shards on demand,
and the last checkpoint's model.safetensors holds exactly what its shards hold.

The save_every_minutes run needs nothing from its test while it runs: it starts with the module, beside the
kill drill. The drafter proposes from the data's 50 tokens (DATA_VOCAB: a cheap head; the saves' shards and
their timing do not depend on the head's width)."""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.drafter.checkpoint_files import CONFIG, DCP_DIR, STATE, TRAINING_DATA, WEIGHTS, init_from_drafter, load_drafter, read_sharded_weights, read_weights
from dflash.drafter.verify import verify_checkpoint
from dflash.train.supervisor.resume import remove_partial_saves
from tests.safety.runs import finish, kill_session, metrics_steps, start_train, wait_for, wait_for_ranks, wait_for_save, wait_until_gone
from tests.train.conftest import DATA_VOCAB, write_dataset, write_profile

pytestmark = pytest.mark.slow
STEPS = 8
# ~50 MB a checkpoint (wide attention on the tiny target): a write the kill can land in.
WIDE_DRAFTER = {"num_layers": 2, "target_layer_ids": [1, 2], "num_attention_heads": 32, "num_key_value_heads": 32,
                "head_dim": 128, **DATA_VOCAB}
MINUTES_STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def minutes_run(tmp_path_factory, tiny_qwen3_target):
    """train.save_every_minutes = 0.005 (0.3 s) with the step interval out of reach (1,000 of 10 steps),
    started with the module: (profile, run dir, launcher process)."""
    root = tmp_path_factory.mktemp("minutes")
    run_dir = root / "run"
    profile = write_profile(root / "p.toml", tiny_qwen3_target, write_dataset(root / "dataset"), run_dir,
                            max_steps=MINUTES_STEPS, save_every_steps=1000, save_every_minutes=0.005, drafter=DATA_VOCAB)
    process = start_train(profile, run_dir)
    yield profile, run_dir, process
    kill_session(process)


def checkpoints(run_dir: Path) -> Path:
    return run_dir / "train" / "checkpoints"


def latest(run_dir: Path) -> str:
    return (checkpoints(run_dir) / "latest").read_text().strip()


def test_a_kill_during_an_async_save_leaves_latest_whole_and_resume_finishes(tmp_path, tiny_qwen3_target):
    run_dir = tmp_path / "run"
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "dataset"), run_dir,
                            max_steps=STEPS, save_every_steps=2, keep_checkpoints=0, drafter=WIDE_DRAFTER)
    process = start_train(profile, run_dir)                     # every checkpoint kept: each is read below
    wait_for_ranks(run_dir)
    staging = wait_for_save(checkpoints(run_dir), 4)
    wait_for(lambda: (checkpoints(run_dir) / staging / DCP_DIR).is_dir(), 60, "the shards' folder")
    kill_session(process)                                     # the whole run, SIGKILL, while step 4's shards are written
    assert wait_until_gone(run_dir) == []
    assert (checkpoints(run_dir) / staging).is_dir() and not (checkpoints(run_dir) / "step-4").exists(), \
        "the kill did not land inside step 4's save"
    assert latest(run_dir) == "step-2" and verify_checkpoint(checkpoints(run_dir) / "step-2") == []
    assert not (checkpoints(run_dir) / "step-2" / WEIGHTS).exists()             # an intermediate checkpoint
    written = verify_checkpoint(checkpoints(run_dir) / staging) == []           # every shard and the metadata there

    code, out = finish(start_train(profile, run_dir, "--resume"))
    assert code == 0, out
    if written:           # the kill came after the last shard: the launcher puts the whole save in place
        assert f"put {checkpoints(run_dir)}/step-4 in place from {staging}" in out and "(step 4)" in out
    else:
        assert f"removed {checkpoints(run_dir)}/{staging}" in out and "resumed from" in out and "(step 2)" in out
    assert "the ranks trained 1 step(s) while its shards were written (train.async_save)" in out
    assert metrics_steps(run_dir) == list(range(1, STEPS + 1)) and latest(run_dir) == f"step-{STEPS}"
    assert not list(checkpoints(run_dir).glob(".step-*"))
    for step in (2, 4, 6):
        folder = checkpoints(run_dir) / f"step-{step}"
        assert sorted(p.name for p in folder.iterdir()) == sorted([CONFIG, STATE, TRAINING_DATA, DCP_DIR])
        assert verify_checkpoint(folder) == []
    last = checkpoints(run_dir) / f"step-{STEPS}"
    whole, sharded = read_weights(last), read_sharded_weights(last / DCP_DIR)
    assert sorted(whole) == sorted(sharded) and all(torch.equal(whole[k], sharded[k]) for k in whole)
    assert not all(torch.equal(read_weights(checkpoints(run_dir) / "step-6")[k], whole[k]) for k in whole)
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True)
    drafter = load_drafter(checkpoints(run_dir) / "step-6", target)          # eval's loader, from the shards
    assert init_from_drafter(drafter, checkpoints(run_dir) / "step-4").name == "step-4"   # drafter.init_from, too
    step_4 = read_sharded_weights(checkpoints(run_dir) / "step-4" / DCP_DIR)
    assert all(torch.equal(value, step_4[name]) for name, value in drafter.state_dict().items() if name in step_4)

    # a whole save left under its staging name is put in place; a damaged one is removed
    step_6 = checkpoints(run_dir) / "step-6"
    step_6.rename(checkpoints(run_dir) / ".step-6.abc.tmp")
    shutil.copytree(checkpoints(run_dir) / "step-4", checkpoints(run_dir) / ".step-5.def.tmp")
    shard = checkpoints(run_dir) / ".step-5.def.tmp" / DCP_DIR / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    lines: list[str] = []
    assert remove_partial_saves(checkpoints(run_dir), lines.append) == [checkpoints(run_dir) / ".step-5.def.tmp"]
    assert verify_checkpoint(step_6) == [] and not (checkpoints(run_dir) / "step-5").exists()
    assert lines[0].startswith(f"removed {checkpoints(run_dir)}/.step-5.def.tmp") and lines[1].startswith(f"put {step_6} in place")


def test_a_stop_by_sigterm_saves_synchronously_after_the_pending_save(tmp_path, tiny_qwen3_target):
    run_dir = tmp_path / "run"
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "dataset"), run_dir,
                            max_steps=200, save_every_steps=2, drafter=DATA_VOCAB)
    process = start_train(profile, run_dir)
    wait_for_ranks(run_dir)
    wait_for_save(checkpoints(run_dir), 4)
    process.send_signal(signal.SIGTERM)
    code, out = finish(process)
    assert code == 130, out                                   # interrupted, its checkpoint saved
    stopped = int(latest(run_dir).split("-")[1])
    assert stopped >= 4 and f"stopped by SIGTERM after step {stopped}" in out
    assert "step-4 in place after" in out                     # the pending save was put in place first
    assert verify_checkpoint(checkpoints(run_dir) / f"step-{stopped}") == []
    assert not list(checkpoints(run_dir).glob(".step-*"))


def test_save_every_minutes_saves_off_the_step_grid_on_every_rank_alike(minutes_run, tmp_path, tiny_qwen3_target):
    """train.save_every_minutes: with the step interval out of reach (1,000 of 10 steps), checkpoints still come
    once the minutes have passed since the last (0.3 s here); the ranks agree on the clock (all_reduce MAX), so
    every save is a collective all ranks join and the run ends whole. A value below 0 is refused by name."""
    from launcher_core.errors import ConfigError
    from launcher_core.profile import load_profile

    _, run_dir, process = minutes_run
    code, out = finish(process)
    assert code == 0, out
    saved = sorted(int(p.name.split("-")[1]) for p in checkpoints(run_dir).glob("step-*"))
    assert saved[-1] == MINUTES_STEPS and len(saved) >= 3, saved   # the last, and saves off the 1,000-step grid
    assert all(verify_checkpoint(checkpoints(run_dir) / f"step-{step}") == [] for step in saved)
    bad = write_profile(tmp_path / "bad.toml", tiny_qwen3_target, run_dir.parent / "dataset", run_dir, save_every_minutes=-1)
    with pytest.raises(ConfigError, match="train.save_every_minutes"):
        load_profile(str(bad))
