"""Which drafter set-up learns fastest on the CPU demo: trained by the trainer, measured by greedy tau.

    .venv/bin/python benchmarks/bench_drafter_variants.py --run-dir runs/cpu-demo [--steps N]
        [--variants cpu-demo,gamma4,...] [--sets everyday,indist] [--eval-at 0,325]
    .venv/bin/python benchmarks/bench_drafter_variants.py --smoke      (the smallest setting: the test suite's)

Needs a run directory whose `dataset/` the tokenize stage wrote (the pipeline leaves one); it is
only read. Each variant is the cpu-demo profile with a few drafter / train settings changed
(VARIANTS; `cpu-demo` is the profile as it is) and trains in one process (2 threads) through the
trainer's own `build_state` and `run_step`: its data order, anchors, loss decay
(train.decay_gamma), micro-batches, AdamW, schedule and feature cache (train.feature_cache), in a
scratch run directory. `--steps` defaults to the profile's schedule (train.epochs). Held-out: the
first `--heldout` prompts of each set in `--sets` (everyday: `dflash/prompts/everyday_prompts.jsonl`,
the out-of-template set `eval` uses by default; indist: `dflash/prompts/indist_prompts.jsonl`,
held-out entries of the training prompts' bank), continued greedily by the target for
eval.max_new_tokens tokens. Each drafter drafts at every position of those continuations
(teacher-forced, as speculative decoding sees them) and the greedy decoding walk over them gives
tau = tokens / steps, the figure `launcher.py eval` reports; prompt lookup is walked the same way.
A DFlash 2 variant is measured twice: its selector's path (the name) and its unary argmax
(`NAME/unary`): the selector's lift is the difference.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

if TYPE_CHECKING:

    from dflash.train.rank.setup import TrainState
    from dflash.train.rank.step import StepStats
    from launcher_core.schema import Profile

PROFILE = "cpu-demo"
# Each variant: the [drafter] / [train] settings that differ from the cpu-demo profile ("freeze": a
# parameter-name part whose weights stay at their start, the copied target's).
VARIANTS: dict[str, dict[str, Any]] = {
    "cpu-demo": {},
    "gamma4": {"train": {"decay_gamma": 4.0}},                      # block 8's default decay
    "lr1e-3": {"train": {"lr": 1e-3}},
    "lr3e-3": {"train": {"lr": 3e-3}},
    "vocab8k": {"drafter": {"draft_vocab_size": 8192}},
    "full-vocab": {"drafter": {"draft_vocab_size": 0}},
    "2-layers": {"drafter": {"num_layers": 2}},
    "1-layer": {"drafter": {"num_layers": 1, "draft_vocab_size": 0}, "train": {"lr": 1e-3}},
    "random-1-layer": {"drafter": {"num_layers": 1, "init": "random", "norm_init": 0.25, "draft_vocab_size": 0},
                       "train": {"lr": 3e-3}},                       # the first demo drafter
    "32-anchors": {"train": {"num_anchors": 32}},
    "frozen-mlp": {"freeze": ".mlp."},
    # DFlash 2 (drafter.kind = "dflash2", its published kernel / groups / rank / top K; the whole vocabulary, as
    # it needs): measured twice, its selector's path (`dflash2`) and its unary argmax (`dflash2/unary`).
    # `full-vocab` is the DFlash drafter with the same head.
    "dflash2": {"drafter": {"kind": "dflash2", "draft_vocab_size": 0}},
    "dflash2-stopgrad": {"drafter": {"kind": "dflash2", "draft_vocab_size": 0}, "train": {"selector_stop_gradient": True}},
}
SMOKE = {"steps": 2, "heldout": 1, "new_tokens": 4, "variants": "cpu-demo", "sets": "everyday", "eval_at": "1"}
SMOKE_ROWS, SMOKE_TOKENS, SMOKE_LOSS_TOKENS = 8, 32, 6


@dataclass
class Sequence:
    ids: list[int]
    mask: list[int]


@dataclass
class Heldout:
    """One held-out set: prompt + the target's greedy continuation (loss mask on the continuation)."""

    name: str
    sequences: list[Sequence]


def prompt_sets() -> dict[str, Path]:
    """The held-out sets `eval` knows: the default out-of-template one and the in-distribution one."""
    from dflash.eval.options import DEFAULT_EVAL_PROMPTS, INDIST_EVAL_PROMPTS

    return {"everyday": DEFAULT_EVAL_PROMPTS, "indist": INDIST_EVAL_PROMPTS}


def heldout_sequences(target: Any, tokenizer: Any, path: Path, count: int, new_tokens: int) -> list[Sequence]:
    from dflash.eval.evaluate import encode_prompts

    return greedy_continuations(target, [list(e.token_ids) for e in encode_prompts(tokenizer, path, count, thinking=False)],
                                new_tokens)


def greedy_continuations(target: Any, prompts: list[list[int]], new_tokens: int) -> list[Sequence]:
    """Each prompt (token ids) continued greedily by the target; the loss mask on the continuation."""
    import torch

    out = []
    for prompt in prompts:
        with torch.no_grad():
            full = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0].tolist()
        out.append(Sequence(full, [0] * len(prompt) + [1] * (len(full) - len(prompt))))
    return out


def variant_profile(base: Profile, variant: dict[str, Any], dataset: Path, run_dir: Path, steps: int) -> Profile:
    """cpu-demo with the variant's settings, on one process, reading `dataset`, writing `run_dir`; every
    row of `dataset` trains (the benchmark holds out its own rows, and measures them itself)."""
    sections = {name: dataclasses.replace(getattr(base, name), **variant.get(name, {})) for name in ("drafter", "train")}
    profile = dataclasses.replace(base, **sections)
    return dataclasses.replace(
        profile, machine=dataclasses.replace(profile.machine, nproc_per_node=1),
        paths=dataclasses.replace(profile.paths, dataset=str(dataset), run_dir=str(run_dir)),
        train=dataclasses.replace(profile.train, max_steps=steps or profile.train.max_steps, validation_share=0.0))


def build_variant_state(profile: Profile, run_dir: Path, variant: dict[str, Any]) -> TrainState:
    """The trainer's state (`build_state`), with the variant's frozen weights taken out of training."""
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state

    state = build_state(profile, run_dir, WorkerEnv(0, 1, 0), resume=False)
    if variant.get("freeze"):      # no gradient, so AdamW and the clipping leave them as they are
        for name, parameter in state.drafter.named_parameters():
            if variant["freeze"] in name:
                parameter.requires_grad_(False)
    return state


FILL_ROWS = 8     # rows per target forward while filling the feature cache (any size: features are per row)


def fill_feature_cache(state: TrainState) -> None:
    """Every row's tap features into the run's feature cache before timing (the variants share it)."""
    from dflash.drafter.taps import extract_taps

    if state.feature_cache is None:
        return
    rows = list(range(len(state.data.dataset)))
    for first in range(0, len(rows), FILL_ROWS):
        batch = state.data.collate(rows[first:first + FILL_ROWS], 0)
        state.feature_cache.features(batch, lambda ids: extract_taps(state.target, ids, state.layer_ids))


def train(state: TrainState, after_step: Callable[[int, StepStats], None]) -> float:
    """The trainer's steps up to its total (the worker's loop without checkpoints and metrics);
    `after_step(n, stats)` runs after step n, its time not counted. Returns the training seconds."""
    from dflash.train.rank.step import run_next_step

    spent = 0.0
    while state.step < state.total_steps:
        started = time.perf_counter()
        stats, _ = run_next_step(state)
        spent += time.perf_counter() - started
        after_step(state.step, stats)
    return spent


def loss_line(name: str, step: int, stats: StepStats) -> str:
    """One point of a variant's training curve: the loss and the training batch's simulated tau (accepted
    + 1, as eval counts it); for DFlash 2 also its selector's figures (dflash.drafter.loss)."""
    line = f"loss {name:<20} step {step:>5}  loss {stats.loss:.4f}  sim_tau {stats.sim_tau:.3f}"
    if stats.selector is not None:
        line += "".join(f"  {key} {value:.4f}" for key, value in stats.selector.to_json().items()
                        if isinstance(value, float))
    return line


def walk_steps(first: int, count: int, accepted_at: dict[int, int]) -> int:
    """Greedy decoding over the reference continuation: speculative steps for `count` tokens."""
    position, end, steps = first, first + count, 0
    while position < end:
        position += accepted_at.get(position, 0) + 1
        steps += 1
    return steps


def accepted(proposal: list[int], truth: list[int]) -> int:
    k = 0
    while k < min(len(proposal), len(truth)) and proposal[k] == truth[k]:
        k += 1
    return k


def drafter_taus(state: TrainState, heldout: Heldout, kinds: list[str]) -> dict[str, tuple[float, list[float]]]:
    """tau of the state's drafter over the set, and the share of drafts reaching each slot, for each of
    `kinds`: "head" (the head's argmax; a DFlash 2 drafter's unary argmax) or "selector" (a DFlash 2
    drafter's path). One drafter forward per sequence serves every kind."""
    import torch

    block = state.drafter.block_size
    tokens = 0                                 # new tokens walked: each is one draft position too
    reached = {kind: [0] * (block - 1) for kind in kinds}
    walked = dict.fromkeys(kinds, 0)
    with torch.no_grad():
        for seq in heldout.sequences:
            first = seq.mask.index(1) - 1          # the anchor before the first new token
            count = len(seq.ids) - 1 - first
            proposals = block_proposals(state, seq, first, selector="selector" in kinds)
            for kind in kinds:
                accepted_at = {}
                for anchor, proposal in zip(range(first, len(seq.ids) - 1), proposals[kind]):
                    accepted_at[anchor] = k = accepted(proposal, seq.ids[anchor + 1:anchor + block])
                    for slot in range(k):
                        reached[kind][slot] += 1
                walked[kind] += walk_steps(first, count, accepted_at)
            tokens += count
    return {kind: (tokens / walked[kind], [round(r / tokens, 3) for r in reached[kind]]) for kind in kinds}


def block_proposals(state: TrainState, seq: Sequence, first: int, selector: bool = True) -> dict[str, list[list[int]]]:
    """The drafter's block at every anchor from `first` on (the trainer's forward over all blocks): the
    head's argmax ("head"), and a DFlash 2 drafter's selector walk from each anchor ("selector")."""
    import torch

    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.drafter.network import forward_blocks
    from dflash.drafter.taps import extract_taps

    ids = torch.tensor([seq.ids])
    features = extract_taps(state.target, ids, state.layer_ids)
    anchors = list(range(first, len(seq.ids) - 1))
    hidden = forward_blocks(state.drafter, ids, torch.tensor([anchors]), features, state.backend)[0, :, 1:]
    logits = state.drafter.logits(hidden)
    drafts = {"head": state.drafter.token_ids(logits.argmax(dim=-1)).tolist()}
    if selector and isinstance(state.drafter, DFlash2Drafter):
        walker = state.drafter.selector
        drafts["selector"] = [walker.walk(logits[i], hidden[i], seq.ids[anchor]).tokens.tolist()
                              for i, anchor in enumerate(anchors)]
    return drafts


def prompt_lookup_tau(heldout: Heldout, block: int) -> float:
    from dflash.eval.prompt_lookup import lookup_continuation

    tokens = steps = 0
    for seq in heldout.sequences:
        first = seq.mask.index(1) - 1
        accepted_at = {a: accepted(lookup_continuation(seq.ids[:a + 1], block - 1), seq.ids[a + 1:a + block])
                       for a in range(first, len(seq.ids) - 1)}
        count = len(seq.ids) - 1 - first
        tokens, steps = tokens + count, steps + walk_steps(first, count, accepted_at)
    return tokens / steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="a run directory with dataset/ (after tokenize); read only")
    parser.add_argument("--steps", type=int, default=0, help="training steps (0: the profile's, train.epochs)")
    parser.add_argument("--heldout", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=0, help="greedy tokens per held-out prompt (0: eval.max_new_tokens)")
    parser.add_argument("--variants", default="", help=f"comma-separated, of {', '.join(VARIANTS)} (default: all; "
                        "--smoke: cpu-demo)")
    parser.add_argument("--sets", default="everyday,indist", help="held-out sets, comma-separated, of everyday, indist")
    parser.add_argument("--eval-at", default="", help="also measure tau after these steps (comma-separated), "
                        "within the one run of --steps (same schedule)")
    parser.add_argument("--profile", default=PROFILE, help="the base profile of every variant (flagship-twin: the "
                        "flagship's drafter on its CPU twin; --sets none there, its target is random)")
    parser.add_argument("--loss-every", type=int, default=0, help="print the training loss (and DFlash 2's selector "
                        "figures) every N steps: the loss curve of each variant")
    parser.add_argument("--save-dir", type=Path, default=None, help="keep each variant's trained drafter as a checkpoint "
                        "under DIR/VARIANT (the trainer's own save), for `launcher.py eval --draft` (speedup)")
    parser.add_argument("--smoke", action="store_true", help=f"the smallest setting: {SMOKE_ROWS} rows of "
                        f"{SMOKE_TOKENS} tokens written in the scratch directory, one thread, {SMOKE}")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update({key: value for key, value in SMOKE.items() if key != "variants" or not args.variants})
    elif args.run_dir is None:
        parser.error("--run-dir is required (or --smoke)")
    args.variants = args.variants or ",".join(VARIANTS)
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: {', '.join(unknown)} not one of {', '.join(VARIANTS)}")
    args.sets = "" if args.sets == "none" else args.sets
    if set(held_out_sets(args.sets)) - {"everyday", "indist"}:
        parser.error(f"--sets {args.sets}: each of everyday, indist (or none)")
    return args


def held_out_sets(names: str) -> list[str]:
    return [name for name in names.split(",") if name]


def smoke_dataset(tokenizer: Any, path: Path) -> Path:
    """SMOKE_ROWS rows of chat text (the in-distribution prompts, at most SMOKE_TOKENS), loss on the last few."""
    from dflash.data.dataset_io import save_token_rows
    from dflash.eval.evaluate import encode_prompts

    prompts = encode_prompts(tokenizer, prompt_sets()["indist"], SMOKE_ROWS, thinking=False)
    rows = [list(p.token_ids)[:SMOKE_TOKENS] for p in prompts]
    return save_token_rows(path, [(ids, [0] * (len(ids) - SMOKE_LOSS_TOKENS) + [1] * SMOKE_LOSS_TOKENS) for ids in rows])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from dflash.target_model import load_target, resolve_model_path
    from launcher_core.profile import load_profile

    torch.set_num_threads(1 if args.smoke else 2)
    base = load_profile(args.profile)
    path = resolve_model_path(base.model.target)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    new_tokens = args.new_tokens or base.eval.max_new_tokens
    with tempfile.TemporaryDirectory(prefix="bench-variants-") as scratch:
        dataset = smoke_dataset(tokenizer, Path(scratch) / "dataset") if args.smoke else args.run_dir / "dataset"
        started = time.perf_counter()
        target = load_target(path, dtype=base.model.dtype)
        sets = prompt_sets()
        heldout = [Heldout(name, heldout_sequences(target, tokenizer, sets[name], args.heldout, new_tokens))
                   for name in held_out_sets(args.sets)]
        del target
        print(f"held-out {', '.join(f'{h.name} {len(h.sequences)}' for h in heldout)} prompts x {new_tokens} greedy "
              f"tokens in {time.perf_counter() - started:.0f} s; training data {dataset}", flush=True)
        for held in heldout:
            print(f"{'prompt lookup':<24} {held.name:<9} tau {prompt_lookup_tau(held, base.drafter.block_size):.3f}",
                  flush=True)
        eval_at = {int(s) for s in args.eval_at.split(",") if s}
        for index, name in enumerate(args.variants.split(",")):
            profile = variant_profile(base, VARIANTS[name], dataset, Path(scratch) / "run", args.steps)
            run_variant(name, VARIANTS[name], profile, Path(scratch) / "run", heldout, eval_at, fill_cache=index == 0,
                        loss_every=args.loss_every, save_dir=args.save_dir)
    return 0


def run_variant(name: str, variant: dict[str, Any], profile: Profile, run_dir: Path, heldout: list[Heldout],
                eval_at: set[int], fill_cache: bool, loss_every: int = 0, save_dir: Path | None = None) -> None:
    """Train one variant and print its tau on every held-out set (also after each step in `eval_at`);
    with `save_dir`, its last step saved there as the trainer saves it (DIR/NAME/checkpoints/step-N)."""
    state = build_variant_state(profile, run_dir, variant)
    if fill_cache:
        started = time.perf_counter()
        fill_feature_cache(state)
        print(f"feature cache: {len(state.data.dataset)} rows in {time.perf_counter() - started:.0f} s", flush=True)

    selector = hasattr(state.drafter, "candidate_selector")
    kinds = {name: "selector", f"{name}/unary": "head"} if selector else {name: "head"}

    def report(step: int, note: str = "") -> None:
        state.drafter.eval()
        for held in heldout:
            taus = drafter_taus(state, held, list(kinds.values()))
            for label, kind in kinds.items():
                tau, reached = taus[kind]
                print(f"{label:<24} {held.name:<9} tau {tau:.3f}  reached slot 1..{len(reached)} {reached}  step {step}{note}",
                      flush=True)
        state.drafter.train()

    def after_step(step: int, stats: StepStats) -> None:
        if loss_every and (step % loss_every == 0 or step == state.total_steps):
            print(loss_line(name, step, stats), flush=True)
        if step in eval_at and step != state.total_steps:
            report(step)

    if 0 in eval_at:
        report(0)
    seconds = train(state, after_step)
    steps, gamma = state.total_steps, -1.0 / math.log(float(state.decay[1]))     # decay[k-1] = exp(-(k-1) / gamma)
    report(steps, f", {steps} steps in {seconds:.0f} s ({seconds / steps:.2f} s/step), the trainer's loss decay "
                  f"gamma {gamma:.2f}, lr {profile.train.lr:g}")
    if save_dir is not None:
        from dflash.train.rank.sharded_checkpoints import save_training_checkpoint

        print(f"{name}: saved {save_training_checkpoint(state, save_dir / name)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
