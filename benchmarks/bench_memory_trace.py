"""Traced vs modelled memory of one training step at the GPU profiles' worst case (issue 18).

    .venv/bin/python benchmarks/bench_memory_trace.py [--profiles rtx6000-x8 b200-x8 h200-x1] [--micro-batches 1 2]

Each step runs on fake tensors (no memory is allocated) under MemTracker: the Qwen3.6-27B-shaped
target's tap forward, the drafter's forward/backward with the chunked loss, clipping and AdamW on
this rank's ZeRO-1 shard. The analytic model (dflash.memory.model) is held to within 10 % of the
trace, component by component and at the peak.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=["rtx6000-x8", "b200-x8", "h200-x1"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    from dflash.memory import model as memory
    from dflash.memory import trace
    from launcher_core.profile import load_profile

    worst = 0.0
    for name in args.profiles:
        profile = load_profile(name)
        for micro_batch in args.micro_batches:
            traced = trace.trace_step(profile, micro_batch)
            figures = trace.compare(traced, memory.workload_from_profile(profile))
            print("\n".join(trace.format_comparison(name, traced, figures)), flush=True)
            worst = max([worst] + [abs(f.error) for f in figures])
    print(f"largest model-vs-trace difference: {100 * worst:.1f}% (target: within 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
