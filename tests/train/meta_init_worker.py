"""One rank of the meta-device init test (tests/train/test_meta_init.py), run by torchrun: for each
profile, the rank's drafter as the trainer builds it (`build_state`: the target loaded up to the layers
it needs, the drafter built on the meta device, sharded, materialised per shard); rank 0 writes every
parameter and buffer, gathered whole, and the target's layer count to --out/<profile stem>.pt."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from dflash.train.rank import parallel
    from dflash.train.rank.setup import build_state
    from launcher_core.profile import load_profile

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="gloo", help="the process group's backend (nccl: a CUDA profile)")
    parser.add_argument("profiles", nargs="+")
    args = parser.parse_args()
    env = parallel.WorkerEnv.from_env()
    if args.backend == "nccl":
        parallel.rank_device("cuda", env)
    parallel.init_process_group(args.backend)
    for path in args.profiles:
        profile = load_profile(path)
        state = build_state(profile, Path(profile.paths.run_dir), env, resume=False, planned_micro_batch=1)
        tensors = [*state.drafter.named_parameters(), *state.drafter.named_buffers()]
        found = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for name, t in tensors}
        if env.is_main:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save({"tensors": found, "target_layers": len(state.target.model.layers)},
                       args.out / f"{Path(path).stem}.pt")
    parallel.close_process_group()
    from launcher_core.processes import exit_without_finalization

    exit_without_finalization(0)      # gloo's threads can abort the interpreter's teardown (SIGABRT)


if __name__ == "__main__":
    main()
