"""The parity gate under the flagship's numerics: how far apart the same drafter decodes in two dtypes, and
which near-tie margins keep a drafter served as trained from failing the gate there.

The flagship serves in bfloat16 (SGLang's kernels) while the gate's constants were measured in float32 on
vLLM's CPU build. What can be measured on a CPU: the in-process decoder in bfloat16 against itself in
float32 on the same token-id prompts (target and drafter both in the dtype), the whole block drafted
(`--draft-tokens 0`, B - 1 a step) at 256 new tokens. Two kernels of one dtype round differently, as bfloat16
and float32 do here, so a margin that keeps float32 from flipping in bfloat16 bounds the noise of a
bfloat16 engine against a bfloat16 decoder from above only roughly: the figures are a floor to measure
again on the node (scripts/gpu_check.py serves the twin in bfloat16).

The prompts are taken from the files in turn (one of each, then the next of each), so that 64 of four files are 16
of each kind. For each prompt: each side's steps, accepted drafts and margins, and the first step where the two differ.
For a grid of (drafter, target) margins: the share of prompts that depart before the first near-tie of the
side holding the margins (either side, the worse), and the chance that a set of 16 prompts holds at least
`PREFIX_PROMPTS` such prompts (the gate's false failure on a true drafter, per set).

    .venv/bin/python benchmarks/bench_parity_dtype.py --draft RUN/train/checkpoints/step-N \\
        --prompts dflash/prompts/everyday_prompts.jsonl,dflash/prompts/indist_prompts.jsonl,RUN/eval/bench/humaneval/prompts.jsonl,RUN/eval/bench/mt-bench/prompts.jsonl \\
        --num-prompts 64 --max-new-tokens 256 --out benchmarks/results/parity-dtype_cpu-2core_DATE.json
    .venv/bin/python benchmarks/bench_parity_dtype.py --smoke     (2 prompts x 8 tokens, an untrained drafter)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dflash.eval.parity import PREFIX_PROMPTS, GateConstants, PromptAcceptance  # noqa: E402

DRAFT_GRID = (0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
TARGET_GRID = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
SET_SIZE = 16


@dataclass(frozen=True)
class Decoded:
    """One prompt decoded in one dtype."""

    tokens: list[int]
    per_step: list[int]
    draft_margins: list[Optional[float]]
    target_margins: list[Optional[float]]

    def acceptance(self) -> PromptAcceptance:
        return PromptAcceptance(self.tokens, len(self.per_step), sum(self.per_step), self.per_step,
                                self.draft_margins, self.target_margins)


def decode_all(profile: Any, checkpoint: Path, prompt_files: Sequence[Path], count: int, dtype: str,
               draft_tokens: int, max_new_tokens: int) -> tuple[list[str], list[Decoded], float]:
    """Every prompt decoded greedily by the DFlash drafter with target and drafter in `dtype` (no target-only
    or prompt lookup run: only the drafter's steps matter here); returns names, decodes and the wall time."""
    from dataclasses import replace

    import torch

    from dflash.eval.dflash2_drafter import load_draft
    from dflash.eval.evaluate import cpu_threads, encode_prompts, load_target, stop_token_ids
    from dflash.eval.specdec import DecodeSettings, TargetVerifier, speculative_decode

    profile = replace(profile, model=replace(profile.model, dtype=dtype))
    model, tokenizer, _ = load_target(profile)
    draft = load_draft(str(checkpoint), model, draft_tokens)
    draft.model.to(getattr(torch, dtype))
    settings = DecodeSettings(block_size=draft.block_size, max_new_tokens=max_new_tokens,
                              eos_ids=stop_token_ids(tokenizer, model))
    prompts = interleaved([encode_prompts(tokenizer, path, 10**6, profile.generate.thinking) for path in prompt_files],
                          count)
    verifier = TargetVerifier(model, draft.layer_ids)
    started, decoded = time.perf_counter(), []
    with cpu_threads(model, profile.eval.cpu_threads):
        for prompt in prompts:
            run = speculative_decode(verifier, draft, prompt.token_ids, settings)
            decoded.append(Decoded(run.tokens, [tau - 1 for tau in run.taus], run.draft_margins, run.target_margins))
    return [p.prompt_id for p in prompts], decoded, time.perf_counter() - started


def interleaved(files: Sequence[Sequence[Any]], count: int) -> list[Any]:
    """The first `count` prompts taking one of each file in turn (a file that runs out drops out), so that every
    kind listed (short chats, long code prompts, second turns) is among them."""
    taken: list[Any] = []
    for place in range(max((len(prompts) for prompts in files), default=0)):
        taken.extend(prompts[place] for prompts in files if place < len(prompts))
    return taken[:count]


def first_apart(a: Decoded, b: Decoded) -> Optional[int]:
    """The first step (0-based) whose accepted drafts differ, or whose committed tokens differ (a target flip);
    the last step of the shorter side left out (the length limit cuts it)."""
    start = 1
    for step in range(min(len(a.per_step), len(b.per_step)) - 1):
        end = start + a.per_step[step] + 1
        if a.per_step[step] != b.per_step[step] or a.tokens[start - 1:end] != b.tokens[start - 1:end]:
            return step
        start = end
    return None


def departs_before_tie(step: Optional[int], holder: Decoded, constants: GateConstants) -> bool:
    """Whether a departure at `step` comes before the first near-tie of the side holding the margins."""
    if step is None:
        return False
    tie = holder.acceptance().first_near_tie(constants)
    return tie is None or step < tie


def set_failure_chance(rate: float, size: int = SET_SIZE, needed: int = PREFIX_PROMPTS) -> float:
    """P(at least `needed` of `size` prompts depart) when each departs with probability `rate`."""
    return sum(math.comb(size, k) * rate ** k * (1 - rate) ** (size - k) for k in range(needed, size + 1))


def upper_bound(found: int, total: int) -> float:
    """The one-sided 95 % upper bound of a rate seen `found` times in `total` (exact binomial)."""
    if total == 0:
        return 1.0
    low, high = found / total, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        tail = sum(math.comb(total, k) * middle ** k * (1 - middle) ** (total - k) for k in range(found + 1))
        low, high = (middle, high) if tail > 0.05 else (low, middle)
    return high


def grid(first: Sequence[Decoded], second: Sequence[Decoded]) -> list[dict[str, Any]]:
    """Per (drafter, target) margins: prompts departing before the margin-holding side's first near-tie (the
    worse of the two sides holding them), the rate's 95 % upper bound, a 16-prompt set's failure chance at it."""
    rows = []
    for draft in DRAFT_GRID:
        for target in TARGET_GRID:
            constants = GateConstants(draft_logits=draft, target_logits=target)
            found = _worst(first, second, constants)
            bound = upper_bound(found, len(first))
            rows.append({"drafter_margin": draft, "target_margin": target, "departing": found, "prompts": len(first),
                         "rate_bound": bound, "set_failure_at_bound": set_failure_chance(bound)})
    return rows


def _worst(first: Sequence[Decoded], second: Sequence[Decoded], constants: GateConstants) -> int:
    counts = []
    for holder_side in (first, second):
        counts.append(sum(departs_before_tie(first_apart(a, b), holder, constants)
                          for a, b, holder in zip(first, second, holder_side)))
    return max(counts)


def tau(decoded: Sequence[Decoded]) -> float:
    steps = sum(len(d.per_step) for d in decoded)
    return 1 + sum(sum(d.per_step) for d in decoded) / steps if steps else 1.0


def report(names: Sequence[str], sides: dict[str, list[Decoded]], walls: dict[str, float]) -> dict[str, Any]:
    (one, first), (two, second) = list(sides.items())
    departures = []
    for name, a, b in zip(names, first, second):
        step = first_apart(a, b)
        if step is not None:
            departures.append({"prompt": name, "step": step + 1, one: a.per_step[step], two: b.per_step[step],
                               f"{one}_drafter_margin": a.draft_margins[step], f"{one}_target_margin": a.target_margins[step],
                               f"{two}_drafter_margin": b.draft_margins[step], f"{two}_target_margin": b.target_margins[step],
                               "tokens_differ": a.tokens != b.tokens})
    return {"prompts": len(names), "tau": {key: tau(value) for key, value in sides.items()}, "wall_s": walls,
            "prompts_apart": len(departures), "tokens_differ": sum(d["tokens_differ"] for d in departures),
            "departures": departures, "grid": grid(first, second)}


def print_report(result: dict[str, Any]) -> None:
    print(f"{result['prompts']} prompts; tau " + ", ".join(f"{k} {v:.3f}" for k, v in result["tau"].items())
          + "; wall " + ", ".join(f"{k} {v:.0f} s" for k, v in result["wall_s"].items()))
    print(f"apart on {result['prompts_apart']} prompts ({result['tokens_differ']} with other tokens)")
    print("drafter / target margin: departing before the first near-tie (worse side), 95 % bound, a set of 16 failing")
    for row in result["grid"]:
        print(f"  {row['drafter_margin']:>5} / {row['target_margin']:<5} {row['departing']:>3} of {row['prompts']}  "
              f"{row['rate_bound']:.3f}  {row['set_failure_at_bound']:.4f}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from launcher_core.profile import load_profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu-demo")
    parser.add_argument("--draft", help="a checkpoint directory (step-N)")
    parser.add_argument("--prompts", default="dflash/prompts/everyday_prompts.jsonl,dflash/prompts/indist_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--draft-tokens", type=int, default=0, help="drafts a step (0: the whole block, B - 1)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", help="write the records and the grid here (JSON)")
    parser.add_argument("--smoke", action="store_true", help="2 prompts x 8 tokens with an untrained drafter")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    draft = Path(args.draft) if args.draft else None
    if args.smoke:
        draft, args.num_prompts, args.max_new_tokens = smoke_drafter(profile), 2, 8
    if draft is None:
        parser.error("--draft is needed (or --smoke)")
    files = [Path(name) for name in args.prompts.split(",")]
    sides, walls, names = {}, {}, []
    for dtype in args.dtypes.split(","):
        names, sides[dtype], walls[dtype] = decode_all(profile, draft, files, args.num_prompts, dtype,
                                                       args.draft_tokens, args.max_new_tokens)
    result = {"draft": str(draft), "max_new_tokens": args.max_new_tokens, "draft_tokens": args.draft_tokens,
              **report(names, sides, walls)}
    print_report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


def smoke_drafter(profile: Any) -> Path:
    """An untrained drafter of the profile's shape, saved in a scratch folder."""
    import tempfile

    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.eval.evaluate import load_target
    from dflash.train.rank.setup import build_drafter, resolve_layer_ids

    target, _, _ = load_target(profile)
    count = target.config.num_hidden_layers
    vocab = list(range(profile.drafter.draft_vocab_size)) or None
    drafter = build_drafter(profile, target, resolve_layer_ids(profile, count), count, vocab)
    return save_checkpoint(Path(tempfile.mkdtemp(prefix="parity-dtype-smoke-")), drafter, 0, {})


if __name__ == "__main__":
    sys.exit(main())
