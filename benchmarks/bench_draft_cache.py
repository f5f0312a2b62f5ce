"""In-process DFlash decoding speed at long contexts: the drafter's context K/V cache.

    .venv/bin/python benchmarks/bench_draft_cache.py [--contexts 256,2048] [--new-tokens 32] [--repeat 2] [--no-cache]
    .venv/bin/python benchmarks/bench_draft_cache.py --smoke      (a 32-token context, 4 new tokens, one run)

Target: SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, float32, CPU, 1 thread). Drafter:
a random 5-layer DFlash drafter of the target's shape (block 16; its drafts are mostly rejected,
so every step drafts a full block and commits about one token: the worst case for a drafter that
re-projects its whole context every step). Prompts: random token ids of each context length.
For each context: tokens/s of speculative decoding (output checked equal to target-only greedy
decoding) and the drafter's own time per step (`propose`), best of `--repeat`.
`--no-cache` drafts without the context K/V cache (where the decoder has one), for comparison.
Where the code has the cache, it also prints one draft call alone at each context (random
features, best of 5): uncached (`draft_logits`, the whole context through fc and every layer's
k/v projections), cached (`draft_logits_cached`: the block only), and the lm_head's share of it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--sliding-window", type=int, default=0, help="window of the first four layers (0: all full)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: context 32, 4 new tokens, one run")
    args = parser.parse_args()
    if args.smoke:
        args.contexts, args.new_tokens, args.repeat = "32", 4, 1
    return args


def build_drafter(target, sliding_window: int):
    """The trainer's drafter construction (dflash.train.rank.setup.build_drafter) for a cpu-demo variant:
    5 random layers, block 16, taps spaced over the target, the full vocabulary."""
    import dataclasses

    from dflash.drafter.taps import default_target_layer_ids
    from dflash.train.rank.setup import build_drafter as trainer_drafter
    from launcher_core.profile import load_profile

    base = load_profile("cpu-demo")
    layers = 5
    windowed = {"layer_types": ("sliding_attention",) * 4 + ("full_attention",), "sliding_window": sliding_window}
    drafter = dataclasses.replace(base.drafter, num_layers=layers, block_size=16, target_layer_ids=(), init="random",
                                  draft_vocab_size=0, mask_token_id=target.config.vocab_size - 1,
                                  **(windowed if sliding_window else {}))
    profile = dataclasses.replace(base, drafter=drafter)
    count = target.config.num_hidden_layers
    return trainer_drafter(profile, target, default_target_layer_ids(count, layers), count).eval()


class TimedDraft:
    """Wraps a drafter: the same proposals, with the time spent in propose recorded."""

    def __init__(self, inner):
        self.inner, self.name, self.uses_features, self.spent, self.steps = inner, inner.name, True, 0.0, 0

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, committed, features, k, temperature):
        started = time.perf_counter()
        proposal = self.inner.propose(committed, features, k, temperature)
        self.spent, self.steps = self.spent + time.perf_counter() - started, self.steps + 1
        return proposal


def draft_call_ms(drafter, context: int) -> str:
    """One draft call alone, uncached vs cached (best of 5, ms)."""
    import torch

    try:
        from dflash.drafter.draft_cache import DraftContextCache, extend_cache
        from dflash.drafter.network import draft_logits_cached
    except ImportError:
        return "no draft cache in this code"
    features = torch.randn(1, context, len(drafter.target_layer_ids) * drafter.config.hidden_size)
    with torch.no_grad():
        cache = extend_cache(drafter, DraftContextCache(), features)
        timings = [best_ms(lambda: drafter.draft_logits(features, 5, context)),
                   best_ms(lambda: draft_logits_cached(drafter, cache, 5)),
                   best_ms(lambda: drafter.logits(torch.randn(drafter.block_size, drafter.config.hidden_size)))]
    return "draft call: uncached {:.0f} ms, cached {:.0f} ms (lm_head {:.0f} ms of it)".format(*timings)


def best_ms(call, repeat: int = 5) -> float:
    spent = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        spent.append(time.perf_counter() - started)
    return 1000 * min(spent)


def main() -> None:
    import torch

    from dflash.eval.dflash_drafter import DFlashDraft
    from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode
    from dflash.target_model import SMOLLM2, load_target, resolve_model_path

    args = parse_args()
    torch.set_num_threads(1)
    target = load_target(resolve_model_path(SMOLLM2), dtype="float32")
    drafter = build_drafter(target, args.sliding_window)
    settings = DecodeSettings(block_size=16, max_new_tokens=args.new_tokens)
    options = {"use_cache": False} if args.no_cache else {}
    print(f"SmolLM2-135M target, random 5-layer drafter, block 16, {args.new_tokens} new tokens, 1 thread, "
          f"best of {args.repeat}; cache {'off' if args.no_cache else 'default'}; sliding window {args.sliding_window}")
    generator = torch.Generator().manual_seed(0)
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(100, 40000, (context,), generator=generator).tolist()
        reference = speculative_decode(TargetVerifier(target), NoDrafter(), prompt, settings).tokens
        best = None
        for _ in range(args.repeat):
            timed = TimedDraft(DFlashDraft(model=drafter, **options))
            layer_ids = drafter.target_layer_ids
            result = speculative_decode(TargetVerifier(target, layer_ids), timed, prompt, settings)
            assert result.tokens == reference, "speculative decoding differs from target-only decoding"
            row = (result.wall_s, len(result.tokens) / result.wall_s, 1000 * timed.spent / timed.steps, timed.steps)
            best = row if best is None or row[0] < best[0] else best
        wall, rate, draft_ms, steps = best
        print(f"context {context:5d}: {rate:6.2f} tokens/s, draft {draft_ms:7.1f} ms/step over {steps} steps, "
              f"wall {wall:6.2f} s; {draft_call_ms(drafter, context)}")


if __name__ == "__main__":
    main()
