#!/usr/bin/env python3
"""What starting the ranks costs: `launcher.py train`'s real launch (run_training: the torchrun agent,
its ranks, gloo) of a tiny workload, with the ranks forked from torchrun's forkserver
(train.rank_start = "forkserver", which imports torch and the model code once) against each rank a
python of its own (train.rank_start = "command").

Prints, for each launch, its wall time and the CPU seconds the whole machine spent during it (busy
jiffies of /proc/stat: the forkserver and its ranks are not children this process waits for, so
their CPU is not in its rusage; run it on an otherwise idle machine), then the median of each mode.
The modes alternate, so drift on the machine falls on both.

    .venv/bin/python benchmarks/bench_rank_start.py [--ranks 2] [--steps 4] [--repeat 3]
    .venv/bin/python benchmarks/bench_rank_start.py --smoke     (one forkserver launch, 1 step)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

if TYPE_CHECKING:
    from launcher_core.schema import Profile

MODES = ("command", "forkserver")
ROWS, ROW_TOKENS = 16, 32


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    jiffies = [int(value) for value in fields]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]
    return busy / os.sysconf("SC_CLK_TCK")


def small_workload(scratch: Path) -> tuple[Path, Path]:
    """A tiny random Qwen3 target with the real Qwen3 tokenizer, and ROWS seeded rows of its token ids."""
    import numpy as np

    from dflash.data.dataset_io import save_token_rows
    from dflash.target_model import build_tiny_target, qwen3_tokenizer_dir

    target = build_tiny_target(scratch / "target", qwen3_tokenizer_dir(), hidden=64, layers=2)
    rng = np.random.default_rng(0)
    rows = [(rng.integers(100, 30000, ROW_TOKENS).tolist(), [0] * (ROW_TOKENS // 2) + [1] * (ROW_TOKENS // 2))
            for _ in range(ROWS)]
    return target, save_token_rows(scratch / "dataset", rows)


def launch_profile(target: Path, dataset: Path, run_dir: Path, mode: str, ranks: int, steps: int) -> Profile:
    """cpu-demo on `ranks` gloo ranks with the tiny workload, ranks started by `mode`; nothing held out."""
    from launcher_core.profile import load_profile

    base = load_profile("cpu-demo")
    return dataclasses.replace(
        base, machine=dataclasses.replace(base.machine, nproc_per_node=ranks),
        model=dataclasses.replace(base.model, target=str(target), tokenizer="", dtype="float32"),
        paths=dataclasses.replace(base.paths, dataset=str(dataset), run_dir=str(run_dir)),
        drafter=dataclasses.replace(base.drafter, num_layers=1, target_layer_ids=(1,), init="random",
                                    draft_vocab_size=256, mask_token_id=151669),
        train=dataclasses.replace(base.train, global_batch=ranks * 2, max_micro_batch=1, num_anchors=4,
                                  feature_cache=False, max_steps=steps, validation_share=0.0,
                                  save_every_steps=steps, log_every_steps=1, rank_start=mode))


def one_launch(profile: Profile, run_dir: Path) -> tuple[float, float]:
    """(wall s, machine CPU s) of run_training for `profile` into a new `run_dir`."""
    from dflash.train.supervisor.launch import run_training

    busy, start = machine_busy_s(), time.perf_counter()
    code = run_training(profile, run_dir=run_dir)
    wall, cpu = time.perf_counter() - start, machine_busy_s() - busy
    if code != 0:
        raise SystemExit(f"the {profile.train.rank_start} launch into {run_dir} exited with {code}")
    return wall, cpu


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks per launch")
    parser.add_argument("--steps", type=int, default=4, help="training steps per launch")
    parser.add_argument("--repeat", type=int, default=3, help="launches per mode (alternating)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--smoke", action="store_true", help="one forkserver launch of 1 step")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeat, args.modes = 1, 1, ["forkserver"]
    return args


def main() -> None:
    args = parse_args()
    figures: dict[str, list[tuple[float, float]]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="bench-rank-start-") as tmp:
        scratch = Path(tmp)
        target, dataset = small_workload(scratch)
        for attempt in range(args.repeat):
            for mode in args.modes:
                run_dir = scratch / f"run-{mode}-{attempt}"
                wall, cpu = one_launch(launch_profile(target, dataset, run_dir, mode, args.ranks, args.steps), run_dir)
                figures[mode].append((wall, cpu))
                print(f"{mode:10} launch {attempt + 1}: {args.ranks} ranks x {args.steps} steps: "
                      f"wall {wall:.1f} s, machine CPU {cpu:.1f} s", flush=True)
    for mode, runs in figures.items():
        print(f"{mode:10} median of {len(runs)}: wall {statistics.median(w for w, _ in runs):.1f} s, "
              f"machine CPU {statistics.median(c for _, c in runs):.1f} s")


if __name__ == "__main__":
    main()
