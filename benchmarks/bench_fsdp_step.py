"""Gradient accumulation under FSDP2: reduce-scatter every micro-batch or hold unsharded gradients
until the last one (`train.gradient_sync`), and `train.reshard_after_forward`, measured on 2 real
gloo ranks.

Each setting trains the trainer's own state and step (`build_state`, `run_step`) over 4
micro-batches a rank and step: a random Qwen3 target (hidden 1024, MLP 8192, 2 layers) and a
3-layer drafter of its widths (85 M float32 parameters, sharded over the 2 ranks). Prints per
setting the median step time (wall and CPU, after a warm-up step), each rank's peak of tracked
memory (FSDPMemTracker on the real tensors, as the memory trace counts), and the bytes the ranks
sent through the reduce-scatters per step.

    .venv/bin/python benchmarks/bench_fsdp_step.py [--steps 3]
    .venv/bin/python benchmarks/bench_fsdp_step.py --smoke     (a 1-layer drafter of hidden 256, one step)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = [("every_micro_batch", True), ("last_micro_batch", True), ("every_micro_batch", False)]
VOCAB, MASK_ID = 4096, 4095


def write_workload(root: Path, hidden: int, intermediate: int, layers: int) -> Path:
    """The target, a dataset of 8 rows of 64 tokens, and a profile over them (2 gloo ranks)."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.data.dataset_io import save_token_rows

    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "target")
    rng = np.random.default_rng(0)
    dataset = save_token_rows(root / "data", [(rng.integers(0, VOCAB - 1, 64).tolist(), [0] * 8 + [1] * 56)
                                              for _ in range(8)])
    path = root / "bench.toml"
    path.write_text("\n".join([
        "[machine]", 'device = "cpu"', 'backend = "gloo"', "nproc_per_node = 2",
        "[model]", f'target = "{root / "target"}"', 'dtype = "float32"',
        "[paths]", f'run_dir = "{root / "run"}"', f'dataset = "{dataset}"', "[data]", "max_length = 64",
        "[drafter]", f"num_layers = {layers}", "block_size = 4", f"mask_token_id = {MASK_ID}", "target_layer_ids = [0, 1]",
        "[train]", "max_steps = 100", "global_batch = 8", "max_micro_batch = 1", "num_anchors = 8",
        "decay_gamma = 3.0", 'attention = "sdpa"']) + "\n")
    return path


def rank_main(rank: int, port: int, profile_path: str, out: str, steps: int) -> None:
    import dataclasses

    import torch
    import torch.distributed

    from dflash.measure import fake
    from dflash.memory.budget import batch_plan
    from dflash.train.rank.parallel import WorkerEnv, close_process_group
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.step import run_step
    from launcher_core.profile import load_profile

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    base = load_profile(profile_path)
    results = {}
    for sync, reshard in SETTINGS:
        profile = dataclasses.replace(base, train=dataclasses.replace(base.train, gradient_sync=sync,
                                                                      reshard_after_forward=reshard))
        state = build_state(profile, Path(profile.paths.run_dir), WorkerEnv.from_env(), resume=False)
        state.autobatch = None
        plan = batch_plan(8, 2, 1)

        def step() -> None:
            epoch, rows = state.data.step_rows(state.step)
            run_step(state, rows, epoch, plan)
            state.step += 1

        step()                                          # AdamW states exist after a first update
        walls, cpus = [], []
        for _ in range(steps):
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        tracker = fake.phase_tracker(state.drafter, state.optimizer, frozen=state.target)
        tracker.phase = "step"
        with tracker:
            step()
        params = sum(p.numel() for p in state.drafter.parameters())
        reductions = plan.accum_steps if sync == "every_micro_batch" else 1
        results[f"{sync}/{'reshard' if reshard else 'keep'}"] = {
            "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "peak_mib": max(tracker.phase_peaks.values()) / 2**20, "params": params,
            "reduce_scatter_mib": reductions * params * 4 / 2**20}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    close_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: a 1-layer drafter of hidden 256, one step")
    args = parser.parse_args()
    hidden, intermediate, layers = (256, 512, 1) if args.smoke else (1024, 8192, 3)
    steps = 1 if args.smoke else args.steps
    import torch.multiprocessing as mp

    from launcher_core.processes import free_port

    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        profile = write_workload(Path(tmp), hidden, intermediate, layers)
        mp.spawn(rank_main, args=(free_port(), str(profile), tmp, steps), nprocs=2, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in (0, 1)]
    print(f"2 gloo ranks, {ranks[0][next(iter(ranks[0]))]['params'] / 1e6:.1f} M drafter parameters, 4 micro-batches "
          f"a rank and step, median of {steps} step(s); load {os.getloadavg()[0]:.1f}")
    print(f"  {'gradient_sync / gathered weights':36} {'step s (wall)':>13} {'CPU s':>7} {'peak MiB r0 / r1':>17} "
          f"{'reduce-scattered MiB':>21}")
    for name in ranks[0]:
        r0, r1 = ranks[0][name], ranks[1][name]
        print(f"  {name:36} {max(r0['wall_s'], r1['wall_s']):>13.2f} {r0['cpu_s']:>7.2f} "
              f"{r0['peak_mib']:>8,.0f} / {r1['peak_mib']:<6,.0f} {r0['reduce_scatter_mib']:>21,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
