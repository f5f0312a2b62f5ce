"""Eval wall time on the flagship twin (a hybrid Qwen3.5/3.6-architecture target) by rollback mode.

    .venv/bin/python benchmarks/bench_eval_rollback.py [--prompts 4] [--new-tokens 48] [--repeat 3] [--wrong-every 2,4,8]
    .venv/bin/python benchmarks/bench_eval_rollback.py --smoke     (1 prompt x 8 tokens, wrong every 4, one round)

After a rejected draft token the linear-attention (Gated DeltaNet) state must go back to the
committed prefix (dflash.eval.specdec.TargetVerifier):

* snapshot        copy the linear states before each verify forward, restore them after a
                  rejection, feed the accepted tokens again at the front of the NEXT verify
                  forward (the default: no extra forward);
* snapshot-rerun  the same, but feed the accepted tokens again at once (one extra forward per
                  rejecting step: re-running the accepted tokens);
* reprefill       no snapshot: after a rejection feed the whole committed sequence again.

Every mode decodes the held-out prompts (the built-in set, chat template, thinking off) with
an oracle drafter at the flagship's block size 16 whose drafts are wrong every k-th token
(k = 2, 4, 8: tau about 2, 4, 8), checks the output equals target-only decoding, and reports
the best wall time of `--repeat` alternating rounds, on one thread. Target-only decoding is the
baseline. The twin is built once into the cache (`builtin:flagship-twin`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MODES = ("snapshot", "snapshot-rerun", "reprefill")
WRONG_EVERY = (2, 4, 8)
BLOCK = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--wrong-every", default=",".join(map(str, WRONG_EVERY)), help="the oracle's error periods")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 1 prompt x 8 tokens, wrong every 4, "
                        "one round")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.repeat, args.wrong_every = 1, 8, 1, "4"
    return args


def main() -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from dflash.eval.evaluate import encode_prompts
    from dflash.eval.options import DEFAULT_EVAL_PROMPTS
    from dflash.eval.oracle import OracleDrafter
    from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode
    from dflash.target_model import flagship_twin_dir, load_target

    args = parse_args()
    torch.set_num_threads(1)
    path = flagship_twin_dir()
    model = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = [p.token_ids for p in encode_prompts(tokenizer, DEFAULT_EVAL_PROMPTS, args.prompts, thinking=False)]
    settings = DecodeSettings(block_size=BLOCK, max_new_tokens=args.new_tokens)
    references = [speculative_decode(TargetVerifier(model), NoDrafter(), p, settings).tokens for p in prompts]

    def decode_all(mode: str, wrong_every: int) -> tuple[float, float]:
        started, taus = time.perf_counter(), []
        for prompt, reference in zip(prompts, references):
            if mode == "target":
                result = speculative_decode(TargetVerifier(model), NoDrafter(), prompt, settings)
            else:
                drafter = OracleDrafter(reference, len(prompt), model.config.vocab_size, wrong_every=wrong_every)
                result = speculative_decode(TargetVerifier(model, rollback=mode), drafter, prompt, settings)
            assert result.tokens == reference, f"{mode}: output differs from target-only decoding"
            taus += result.taus
        return time.perf_counter() - started, statistics.mean(taus)

    print(f"flagship twin {path}, transformers {transformers.__version__}, torch {torch.__version__}, 1 thread; "
          f"{len(prompts)} prompts x {args.new_tokens} new tokens, block {BLOCK}, best of {args.repeat}")
    decode_all("snapshot", 4)   # warm-up
    target = min(decode_all("target", 0)[0] for _ in range(args.repeat))
    print(f"{'target only':<32} {target:7.2f} s")
    for wrong_every in (int(k) for k in args.wrong_every.split(",")):
        best: dict[str, float] = {mode: float("inf") for mode in MODES}
        tau = 0.0
        for _ in range(args.repeat):
            for mode in MODES:
                seconds, tau = decode_all(mode, wrong_every)
                best[mode] = min(best[mode], seconds)
        cells = "  ".join(f"{mode} {best[mode]:6.2f} s ({best[mode] / best['snapshot']:.2f}x)" for mode in MODES)
        print(f"wrong every {wrong_every} (tau {tau:4.2f})  {cells}")


if __name__ == "__main__":
    main()
