"""One rank of the FSDP2 equality test (tests/train/test_fsdp_step.py), run by torchrun: the
trainer's own state (`build_state`: the drafter sharded by FSDP2) and step 0's micro-batches
(`accumulate_step`, each rank its share of the global batch), with the gradients reduce-scattered
every micro-batch and, again from zero, only at the last one; rank 0 writes the step's loss and the
gathered (full) gradients of both runs to --out."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from dflash.train.rank import parallel
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.step import accumulate_step, micro_weight_sum, step_stats
    from launcher_core.profile import load_profile

    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    env = parallel.WorkerEnv.from_env()
    parallel.init_process_group("gloo")
    state = build_state(profile, Path(profile.paths.run_dir), env, resume=False, planned_micro_batch=1)
    state.autobatch = None
    epoch, rows = state.data.step_rows(0)
    weight = parallel.global_weight(micro_weight_sum(state, state.data.collate(rows, epoch)))
    found = {}
    for sync in ("every_micro_batch", "last_micro_batch"):
        state.gradient_sync = sync
        sums, tokens = accumulate_step(state, rows, epoch, 1, weight)
        stats = step_stats(state, sums, tokens, 0.0)
        grads = {name: p.grad.full_tensor() for name, p in state.drafter.named_parameters()}
        found[sync] = {"loss": stats.loss, "grads": grads, "micro_batches": len(rows)}
    if env.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(found, args.out / "fsdp.pt")
    parallel.close_process_group()
    from launcher_core.processes import exit_without_finalization

    exit_without_finalization(0)      # gloo's threads can abort the interpreter's teardown (SIGABRT)


if __name__ == "__main__":
    main()
