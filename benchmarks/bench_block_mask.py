"""flex BlockMask build: from the anchors vs `create_block_mask` over the dense mask_mod.

    .venv/bin/python benchmarks/bench_block_mask.py [--anchors 512 1024] [--context 8192] [--sequences 1] [--repeat 3] [--compiled]
                                                    [--eager-up-to 512]
    .venv/bin/python benchmarks/bench_block_mask.py --smoke      (32 anchors x 16 over 512 tokens, one run, no compile)

For the flagship's two layer rules (rtx6000-x8: causal sliding window 2048, and full), anchors
drawn as the sampler draws them (sorted valid positions, the last two of the last sequence padded):
* before: `create_block_mask(layout.mask_mod(rule), ...)` (eager: the dense [queries x keys] mask
  first; up to `--eager-up-to` anchors, as it takes ~10 to 13 bytes per mask element);
* after: `dflash.drafter.attention.block_mask` (the tables from the anchors);
* with `--compiled`: `torch.compile(create_block_mask)`, the alternative (first call: compile).
Per construction: the transient (torch's CPU allocator, peak above what was live before:
`dflash.measure.peaks.measure_cpu_transient`), what stays (the BlockMask), the CPU seconds of one
build (median of `--repeat`; the first compiled call is reported alone, its wall time too, as
inductor compiles in worker processes), and whether the tables equal the first mask_mod
construction's (the eager one, else the compiled one). Then the
memory model's figures (`dflash.memory.attention_masks`): per sequence, the resident mask and the
build's transient. Judged: the built mask's transient within the model's, and every construction's
tables equal (exit 1 otherwise).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="also torch.compile(create_block_mask)")
    parser.add_argument("--eager-up-to", type=int, default=512,
                        help="run create_block_mask only up to this many anchors (it takes GiBs beyond)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 32 anchors, 512 tokens, one run")
    args = parser.parse_args()
    if args.smoke:
        args.anchors, args.context, args.repeat, args.compiled = [32], 512, 1, False
    return args


def layout_of(sequences: int, anchors: int, context: int, block_size: int):
    import torch

    from dflash.drafter.attention import BlockLayout

    generator = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(context - 1, generator=generator)[:anchors].sort().values
                        for _ in range(sequences)])
    rows[-1, -2:] = 0
    return BlockLayout(rows, context, block_size)


def cpu_seconds(build, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        build()
        times.append(time.process_time() - start)
    return statistics.median(times)


def same_tables(built, reference) -> bool:
    return all(getattr(built, name).equal(getattr(reference, name)) for name in TABLES)


def main() -> int:
    args = parse_args()
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.drafter.attention import block_mask
    from dflash.measure.peaks import measure_cpu_transient
    from dflash.memory.attention_masks import MIB, block_mask_build_bytes, block_mask_bytes, dense_mask_bytes
    from launcher_core.layer_attention import LayerAttention

    compiled = torch.compile(create_block_mask) if args.compiled else None
    rules = {"sliding 2048 causal": LayerAttention(window=2048, causal=True), "full": LayerAttention()}
    within = True
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.sequences} sequence(s) per micro-batch")
    print(f"{'anchors':>7} {'rule':<20} {'construction':<28} {'transient MiB':>14} {'kept MiB':>9} {'CPU s':>8}  tables")
    for anchors in args.anchors:
        layout = layout_of(args.sequences, anchors, args.context, args.block_size)
        queries, keys = layout.num_queries, layout.context_len + layout.num_queries
        for rule_name, rule in rules.items():
            def eager(rule=rule):
                return create_block_mask(layout.mask_mod(rule), args.sequences, None, queries, keys, device="cpu")

            def built(rule=rule):
                return block_mask(layout, rule)

            runs = [("create_block_mask (before)", eager)] if anchors <= args.eager_up_to else []
            if compiled is not None:
                def compiled_build(rule=rule):
                    return compiled(layout.mask_mod(rule), args.sequences, None, queries, keys, device="cpu")

                wall, cpu = time.perf_counter(), time.process_time()
                compiled_build()
                print(f"{anchors:>7} {rule_name:<20} {'compile (first call)':<28} {'':>14} {'':>9} {time.process_time() - cpu:8.2f}"
                      f"  (wall {time.perf_counter() - wall:.1f} s)", flush=True)
                runs.append(("torch.compile(create_block_mask)", compiled_build))
            runs.append(("block_mask (after)", built))
            reference = None
            for name, build in runs:
                measured = measure_cpu_transient(build)
                if reference is None and build is not built:       # the tables of the first mask_mod construction
                    reference, tables = measured.result, "reference"
                else:
                    tables = "-" if reference is None else "equal" if same_tables(measured.result, reference) else "DIFFERENT"
                seconds = cpu_seconds(build, args.repeat)
                print(f"{anchors:>7} {rule_name:<20} {name:<28} {measured.peak_bytes / MIB:14.2f} "
                      f"{measured.retained_bytes / MIB:9.3f} {seconds:8.3f}  {tables}", flush=True)
                within &= tables != "DIFFERENT"
                if build is built:
                    within &= measured.peak_bytes <= args.sequences * block_mask_build_bytes(queries, keys)
        print(f"{anchors:>7} model per sequence: resident {block_mask_bytes(queries, keys) / MIB:.3f} MiB, build transient "
              f"{block_mask_build_bytes(queries, keys) / MIB:.3f} MiB (dense mask alone: "
              f"{dense_mask_bytes(queries, keys) / MIB:.0f} MiB)", flush=True)
    print(f"built mask's transient within the model, tables equal: {'yes' if within else 'NO'}")
    return 0 if within or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
