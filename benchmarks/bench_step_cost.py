"""Where a DFlash step's time goes in-process, at the demo's sizes, against the best plain decoding.

    .venv/bin/python benchmarks/bench_step_cost.py [--draft CKPT] [--prompts 8] [--new-tokens 48] [--threads 1]
                                                   [--draft-tokens 7,3] [--full-block] [--cpu-matmul auto|torch]
    .venv/bin/python benchmarks/bench_step_cost.py --smoke     (1 prompt x 8 tokens, an untrained drafter)

The cpu-demo profile's sizes: SmolLM2-135M-Instruct target (float32, CPU, `--threads`, default the
profile's eval.cpu_threads; linear layers on `--cpu-matmul`, default the profile's eval.cpu_matmul:
"auto" = dflash.eval.cpu_kernels, "torch" = nn.Linear as is; every method decodes on the same
model), the DFlash drafter of 3 layers and block 8 (`--draft CKPT`: a trained
checkpoint; without it, the profile's drafter started from the target with the first 4,096 token
ids as its draft vocabulary: it drafts badly, which changes tau, not what a step costs), the first
`--prompts` prompts of the out-of-template eval set with the chat template, greedy, `--new-tokens`.

Printed, per prompt set (best of `--repeat` passes over the prompts, each method's runs alternated):
* plain decoding, both ways this project could do it with the same model, dtype, threads and KV
  cache (transformers' DynamicCache): the eval's own loop with no drafter (`TargetVerifier` +
  `NoDrafter`, one cached forward a token) and transformers' `model.generate` (greedy); ms per
  token after the prefill and tokens/s with the prefill, as the eval counts them. The faster one
  is the baseline the speedup is counted against;
* DFlash, for each `--draft-tokens` k (default: the profile's eval.draft_tokens; 0 = B - 1): the
  drafter drafts `[anchor, MASK x k]` and the target verifies k + 1 tokens (`--full-block`: the
  drafter drafts the whole block of B and only its first k tokens are proposed); ms per step split into the draft (`propose`: the drafter's context K/V extension, its
  forward and the draft tokens), the verify forward (the target over anchor + drafts, with tap
  features), the rollback (the target's KV crop) and the rest (the loop's own Python: acceptance,
  bookkeeping, feature append), tau, tokens/s, speedup, and the step's cost over a plain step;
* one forward alone (best of 9): the target on 1 token and on `block` tokens after the same
  context, and the lm_head over 1 and `block` rows, so the verify's extra cost can be read apart.

Every DFlash output is checked equal, token for token, to plain decoding's (lossless).

Times are CPU seconds of the decoding thread (`time.thread_time`; with one torch thread the
forwards run on it), which other jobs on a shared machine do not inflate the way they inflate wall
time; the wall figures are printed beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="", help="a trained drafter checkpoint (default: the profile's drafter, untrained)")
    parser.add_argument("--prompts", type=int, default=8, help="the first N prompts of the out-of-template eval set")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the profile's eval.cpu_threads)")
    parser.add_argument("--repeat", type=int, default=2, help="passes over the prompts; the best pass is reported")
    parser.add_argument("--draft-tokens", default="", help="comma-separated k (0: B - 1; default: eval.draft_tokens)")
    parser.add_argument("--full-block", action="store_true", help="draft the whole block, propose its first k tokens")
    parser.add_argument("--cpu-matmul", default="", help="auto or torch (default: the profile's eval.cpu_matmul)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 1 prompt x 8 tokens, one pass")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.repeat = 1, 8, 1
    return args


@dataclasses.dataclass
class Phases:
    """Seconds (CPU of this thread, and wall) spent in each part of the decoding loop, summed over a pass."""

    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    wall: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 0
    tokens: int = 0
    prompts: int = 0
    accepted_plus_one: int = 0

    def add(self, phase: str, cpu_s: float, wall_s: float) -> None:
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu_s
        self.wall[phase] = self.wall.get(phase, 0.0) + wall_s

    def loop(self, clock: str = "cpu") -> float:
        """Decoding time after the prefill."""
        times = self.cpu if clock == "cpu" else self.wall
        return times.get("decode", 0.0) - times.get("prefill", 0.0)

    def rest(self) -> float:
        return self.loop() - sum(self.cpu.get(phase, 0.0) for phase in ("draft", "verify", "rollback"))

    def per_step_ms(self, seconds: float) -> float:
        return 1000 * seconds / max(1, self.steps)

    def tokens_per_s(self, clock: str = "cpu") -> float:
        return self.tokens / max(1e-9, (self.cpu if clock == "cpu" else self.wall).get("decode", 0.0))


class Timer:
    """Adds the CPU and wall time of a `with` block to one phase."""

    def __init__(self, phases: Phases, phase: str):
        self.phases, self.phase = phases, phase

    def __enter__(self) -> "Timer":
        self.cpu, self.wall = time.thread_time(), time.perf_counter()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.phases.add(self.phase, time.thread_time() - self.cpu, time.perf_counter() - self.wall)


def timed_verifier(target: Any, layer_ids: Any, phases: Phases) -> Any:
    """The eval's TargetVerifier with the time of its forwards (the first after a reset: the prefill) and rollbacks."""
    from dflash.eval.specdec import TargetVerifier

    class TimedVerifier(TargetVerifier):
        def reset(self) -> None:
            super().reset()
            self.first = True

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            phase = "prefill" if self.first else "verify"
            with Timer(phases, phase):
                out = super().forward(*args, **kwargs)
            self.first = False
            if getattr(out, "head", None) is not None:        # a lazy verify: the lm_head rows the acceptance reads count as verify
                head = out.head

                def timed_head(hidden: Any) -> Any:
                    with Timer(phases, phase):
                        return head(hidden)

                out.head = timed_head
            return out

        def rollback(self, length: int) -> None:
            with Timer(phases, "rollback"):
                super().rollback(length)

    return TimedVerifier(target, layer_ids)


class TimedDraft:
    """A drafter with the time of its `propose` recorded (the same proposals)."""

    def __init__(self, inner: Any, phases: Phases):
        self.inner, self.phases = inner, phases
        self.name, self.uses_features = inner.name, inner.uses_features

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, *args: Any) -> Any:
        with Timer(self.phases, "draft"):
            return self.inner.propose(*args)


def decode_pass(target: Any, drafter: Any, prompts: list[list[int]], settings: Any) -> tuple[Phases, list[list[int]]]:
    """Every prompt once through the eval's loop; `drafter` None: plain decoding (NoDrafter)."""
    from dflash.eval.specdec import NoDrafter, speculative_decode

    phases = Phases()
    method = TimedDraft(drafter, phases) if drafter is not None else NoDrafter()
    verifier = timed_verifier(target, drafter.layer_ids if drafter is not None else None, phases)
    outputs = []
    for prompt in prompts:
        with Timer(phases, "decode"):
            result = speculative_decode(verifier, method, prompt, settings)
        phases.steps += len(result.taus)
        phases.tokens += len(result.tokens)
        phases.accepted_plus_one += sum(result.taus)
        phases.prompts += 1
        outputs.append(result.tokens)
    return phases, outputs


def generate_pass(target: Any, prompts: list[list[int]], settings: Any) -> tuple[Phases, list[list[int]]]:
    """Every prompt once through transformers' `generate` (greedy, its DynamicCache); its prefill is
    estimated by one forward of the prompt keeping the last position's logits, timed apart."""
    import torch

    phases, outputs = Phases(), []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            with Timer(phases, "prefill-alone"):
                target(input_ids=ids, use_cache=True, logits_to_keep=1)
            with Timer(phases, "decode"):
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.max_new_tokens,
                                      do_sample=False, eos_token_id=list(settings.eos_ids), pad_token_id=settings.eos_ids[0])
        tokens = out[0, len(prompt):].tolist()
        phases.steps += max(0, len(tokens) - 1)
        phases.tokens += len(tokens)
        phases.prompts += 1
        outputs.append(tokens)
    phases.cpu["prefill"], phases.wall["prefill"] = phases.cpu["prefill-alone"], phases.wall["prefill-alone"]
    return phases, outputs


def best_ms(call: Callable[[], object], repeat: int = 9) -> float:
    """The least CPU time (this thread) of `repeat` calls, in ms."""
    spent = []
    for _ in range(repeat):
        started = time.thread_time()
        call()
        spent.append(time.thread_time() - started)
    return 1000 * min(spent)


def forward_alone(target: Any, prompt: list[int], block: int) -> str:
    """The target on 1 and on `block` tokens after the prompt's cache (cropped back each time), and its lm_head."""
    import torch

    from dflash.eval.target_cache import crop_attention, output_cache

    with torch.inference_mode():
        cache = output_cache(target(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1))
        length = len(prompt)

        def forward(count: int) -> None:
            ids = torch.arange(1000, 1000 + count)[None]
            positions = torch.arange(length, length + count)[None]
            target(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
            crop_attention(cache, length)

        head = target.get_output_embeddings()
        hidden = torch.randn(block, target.config.hidden_size)
        one, many = best_ms(lambda: forward(1)), best_ms(lambda: forward(block))
        head_one, head_many = best_ms(lambda: head(hidden[:1])), best_ms(lambda: head(hidden))
    return (f"one forward alone (CPU, best of 9) after {length} tokens: 1 token {one:.1f} ms, {block} tokens {many:.1f} ms ({many / one:.2f}x); "
            f"lm_head 1 row {head_one:.1f} ms, {block} rows {head_many:.1f} ms")


def load_drafter(profile: Any, target: Any, checkpoint: str) -> Any:
    from dflash.eval.dflash_drafter import DFlashDraft, load_dflash_draft
    from dflash.train.rank.setup import build_drafter, resolve_layer_ids

    if checkpoint:
        return load_dflash_draft(checkpoint, target)
    count = target.config.num_hidden_layers
    vocab = list(range(profile.drafter.draft_vocab_size)) or None
    model = build_drafter(profile, target, resolve_layer_ids(profile, count), count, vocab).eval()
    return DFlashDraft(model=model)


def encoded_prompts(profile: Any, count: int) -> list[list[int]]:
    from dflash.eval.evaluate import encode_prompts
    from dflash.eval.options import DEFAULT_EVAL_PROMPTS
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for

    tokenizer = load_tokenizer(tokenizer_dir_for(profile))
    return [p.token_ids for p in encode_prompts(tokenizer, DEFAULT_EVAL_PROMPTS, count, profile.generate.thinking)]


def report(name: str, phases: Phases, plain: Phases) -> str:
    step, plain_step = phases.per_step_ms(phases.loop()), plain.per_step_ms(plain.loop())
    tau = phases.accepted_plus_one / max(1, phases.steps)
    part = lambda name: phases.per_step_ms(phases.cpu.get(name, 0.0))  # noqa: E731
    return (f"{name}: {phases.steps} steps, tau {tau:.3f}; CPU {step:.1f} ms a step = draft {part('draft'):.1f} "
            f"+ verify {part('verify'):.1f} + rollback {part('rollback'):.2f} + rest {phases.per_step_ms(phases.rest()):.1f}"
            f" = {step / plain_step:.2f}x a plain step ({plain_step:.1f} ms); prefill "
            f"{1000 * phases.cpu.get('prefill', 0.0) / max(1, phases.prompts):.0f} ms a prompt; "
            f"{phases.tokens_per_s():.2f} tokens per CPU second, speedup {phases.tokens_per_s() / plain.tokens_per_s():.3f}x "
            f"(wall: {phases.per_step_ms(phases.loop('wall')):.1f} ms a step, speedup "
            f"{phases.tokens_per_s('wall') / plain.tokens_per_s('wall'):.3f}x)")


def main() -> int:
    import torch

    from dflash.eval.evaluate import stop_token_ids
    from dflash.eval.specdec import DecodeSettings
    from dflash.target_model import load_target, resolve_model_path
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for
    from launcher_core.profile import load_profile

    args = parse_args()
    profile = load_profile("cpu-demo")
    threads = args.threads or profile.eval.cpu_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    target = load_target(resolve_model_path(profile.model.target), dtype=profile.model.dtype)
    drafter = load_drafter(profile, target, args.draft)
    matmul = args.cpu_matmul or getattr(profile.eval, "cpu_matmul", "torch")
    if matmul == "auto":
        from dflash.eval.cpu_kernels import use_fast_cpu_linears

        drafter.model.requires_grad_(False)
        use_fast_cpu_linears(target), use_fast_cpu_linears(drafter.model), use_fast_cpu_linears(drafter.head())
    prompts = encoded_prompts(profile, args.prompts)
    eos = stop_token_ids(load_tokenizer(tokenizer_dir_for(profile)), target)
    settings = DecodeSettings(block_size=drafter.block_size, max_new_tokens=args.new_tokens, eos_ids=eos)
    print(f"cpu-demo sizes: SmolLM2-135M float32, {len(drafter.model.layers)}-layer drafter, block {drafter.block_size}, "
          f"{'checkpoint ' + args.draft if args.draft else 'untrained drafter'}; {len(prompts)} prompts x "
          f"{args.new_tokens} new tokens, {threads} thread(s), linear layers: {matmul}, best of {args.repeat}; "
          f"load {os.getloadavg()[0]:.1f}")
    variants = {}
    if "draft_tokens" not in {field.name for field in dataclasses.fields(drafter)}:     # code before eval.draft_tokens
        args.draft_tokens, args.full_block = str(drafter.block_size - 1), True
    default_k = getattr(profile.eval, "draft_tokens", 0)
    for k in [int(k) for k in args.draft_tokens.split(",")] if args.draft_tokens else [default_k]:
        proposed = min(k or drafter.block_size - 1, drafter.block_size - 1)
        name = f"dflash k={proposed}" + (" (whole block drafted)" if args.full_block else "")
        variant = dataclasses.replace(drafter, _cache=None, **({} if args.full_block else {"draft_tokens": proposed}))
        variants[name] = (variant, dataclasses.replace(settings, block_size=proposed + 1) if args.full_block else settings)
    for variant, variant_settings in variants.values():     # warm-up: one-off costs out of the timings
        decode_pass(target, variant, prompts[:1], variant_settings)
    runs: dict[str, Callable[[], tuple[Phases, list[list[int]]]]] = {
        "loop": lambda: decode_pass(target, None, prompts, settings),
        "generate": lambda: generate_pass(target, prompts, settings)}
    for name, (variant, variant_settings) in variants.items():
        runs[name] = lambda variant=variant, variant_settings=variant_settings: decode_pass(target, variant, prompts,
                                                                                           variant_settings)
    best: dict[str, Phases] = {}
    outputs: dict[str, list[list[int]]] = {}
    cpu_started = time.process_time()
    for _ in range(args.repeat):
        for name, run in runs.items():
            phases, outputs[name] = run()
            if name not in best or phases.cpu["decode"] < best[name].cpu["decode"]:
                best[name] = phases
    cpu_s = time.process_time() - cpu_started
    for name in outputs:
        assert outputs[name] == outputs["loop"], f"{name}'s output differs from plain decoding's"
    plain = min(("loop", "generate"), key=lambda name: best[name].cpu["decode"])
    for name in ("loop", "generate"):
        phases = best[name]
        how = "the eval loop (TargetVerifier + NoDrafter)" if name == "loop" else "transformers generate"
        print(f"plain decoding, {how}: CPU {phases.per_step_ms(phases.loop()):.1f} ms a token after the prefill "
              f"({1000 * phases.cpu['prefill'] / max(1, phases.prompts):.0f} ms a prompt), {phases.tokens_per_s():.2f} "
              f"tokens per CPU second; wall {phases.per_step_ms(phases.loop('wall')):.1f} ms a token"
              f"{' (the baseline)' if name == plain else ''}")
    for name in variants:
        print(report(name, best[name], best[plain]) + "; output identical to plain decoding")
    print(forward_alone(target, prompts[0], drafter.block_size))
    print(f"CPU time of the timed passes: {cpu_s:.0f} s; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
