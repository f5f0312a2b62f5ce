"""What a checkpoint save costs the ranks: train.async_save on vs off, on 2 real gloo ranks under torchrun.

The same run twice (a tiny random Qwen3 target, a drafter made wide enough that its checkpoint takes a
while to write, a checkpoint every `--every` steps, every step logged): once with the shards written by
DCP's `async_save` while the ranks train on, once synchronously. From metrics.jsonl's per-step times, the
gap after a save step against the median gap after the other steps is the time the ranks stood still
for the save; the runs' wall times and the checkpoint's size are printed beside it.

    .venv/bin/python benchmarks/bench_async_save.py [--steps 24] [--every 4] [--heads 64]
    .venv/bin/python benchmarks/bench_async_save.py --smoke     (8 steps, a checkpoint every 4)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher_core.profile import load_profile  # noqa: E402


@dataclasses.dataclass(frozen=True)
class SaveCost:
    mode: str
    wall_s: float
    stall_s: list[float]            # per save: the gap after its step minus the median other gap
    step_s: float                   # median gap between steps without a save
    checkpoint_mib: float


def write_run_profile(scratch: Path, target: Path, dataset: Path, steps: int, every: int, heads: int,
                      asynchronous: bool) -> Path:
    from tests.train.conftest import write_profile

    name = "async" if asynchronous else "sync"
    return write_profile(scratch / f"{name}.toml", target, dataset, scratch / name, max_steps=steps,
                         save_every_steps=every, async_save=asynchronous, keep_checkpoints=0,   # step-{every} read
                         drafter={"num_layers": 2, "target_layer_ids": [1, 2], "num_attention_heads": heads,
                                  "num_key_value_heads": heads, "head_dim": 128})


def measure(profile_path: Path, every: int) -> SaveCost:
    from dflash.train.supervisor.launch import run_training

    profile = load_profile(str(profile_path))
    run_dir = Path(profile.paths.run_dir)
    started = time.monotonic()
    assert run_training(profile, run_dir=run_dir) == 0
    wall = time.monotonic() - started
    times = {line["step"]: line["time"] for line in map(json.loads, (run_dir / "train" / "metrics.jsonl").open())}
    gaps = {step: times[step + 1] - times[step] for step in times if step + 1 in times}
    saves = [gap for step, gap in gaps.items() if step % every == 0]
    others = statistics.median(gap for step, gap in gaps.items() if step % every)
    step_dir = run_dir / "train" / "checkpoints" / f"step-{every}"
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()) / 2**20
    return SaveCost("async" if profile.train.async_save else "sync", wall, [gap - others for gap in saves], others, size)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--heads", type=int, default=64, help="the drafter's attention heads (its size)")
    parser.add_argument("--smoke", action="store_true")
    return parser.parse_args()


def main() -> None:
    from dflash.target_model import build_tiny_target
    from tests.train.conftest import write_dataset

    args = parse_args()
    steps, every, heads = (8, 4, 16) if args.smoke else (args.steps, args.every, args.heads)
    with tempfile.TemporaryDirectory(prefix="bench-async-save-") as folder:
        scratch = Path(folder)
        target = build_tiny_target(scratch / "target", None, hidden=64, layers=3)
        dataset = write_dataset(scratch / "dataset", rows=64)
        results = [measure(write_run_profile(scratch, target, dataset, steps, every, heads, mode), every)
                   for mode in (True, False)]
    print(f"2 gloo ranks, {steps} steps, a checkpoint every {every}; checkpoint {results[0].checkpoint_mib:,.1f} MiB "
          f"(sharded weights and AdamW states)")
    for cost in results:
        stalls = ", ".join(f"{s:.2f}" for s in cost.stall_s)
        print(f"{cost.mode:>5}: run {cost.wall_s:,.1f} s; a step {cost.step_s:.3f} s; the ranks stood still per save "
              f"median {statistics.median(cost.stall_s):.3f} s ({stalls})")
    sync, asynchronous = results[1], results[0]
    print(f"stall per save: async {statistics.median(asynchronous.stall_s):.3f} s vs sync "
          f"{statistics.median(sync.stall_s):.3f} s")


if __name__ == "__main__":
    main()
