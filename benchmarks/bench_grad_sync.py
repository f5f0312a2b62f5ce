"""What the gradient sum costs: the previous flat `torch.cat` sum against the bucketed in-place sum
(`dflash.train.dist.sync_gradients`), on 2 real gloo ranks (CPU).

Each rank builds a model shaped like a small drafter (large q/k/v/o and MLP matrices, small norms),
gives every parameter a gradient, then sums them several times, each method in its own pair of
fresh processes, and reports, for rank 0:

* tensor-level peak above parameters + gradients during the sum (torch's MemTracker on the real
  CPU tensors: what the sum allocates),
* resident memory added by the sum (VmHWM after the sum minus VmRSS before, the high-water mark
  reset through /proc/self/clear_refs),
* the sum's wall time and a whole step's (forward/backward of 8 rows, the sum, foreach AdamW),
  medians of --repeats.

    .venv/bin/python benchmarks/bench_grad_sync.py [--hidden 1024] [--layers 4] [--bucket-mib 64] [--repeats 5]
    .venv/bin/python benchmarks/bench_grad_sync.py --smoke      (hidden 64, 1 layer, bucket 0.01 MiB, one repeat,
                                                                  both sums in one process pair)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher_core.processes import free_port  # noqa: E402

MIB = 2**20
METHODS = ("cat", "bucketed")


def drafter_like(hidden: int, layers: int):
    import torch

    def layer() -> list:
        return [torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4)] + \
            [torch.nn.Linear(hidden, 3 * hidden, bias=False) for _ in range(3)] + [torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)]
    return torch.nn.Sequential(*[m for _ in range(layers) for m in layer()])


def cat_sum(parameters, group=None) -> None:
    """The previous sum: one torch.cat of every gradient (a second full copy), all_reduce, copy back."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.requires_grad and p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(method, model, repeats: int) -> dict[str, float]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        method(model.parameters())
    peak = tracker.get_tracker_snapshot("peak")
    base = sum(p.numel() * p.element_size() * 2 for p in model.parameters())        # parameters + gradients
    tensor_peak = max(v["Total"] for v in peak.values()) - base
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_kib("VmRSS")
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        method(model.parameters())
        seconds.append(time.perf_counter() - started)
    return {"tensor_peak_mib": tensor_peak / MIB, "rss_added_mib": (rss_kib("VmHWM") - before) / 1024,
            "seconds": statistics.median(seconds), "step_seconds": step_seconds(method, model, repeats)}


def step_seconds(method, model, repeats: int) -> float:
    """Median time of a whole step with this sum: forward/backward of 8 rows, the sum, AdamW (foreach)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    inputs = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        sum(module(inputs).pow(2).mean() for module in model).backward()     # every module reads the input
        method(model.parameters())
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def rank_main(rank: int, port: int, out: str, args: argparse.Namespace, method_names: tuple[str, ...]) -> None:
    import torch
    import torch.distributed as dist

    from dflash.train.dist import sync_gradients

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = drafter_like(args.hidden, args.layers)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    methods = {"cat": cat_sum, "bucketed": lambda ps: sync_gradients(ps, bucket_mib=args.bucket_mib)}
    results = {"grads_mib": sum(p.numel() * 4 for p in model.parameters()) / MIB,
               **{name: measure(methods[name], model, args.repeats) for name in method_names}}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mib", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one-pair", action="store_true", help="both sums in one pair of processes (not each in its own)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: hidden 64, 1 layer, bucket 0.01 MiB, "
                        "one repeat, one pair of processes")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.bucket_mib, args.repeats, args.one_pair = 64, 1, 0.01, 1, True
    results: dict = {}
    with tempfile.TemporaryDirectory() as work:
        pairs = [METHODS] if args.one_pair else [(method,) for method in METHODS]   # fresh processes: no heap reused
        for methods in pairs:
            out = str(Path(work) / f"{'-'.join(methods)}.json")
            mp.spawn(rank_main, args=(free_port(), out, args, methods), nprocs=2, join=True)
            results.update(json.loads(Path(out).read_text()))
    print(f"gradients: {results['grads_mib']:.1f} MiB per rank (hidden {args.hidden}, {args.layers} layers), "
          f"2 gloo ranks, bucket {args.bucket_mib:g} MiB")
    print(f"{'sum':<10} {'tensor peak above params+grads':>31} {'RSS added':>10} {'sum':>9} {'step':>9}")
    for name in METHODS:
        figures = results[name]
        print(f"{name:<10} {figures['tensor_peak_mib']:>27.1f} MiB {figures['rss_added_mib']:>6.1f} MiB "
              f"{1000 * figures['seconds']:>6.0f} ms {1000 * figures['step_seconds']:>6.0f} ms")


if __name__ == "__main__":
    main()
