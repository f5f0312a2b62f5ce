"""Measured, not only modelled: the trainer's own step on 2 real gloo ranks with a drafter of more
than 300 MB of parameters sharded by FSDP2, every tensor it allocates counted (the same tracker as
the memory trace, torch's FSDPMemTracker, here on the real CPU tensors), each rank's peak against
the analytic model's prediction for that shape (`dflash.memory.peak_estimate`, what `plan` uses) within 5 %,
AND the gradient reduction measured on its own: what a reduction allocates above what was alive
when it began (its reduce-scatter buffers, a few MiB here) against the model's
`reduction_buffers` within 5 %, so a buffer there cannot hide under the peak's tolerance.

The shape: a random Qwen3 target (hidden 1024, MLP 8192, 2 layers, 4,096-row vocabulary; both
layers are taps) and a 3-layer drafter of its widths, 85 M float32 parameters (340 MB), sharded
over the 2 ranks. Sequences are short, so the step's peak is the optimizer update (the target,
weight and gradient shards, AdamW states over the shards, foreach AdamW's temporary and the last
all-gather's buffer). The checkpoint save is not measured here. Each rank writes its figures to a
file for the parent.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launcher_core.processes import free_port

pytestmark = pytest.mark.slow

HIDDEN, INTERMEDIATE, VOCAB, MASK_ID = 1024, 8192, 4096, 4095
TOLERANCE = 0.05


def write_target(directory: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def write_profile(root: Path, target: Path) -> Path:
    import numpy as np

    from dflash.data.dataset_io import save_token_rows

    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, VOCAB - 1, 64).tolist(), [0] * 8 + [1] * 56) for _ in range(8)]
    dataset = save_token_rows(root / "data", rows)
    path = root / "measured.toml"
    path.write_text("\n".join([
        "[machine]", 'device = "cpu"', 'backend = "gloo"', "nproc_per_node = 2",
        "[model]", f'target = "{target}"', 'dtype = "float32"',
        "[paths]", f'run_dir = "{root / "run"}"', f'dataset = "{dataset}"',
        "[data]", "max_length = 64",
        "[drafter]", "num_layers = 3", "block_size = 4", f"mask_token_id = {MASK_ID}", "target_layer_ids = [0, 1]",
        "[train]", "max_steps = 4", "global_batch = 4", "max_micro_batch = 1", "num_anchors = 8", "decay_gamma = 3.0",
        'attention = "sdpa"']) + "\n")
    return path


def measured_step(state, work) -> dict[str, float]:
    """MiB at the peak of `work()` and the most one gradient reduction allocated above its start,
    every tensor counted: the phase tracker of the memory trace (FSDPMemTracker) on real tensors,
    the reductions marked by the trainer's own observer of FSDP2's reduce-scatter."""
    from dflash.measure import fake
    from dflash.train.rank.parallel import observe_reductions

    tracker = fake.phase_tracker(state.drafter, state.optimizer, frozen=state.target)
    observe_reductions(state.drafter, lambda: setattr(tracker, "phase", "reduction") if tracker.phase != "reduction" else None,
                       lambda: setattr(tracker, "phase", "step"))
    tracker.phase = "step"
    with tracker:
        work()
    return {"peak_mib": max(tracker.phase_peaks.values()) / 2**20,
            "reduction_mib": tracker.phase_rises.get("reduction", 0) / 2**20}


def one_step(state) -> None:
    """The trainer's step (run_step: forward/backward, the gradient sum, clipping, the update)."""
    from dflash.memory.budget import batch_plan
    from dflash.train.rank.step import run_step

    epoch, rows = state.data.step_rows(state.step)
    run_step(state, rows, epoch, batch_plan(state.data.global_batch, state.env.world_size, state.micro_batch))
    state.step += 1


def rank_main(rank: int, port: int, profile_path: str, out: str) -> None:
    import torch
    import torch.distributed

    from dflash.train.rank.parallel import WorkerEnv, close_process_group
    from dflash.train.rank.setup import build_state
    from launcher_core.profile import load_profile

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)   # mp.spawn: rank 0 hosts the store
    profile = load_profile(profile_path)
    state = build_state(profile, Path(profile.paths.run_dir), WorkerEnv.from_env(), resume=False)
    one_step(state)                                     # AdamW states exist after a first update
    figures = measured_step(state, lambda: one_step(state))
    record = {**figures, "micro_batch": state.micro_batch,
              "drafter_params": sum(p.numel() for p in state.drafter.parameters() if p.requires_grad)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    close_process_group()


def test_each_ranks_measured_peak_is_the_models_prediction_within_5_percent(tmp_path):
    import torch.multiprocessing as mp

    from dflash.memory import peak_estimate as memory
    from launcher_core.profile import load_profile

    profile_path = write_profile(tmp_path, write_target(tmp_path / "target"))
    mp.spawn(rank_main, args=(free_port(), str(profile_path), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    profile = load_profile(str(profile_path))
    workload = memory.workload_from_profile(profile, world_size=2)
    assert ranks[0]["drafter_params"] * 4 >= 300e6 and ranks[0]["drafter_params"] == memory.drafter_params(workload)
    estimate = memory.estimate(workload)
    line = memory.estimated_peak_model(workload)
    # the plan's peak_mib(m) without the checkpoint save (not part of a step): the step's moments and the update
    predicted = max(line.step_mib(ranks[0]["micro_batch"]), estimate.update_peak)
    assert estimate.reduction_buffers > 10                                # MiB: a layer's float32 reduce-scatter input
    for rank, figures in enumerate(ranks):
        error = (predicted - figures["peak_mib"]) / figures["peak_mib"]
        assert abs(error) <= TOLERANCE, \
            f"rank {rank}: measured {figures['peak_mib']:.0f} MiB, model {predicted:.0f} MiB ({error:+.1%})"
        error = (estimate.reduction_buffers - figures["reduction_mib"]) / figures["reduction_mib"]
        assert abs(error) <= TOLERANCE, \
            f"rank {rank}: a reduction allocated {figures['reduction_mib']:.1f} MiB, model {estimate.reduction_buffers:.1f}"
