"""Checkpoints on a GPU (unproven until a GPU machine runs it): train.async_save with the ranks' process group on
NCCL, the save's own on gloo, the shards staged from GPU memory to the host (DCP's default stager) and written
while the rank trains on; then the same run synchronously. Each intermediate checkpoint is whole and holds no
model.safetensors, its weights read from the shards equal what the resumed run starts from, and the last one's
model.safetensors equals its shards. Figures: the time the rank stood still per save, async vs sync."""
from __future__ import annotations

import json
import statistics

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
STEPS, EVERY = 12, 3
WIDE = {"num_layers": 2, "target_layer_ids": [1, 2], "num_attention_heads": 64, "num_key_value_heads": 64,
        "head_dim": 128}


def stood_still(run_dir) -> list[float]:
    times = {line["step"]: line["time"] for line in map(json.loads, (run_dir / "train" / "metrics.jsonl").open())}
    gaps = {step: times[step + 1] - times[step] for step in times if step + 1 in times}
    others = statistics.median(gap for step, gap in gaps.items() if step % EVERY)
    return [gap - others for step, gap in gaps.items() if step % EVERY == 0]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_checkpoints_on_a_gpu_are_whole_and_their_weights_are_the_shards(asynchronous, record, tmp_path,
                                                                         tiny_qwen3_target, tiny_dataset):
    import torch

    from dflash.drafter.checkpoint_files import WEIGHTS, read_sharded_weights, read_weights
    from dflash.drafter.verify import verify_checkpoint
    from dflash.train.supervisor.launch import run_training
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    run_dir = tmp_path / "run"
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, run_dir,
                                             machine={"nproc_per_node": 1, "device": "cuda", "backend": "nccl",
                                                      "gpu_count": 1},
                                             max_steps=STEPS, save_every_steps=EVERY, async_save=asynchronous,
                                             keep_checkpoints=0, drafter=WIDE)))     # each checkpoint read below
    assert run_training(profile, run_dir=run_dir) == 0
    checkpoints = run_dir / "train" / "checkpoints"
    for step in range(EVERY, STEPS, EVERY):
        folder = checkpoints / f"step-{step}"
        assert verify_checkpoint(folder) == [] and not (folder / WEIGHTS).exists(), step
    last = checkpoints / f"step-{STEPS}"
    whole, sharded = read_weights(last), read_sharded_weights(last / "dcp")
    assert all(torch.equal(whole[name], sharded[name]) for name in whole)
    stalls = stood_still(run_dir)
    mode = "async" if asynchronous else "sync"
    record.figure(**{f"{mode}_stood_still_per_save_s": round(statistics.median(stalls), 4)})
    record.check(f"{mode} checkpoints whole", True, f"{len(stalls)} saves; stood still {statistics.median(stalls):.3f} s each")
    record.save()
