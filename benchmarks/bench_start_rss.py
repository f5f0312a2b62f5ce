#!/usr/bin/env python3
"""A rank's host RAM at start, before and after the meta-device order: torchrun ranks on gloo build their
training state in the trainer's order (`build_state`: the drafter on the meta device, sharded, materialised
per shard; the target loaded up to its deepest tap) and in the order before it (the whole target, the whole
drafter on the host, then sharded and cut), each rank reporting its peak RSS (ru_maxrss) once its state is
built. The ranks run tests/train/start_rss_worker.py (the start-up RSS test's rank program). Prints the
plan's figure (dflash.memory.host_ram) beside the measured peaks.

The workload: a random Qwen3 target 1024 wide (8192-wide MLP, 2 layers, 2,048-token vocabulary) and a
drafter of --layers layers of that width (10: 284 M parameters, 1.1 GB in float32).

    .venv/bin/python benchmarks/bench_start_rss.py [--ranks 2] [--layers 10]
    .venv/bin/python benchmarks/bench_start_rss.py --smoke      (a 1-layer drafter)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORKER = REPO / "tests" / "train" / "start_rss_worker.py"


def workload(scratch: Path, layers: int, ranks: int) -> Path:
    """The target, a small dataset of its token ids, and a CPU profile of `ranks` ranks around them."""
    import numpy as np

    from dflash.data.dataset_io import save_token_rows
    from tests.train.start_rss_worker import wide_target

    wide_target(scratch / "target")
    rng = np.random.default_rng(0)
    save_token_rows(scratch / "dataset", [(rng.integers(100, 2000, 64).tolist(), [0] * 16 + [1] * 48) for _ in range(16)])
    profile = scratch / "profile.toml"
    profile.write_text("\n".join([
        "[machine]", 'device = "cpu"', 'backend = "gloo"', f"nproc_per_node = {ranks}",
        "[model]", f'target = "{scratch / "target"}"', 'dtype = "float32"',
        "[paths]", f'run_dir = "{scratch / "run"}"', f'dataset = "{scratch / "dataset"}"',
        "[drafter]", f"num_layers = {layers}", "target_layer_ids = [0]", "mask_token_id = 2000", "block_size = 4",
        "[train]", "global_batch = 4", "max_micro_batch = 1", "num_anchors = 8", "decay_gamma = 3.0"]) + "\n", encoding="utf-8")
    return profile


def measured(scratch: Path, profile: Path, order: str, ranks: int) -> tuple[list[float], float]:
    out, started = scratch / order, time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                           "--log-dir", str(scratch / f"logs-{order}"), str(WORKER), "--profile", str(profile),
                           "--order", order, "--out", str(out)], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{order}: the ranks failed:\n{done.stderr[-3000:]}")
    peaks = [json.loads((out / f"rank-{rank}.json").read_text())["peak_rss_mib"] for rank in range(ranks)]
    return peaks, time.perf_counter() - started


def main() -> None:
    from dflash.memory.budget import make_plan
    from dflash.memory.host_ram import host_ram_at_start
    from launcher_core.profile import load_profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a 1-layer drafter")
    args = parser.parse_args()
    args.layers = 1 if args.smoke else args.layers
    with tempfile.TemporaryDirectory(prefix="bench-start-rss-") as scratch_name:
        scratch = Path(scratch_name)
        profile_path = workload(scratch, args.layers, args.ranks)
        profile = load_profile(str(profile_path))
        planned = host_ram_at_start(profile, make_plan(profile))
        print(f"drafter: {planned.whole_drafter_mib:,.0f} MiB in float32; {args.ranks} gloo ranks")
        print(f"planned per rank: {planned.per_rank_mib:,.0f} MiB ({planned.terms()}); "
              f"the order before: {planned.whole_per_rank_mib:,.0f} MiB")
        for order, label in (("whole", "before (whole drafter on the host)"), ("sharded", "after (meta, sharded)")):
            peaks, seconds = measured(scratch, profile_path, order, args.ranks)
            print(f"{label}: peak RSS per rank {' / '.join(f'{p:,.0f}' for p in peaks)} MiB ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
