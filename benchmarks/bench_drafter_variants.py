"""Which drafter set-up learns fastest on the CPU demo: trained in-process, measured by greedy tau.

    .venv/bin/python benchmarks/bench_drafter_variants.py --run-dir runs/cpu-demo [--steps 300]
        [--variants target-3L-vocab,...] [--sets everyday,indist]

Needs a run directory whose `dataset/` the tokenize stage wrote (the pipeline leaves one). The
target's tap features of every row are extracted once and kept in memory; each variant then
trains a fresh drafter for `--steps` steps (8 sequences x 16 anchors, AdamW, warmup + cosine,
the trainer's own loss and targets) on one process. Held-out: the first `--heldout` prompts of
each set in `--sets` (everyday: `dflash/prompts/everyday_prompts.jsonl`, the out-of-template set
`eval` uses by default; indist: `dflash/prompts/indist_prompts.jsonl`, held-out entries of the
training prompts' bank), continued greedily by the target for 48 tokens. Each
drafter drafts at every position of those continuations (teacher-forced, as speculative
decoding sees them) and the greedy decoding walk over them gives tau = tokens / steps, the
figure `launcher.py eval` reports; prompt lookup is walked the same way.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

VARIANTS = {
    "random-1L": {"layers": 1, "init": "random", "vocab": 0, "lr": 3e-3, "norm_init": 0.25},
    "target-1L": {"layers": 1, "init": "target", "vocab": 0, "lr": 1e-3, "norm_init": 1.0},
    "target-3L": {"layers": 3, "init": "target", "vocab": 0, "lr": 1e-3, "norm_init": 1.0},
    "target-3L-vocab": {"layers": 3, "init": "target", "vocab": 4096, "lr": 1e-3, "norm_init": 1.0},
    "target-3L-vocab8k": {"layers": 3, "init": "target", "vocab": 8192, "lr": 1e-3, "norm_init": 1.0},
    "target-3L-vocab-lr2e-3": {"layers": 3, "init": "target", "vocab": 4096, "lr": 2e-3, "norm_init": 1.0},
    "target-3L-vocab-lr3e-4": {"layers": 3, "init": "target", "vocab": 4096, "lr": 3e-4, "norm_init": 1.0},
    "target-3L-vocab-lr3e-3": {"layers": 3, "init": "target", "vocab": 4096, "lr": 3e-3, "norm_init": 1.0},
    "target-2L-vocab": {"layers": 2, "init": "target", "vocab": 4096, "lr": 1e-3, "norm_init": 1.0},
    "target-3L-vocab-32anchors": {"layers": 3, "init": "target", "vocab": 4096, "lr": 1e-3, "norm_init": 1.0,
                                  "anchors": 32},
    "target-3L-vocab-lr2e-3-32anchors": {"layers": 3, "init": "target", "vocab": 4096, "lr": 2e-3, "norm_init": 1.0,
                                         "anchors": 32},
    "target-3L-vocab-lr2e-3-gamma1.5": {"layers": 3, "init": "target", "vocab": 4096, "lr": 2e-3, "norm_init": 1.0,
                                        "gamma": 1.5},
    "target-3L-vocab-lr2e-3-frozen-mlp": {"layers": 3, "init": "target", "vocab": 4096, "lr": 2e-3, "norm_init": 1.0,
                                          "freeze": ".mlp."},
}
SETS = {"everyday": "everyday_prompts.jsonl", "indist": "indist_prompts.jsonl"}
TAP, BLOCK, BATCH, ANCHORS, NEW_TOKENS = 26, 8, 8, 16, 48
GAMMA = 4.0  # the loss decay the trainer uses for block 8 (dflash.drafter.decay.default_gamma)


@dataclass
class Sequence:
    ids: list[int]
    mask: list[int]


def load_rows(table: Any) -> list[Sequence]:
    return [Sequence(list(r["input_ids"]), list(r["loss_mask"])) for r in table]


def heldout_sequences(target, tokenizer, path: Path, count: int) -> list[Sequence]:
    """Held-out prompt + the target's own greedy continuation (loss mask on the continuation)."""
    import torch

    from dflash.eval.evaluate import encode_prompts

    out = []
    for encoded in encode_prompts(tokenizer, path, count, thinking=False):
        prompt = list(encoded.token_ids)
        with torch.no_grad():
            full = target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
        out.append(Sequence(full, [0] * len(prompt) + [1] * (len(full) - len(prompt))))
    return out


def tap_features(target, rows: list[Sequence]) -> list:
    import torch

    from dflash.drafter.taps import extract_taps

    return [extract_taps(target, torch.tensor([r.ids]), [TAP])[0] for r in rows]


def padded(features: list, chosen: list[int], width: int):
    import torch

    out = torch.zeros(len(chosen), width, features[0].shape[-1])
    for i, row in enumerate(chosen):
        out[i, : features[row].shape[0]] = features[row]
    return out


def build(target, variant: dict, vocab: list[int] | None):
    """The trainer's own drafter construction, on the cpu-demo profile with the variant's settings."""
    import dataclasses

    from dflash.train.setup import build_drafter
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    drafter_settings = dataclasses.replace(profile.drafter, num_layers=variant["layers"], target_layer_ids=(TAP,),
                                           block_size=BLOCK, init=variant["init"], norm_init=variant["norm_init"],
                                           draft_vocab_size=variant["vocab"])
    profile = dataclasses.replace(profile, drafter=drafter_settings)
    return build_drafter(profile, target, [TAP], target.config.num_hidden_layers, vocab)


def train(drafter, rows: list[Sequence], features: list, steps: int, lr: float, anchors: int = ANCHORS,
          gamma: float = GAMMA, after_step=None) -> float:
    """Train `steps` steps; `after_step(n)` is called after step n (n = 1..steps), its time not counted."""
    import numpy as np
    import torch

    from dflash.drafter.loss import block_loss, decay_weights
    from dflash.drafter.model import forward_blocks
    from dflash.train.data import collate_rows
    from dflash.train.optim import cosine_schedule
    from dflash.train.step import step_targets

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = cosine_schedule(optimizer, steps, warmup_ratio=0.04)
    decay, per_epoch = decay_weights(BLOCK, gamma), len(rows) // BATCH
    started = time.perf_counter()
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([0, epoch]).permutation(len(rows))
        chosen = [int(r) for r in order[index * BATCH:(index + 1) * BATCH]]
        batch = collate_rows([rows[r].ids for r in chosen], [rows[r].mask for r in chosen], chosen, anchors, 0, epoch)
        features_batch = padded(features, chosen, batch.input_ids.shape[1])
        hidden = forward_blocks(drafter, batch.input_ids, batch.anchors, features_batch, "sdpa")
        parts = block_loss(hidden, drafter.logits, step_targets(drafter, batch), decay)
        optimizer.zero_grad(set_to_none=True)
        (parts.weighted_ce / parts.weight_sum.clamp(min=1e-9)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if after_step is not None:
            paused = time.perf_counter()
            after_step(step + 1)
            started += time.perf_counter() - paused
    return time.perf_counter() - started


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


def drafter_tau(drafter, heldout: list[Sequence], features: list) -> tuple[float, list[float]]:
    import torch

    from dflash.drafter.model import forward_blocks

    tokens = steps = 0
    reached = [0] * (BLOCK - 1)
    drafts = 0
    with torch.no_grad():
        for row, seq in enumerate(heldout):
            first = seq.mask.index(1) - 1          # the anchor before the first new token
            anchors = list(range(first, len(seq.ids) - 1))
            hidden = forward_blocks(drafter, torch.tensor([seq.ids]), torch.tensor([anchors]), features[row][None],
                                    "sdpa")
            picked = drafter.token_ids(drafter.logits(hidden[0, :, 1:]).argmax(dim=-1)).tolist()
            accepted_at = {}
            for anchor, proposal in zip(anchors, picked):
                k = accepted(proposal, seq.ids[anchor + 1:anchor + BLOCK])
                accepted_at[anchor] = k
                for slot in range(k):
                    reached[slot] += 1
                drafts += 1
            count = len(seq.ids) - 1 - first
            tokens, steps = tokens + count, steps + walk_steps(first, count, accepted_at)
    return tokens / steps, [round(r / drafts, 3) for r in reached]


def prompt_lookup_tau(heldout: list[Sequence]) -> float:
    from dflash.eval.prompt_lookup import lookup_continuation

    tokens = steps = 0
    for seq in heldout:
        first = seq.mask.index(1) - 1
        accepted_at = {a: accepted(lookup_continuation(seq.ids[:a + 1], BLOCK - 1), seq.ids[a + 1:a + BLOCK])
                       for a in range(first, len(seq.ids) - 1)}
        count = len(seq.ids) - 1 - first
        tokens, steps = tokens + count, steps + walk_steps(first, count, accepted_at)
    return tokens / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a run directory with dataset/ (after tokenize)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--heldout", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--sets", default=",".join(SETS), help=f"held-out sets, comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--eval-at", default="", help="also measure tau after these steps (comma-separated), "
                        "within the one run of --steps (same schedule)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.drafter.draft_vocab import count_loss_tokens
    from dflash.models import resolve_model_path

    torch.set_num_threads(2)
    path = resolve_model_path("builtin:smollm2-135m-instruct")
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    import datasets

    table = datasets.load_from_disk(str(args.run_dir / "dataset")).with_format(None)
    rows = load_rows(table)
    started = time.perf_counter()
    prompts_dir = REPO_ROOT / "dflash" / "prompts"
    heldout = {name: heldout_sequences(target, tokenizer, prompts_dir / SETS[name], args.heldout)
               for name in args.sets.split(",")}
    train_features = tap_features(target, rows)
    heldout_features = {name: tap_features(target, seqs) for name, seqs in heldout.items()}
    print(f"{len(rows)} training rows ({sum(sum(r.mask) for r in rows)} loss tokens), held-out "
          f"{', '.join(f'{name} {len(seqs)}' for name, seqs in heldout.items())} prompts x {NEW_TOKENS} greedy "
          f"tokens; features in {time.perf_counter() - started:.0f} s", flush=True)
    counts = count_loss_tokens(table, 10**9)
    for name, seqs in heldout.items():
        print(f"prompt lookup            {name:<9} tau {prompt_lookup_tau(seqs):.3f}", flush=True)
    for name in args.variants.split(","):
        run_variant(name, VARIANTS[name], target, (rows, train_features, counts), heldout, heldout_features, args.steps,
                    {int(s) for s in args.eval_at.split(",") if s})
    return 0


def run_variant(name: str, variant: dict, target, training: tuple, heldout: dict, heldout_features: dict,
                steps: int, eval_at: set[int]) -> None:
    """Train one variant and print its tau on every held-out set (also after each step in `eval_at`)."""
    from dflash.drafter.draft_vocab import draft_vocabulary

    rows, train_features, counts = training
    vocab = draft_vocabulary(counts, variant["vocab"]) if variant["vocab"] else None
    drafter = build(target, variant, vocab)
    if variant.get("freeze"):   # keep these copied target weights as they are: fewer parameters to overfit with
        for parameter_name, parameter in drafter.named_parameters():
            if variant["freeze"] in parameter_name:
                parameter.requires_grad_(False)

    def report(step: int, note: str = "") -> None:
        drafter.eval()
        for set_name, seqs in heldout.items():
            tau, reached = drafter_tau(drafter, seqs, heldout_features[set_name])
            print(f"{name:<24} {set_name:<9} tau {tau:.3f}  reached slot 1..7 {reached}  step {step}{note}", flush=True)
        drafter.train()

    if 0 in eval_at:
        report(0)
    seconds = train(drafter, rows, train_features, steps, variant["lr"], variant.get("anchors", ANCHORS),
                    variant.get("gamma", GAMMA), lambda step: report(step) if step in eval_at and step != steps else None)
    report(steps, f", {steps} steps in {seconds:.0f} s ({seconds / steps:.2f} s/step)")


if __name__ == "__main__":
    sys.exit(main())
