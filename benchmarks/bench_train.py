#!/usr/bin/env python3
"""Benchmark of online extraction and training on CPU with SmolLM2-135M-Instruct.

Prints, for a sequence of --tokens real-text tokens:
  * target extraction: the truncated hooked forward (stops after the deepest tap) against a full
    forward with output_hidden_states=True and logits: time (median of --repeats) and peak memory
    (RSS growth during the first forward, each variant in a fresh process);
    held against: truncated <= (deepest tap + 1) / N of the full forward + 10 %;
  * training throughput: tokens/s of full training steps (extraction, drafter forward/backward
    over all anchors, AdamW) for the cpu-demo drafter (1 layer, block 8).

Usage: .venv/bin/python benchmarks/bench_train.py [--tokens 2048] [--taps 15] [--repeats 3]
       .venv/bin/python benchmarks/bench_train.py --smoke      (128 tokens, one repeat, one timed step
                                                                of 8 anchors, one thread, in one process)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from envcheck.host import cpu_count  # noqa: E402


def real_text_ids(tokenizer, tokens: int) -> list[int]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(REPO.glob("**/*.md")) if ".venv" not in p.parts)
    ids = tokenizer(text)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def load_target(threads: int = 0):
    """The frozen target as the trainer loads it (dflash.target_model.load_target), and its tokenizer;
    torch on `threads` threads (0: every core)."""
    import torch
    from transformers import AutoTokenizer

    from dflash.target_model import load_target, smollm2_dir

    path = smollm2_dir()
    torch.set_num_threads(threads or cpu_count())
    return load_target(path, dtype="float32"), AutoTokenizer.from_pretrained(path, local_files_only=True)


class PeakRss:
    """Polls this process's RSS every millisecond; `growth_mib` = peak - RSS at start."""

    def __enter__(self):
        import psutil

        self.process, self.running = psutil.Process(), True
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def child_extraction(variant: str, tokens: int, taps: list[int], repeats: int, threads: int) -> dict:
    import torch

    from dflash.drafter.taps import extract_taps

    model, tokenizer = load_target(threads)
    input_ids = torch.tensor([real_text_ids(tokenizer, tokens)])

    def once():
        if variant == "truncated":
            return extract_taps(model, input_ids, taps)
        with torch.no_grad():
            return model(input_ids, output_hidden_states=True, use_cache=False).logits

    with PeakRss() as rss:
        once()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    return {"variant": variant, "seconds": statistics.median(times), "peak_growth_mib": rss.growth_mib,
            "num_layers": model.config.num_hidden_layers}


def run_child(variant: str, args: argparse.Namespace) -> dict:
    if args.in_process:
        return child_extraction(variant, args.tokens, args.taps, args.repeats, args.threads)
    argv = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
            "--threads", str(args.threads), "--taps", *map(str, args.taps)]
    output = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=REPO).stdout
    return json.loads(output.strip().splitlines()[-1])


def throughput_profile(dataset: Path, run_dir: Path, tokens: int, anchors: int):
    """cpu-demo's target (SmolLM2-135M) with a 1-layer drafter, block 8, tap [15], 64 anchors (--anchors),
    one sequence per step, float32, SDPA, no row held out for validation (the one sequence trains): the
    workload this benchmark has always timed (the profile's own lr, schedule and loss decay: they do
    not change the work of a step)."""
    import dataclasses

    from launcher_core.profile import load_profile

    base = load_profile("cpu-demo")
    return dataclasses.replace(
        base, machine=dataclasses.replace(base.machine, nproc_per_node=1),
        paths=dataclasses.replace(base.paths, dataset=str(dataset), run_dir=str(run_dir)),
        data=dataclasses.replace(base.data, max_length=tokens),
        drafter=dataclasses.replace(base.drafter, num_layers=1, block_size=8, target_layer_ids=(15,), init="random",
                                    draft_vocab_size=0, mask_token_id=16),
        train=dataclasses.replace(base.train, global_batch=1, max_micro_batch=1, num_anchors=anchors, attention="sdpa",
                                  autocast="off", feature_cache=False, max_steps=1000,
                                  validation_share=0.0))


def training_throughput(tokens: int, steps: int, anchors: int, threads: int) -> float:
    """tokens/s of training steps on one sequence, through the trainer's build_state and run_step."""
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from dflash.data.dataset_io import save_token_rows
    from dflash.memory.budget import batch_plan
    from dflash.target_model import smollm2_dir
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.step import run_step

    torch.set_num_threads(threads or cpu_count())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as work:
        dataset = Path(work) / "dataset"
        ids = real_text_ids(tokenizer, tokens)
        save_token_rows(dataset, [(ids, [1] * tokens)])
        profile = throughput_profile(dataset, Path(work) / "run", tokens, anchors)
        state = build_state(profile, Path(work) / "run", WorkerEnv(0, 1, 0), resume=False)
        times = []
        for step in range(steps + 1):
            state.step = step
            started = time.perf_counter()
            run_step(state, [0], 0, batch_plan(1, 1, 1))
            times.append(time.perf_counter() - started)
    return tokens / statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--taps", type=int, nargs="+", default=[15], help="tap layer ids (cpu-demo: [15])")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--anchors", type=int, default=64, help="anchors per sequence in the timed training steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    parser.add_argument("--in-process", action="store_true", help="both extraction variants in this process, not each "
                        "in a fresh one (the second one's peak memory then starts from the first's heap)")
    parser.add_argument("--child", choices=["truncated", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 128 tokens, one repeat, one step of 8 anchors, one thread, in process")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.repeats, args.train_steps, args.anchors, args.threads, args.in_process = 128, 1, 1, 8, 1, True
    if args.child:
        print(json.dumps(child_extraction(args.child, args.tokens, args.taps, args.repeats, args.threads)))
        return 0
    truncated, full = run_child("truncated", args), run_child("full", args)
    layers = full["num_layers"]
    bound = (max(args.taps) + 1) / layers + 0.10
    ratio = truncated["seconds"] / full["seconds"]
    print(f"SmolLM2-135M-Instruct, CPU, {args.tokens} tokens, taps {args.taps} of {layers} layers")
    print(f"extraction truncated (hooks, stop after deepest tap): {truncated['seconds'] * 1000:8.1f} ms, "
          f"peak +{truncated['peak_growth_mib']:.0f} MiB")
    print(f"full forward (output_hidden_states + logits):        {full['seconds'] * 1000:8.1f} ms, "
          f"peak +{full['peak_growth_mib']:.0f} MiB")
    print(f"time ratio truncated/full: {ratio:.3f}  (target <= (deepest+1)/N + 0.10 = {bound:.3f}: "
          f"{'PASS' if ratio <= bound else 'MISS'})")
    print(f"training throughput (1-layer drafter, block 8, {args.anchors} anchors): "
          f"{training_throughput(args.tokens, args.train_steps, args.anchors, args.threads):.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
