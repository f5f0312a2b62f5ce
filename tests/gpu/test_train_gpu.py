"""Online training on a GPU through the trainer's own entry point (`build_state` + `run_step`):
a random Qwen3 (`build_tiny_target`, hidden 128, 6 layers) with the real Qwen3 tokenizer, its
lm_head scaled x8 so its logits are peaked like a trained model's (a random init gives
near-uniform logits); rows are a prompt without loss followed by a 50-word cycle in real token
ids. 60 steps in bf16 through flex_attention: finite losses, and the mean loss of the last 5
steps more than 0.5 nats below the first 5. Then flex vs SDPA on the same batch and weights:
relative loss difference <= 2e-2 (bf16), drafter gradients with cosine >= 0.99 and relative L2
difference <= 0.1. (On a CPU the same comparison in float32 is tests/train/test_drafter.py.)"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

TRAIN_STEPS, TRAIN_ROWS, TRAIN_BLOCK, TRAIN_ANCHORS, TRAIN_LR = 60, 64, 8, 32, 1e-2
LOSS_DROP_NATS = 0.5
LM_HEAD_SCALE = 8.0
CYCLE_WORDS = ("apple river stone cloud window garden silver forest candle bridge ocean mirror pencil "
               "thunder basket rocket violin meadow lantern castle harbor feather puzzle orchard tunnel "
               "compass blanket dragon island ladder marble needle parrot quartz saddle tiger umbrella "
               "velvet walnut yellow zebra anchor barrel copper desert engine falcon glacier hammer igloo").split()


def cycle_token_ids(tokenizer_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = [tokenizer(" " + word, add_special_tokens=False)["input_ids"][0] for word in CYCLE_WORDS]
    return list(dict.fromkeys(ids))


def pattern_rows(cycle: list[int], count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """A prompt (no loss) then the cycle from a random start: learnable from the context."""
    rng, rows = random.Random(seed), []
    for _ in range(count):
        length, prompt, start = rng.randint(96, 160), rng.randint(8, 24), rng.randrange(len(cycle))
        rows.append(([cycle[(start + j) % len(cycle)] for j in range(length)], [0] * prompt + [1] * (length - prompt)))
    return rows


@pytest.fixture(scope="module")
def state(tiny_target, tokenizer_dir, tmp_path_factory) -> Any:
    import torch
    from gpu_helpers import gpu_profile

    from dflash.data.dataset_io import save_token_rows
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state

    work = tmp_path_factory.mktemp("train-gpu")
    dataset = save_token_rows(work / "dataset", pattern_rows(cycle_token_ids(tokenizer_dir), TRAIN_ROWS))
    profile = gpu_profile(tiny_target, dataset, max_length=256, drafter_layers=2, block_size=TRAIN_BLOCK,
                          num_anchors=TRAIN_ANCHORS, lr=TRAIN_LR, max_micro_batch=4)
    state = build_state(profile, work / "run", WorkerEnv(0, 1, 0), resume=False, planned_micro_batch=4)
    with torch.no_grad():
        state.target.lm_head.weight.mul_(LM_HEAD_SCALE)       # the drafter shares the target's lm_head
    return state


@pytest.fixture(scope="module")
def losses(state, record) -> list[float]:
    from dflash.memory.budget import batch_plan
    from dflash.train.rank.step import run_step

    losses, slot1, started = [], [], time.perf_counter()
    for step in range(TRAIN_STEPS):
        state.step = step
        epoch, rows = state.data.step_rows(step)
        stats = run_step(state, rows, epoch, batch_plan(len(rows), 1, state.micro_batch))
        losses.append(stats.loss)
        slot1.append(round(stats.acc[0], 4) if math.isfinite(stats.acc[0]) else None)
    record.figure(train_losses=[round(x, 4) for x in losses], train_slot1_accuracy=slot1,
                  train_s=round(time.perf_counter() - started, 1), train_backend=state.backend, train_steps=TRAIN_STEPS)
    return losses


def test_bf16_flex_training_runs(state, losses, record):
    assert record.check("bf16 flex_attention training runs", state.backend == "flex" and len(losses) == TRAIN_STEPS,
                        f"backend {state.backend}, {len(losses)} steps")


def test_losses_are_finite_and_fall(losses, record):
    head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    finite = record.check("losses finite", all(math.isfinite(x) for x in losses), f"{len(losses)} steps")
    fell = record.check(f"loss falls by > {LOSS_DROP_NATS} nats", tail < head - LOSS_DROP_NATS,
                        f"mean of first 5 steps {head:.3f}, of last 5 {tail:.3f}")
    assert finite and fell


def loss_and_grads(state: Any, batch: Any, backend: str) -> tuple[float, Any]:
    """Normalised loss and the flattened drafter gradient of one batch through `backend`."""
    import torch

    from dflash.train.rank.step import forward_micro

    state.backend = backend
    state.optimizer.zero_grad(set_to_none=True)
    parts = forward_micro(state, batch)
    loss = parts.weighted_ce / parts.weight_sum
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in state.drafter.parameters() if p.grad is not None])
    state.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_flex_and_sdpa_agree_on_loss_and_gradients(state, losses, record):
    import torch

    batch = state.data.collate(list(range(4)), 0)
    flex_loss, flex_grads = loss_and_grads(state, batch, "flex")
    sdpa_loss, sdpa_grads = loss_and_grads(state, batch, "sdpa")
    state.backend = "flex"
    rel = abs(flex_loss - sdpa_loss) / abs(sdpa_loss)
    cosine = float(torch.nn.functional.cosine_similarity(flex_grads, sdpa_grads, dim=0))
    rel_l2 = float((flex_grads - sdpa_grads).norm() / sdpa_grads.norm())
    record.figure(flex_vs_sdpa={"flex_loss": round(flex_loss, 6), "sdpa_loss": round(sdpa_loss, 6),
                                "loss_rel_diff": round(rel, 6), "grad_cosine": round(cosine, 6),
                                "grad_rel_l2": round(rel_l2, 6)})
    same_loss = record.check("flex vs SDPA loss", rel <= 2e-2, f"{flex_loss:.5f} vs {sdpa_loss:.5f} (rel {rel:.2e} <= 0.02)")
    same_grads = record.check("flex vs SDPA gradients", cosine >= 0.99 and rel_l2 <= 0.1,
                              f"cosine {cosine:.5f} >= 0.99, relative L2 {rel_l2:.3e} <= 0.1")
    record.set_summary(f"{len(losses)} steps bf16 flex: loss {losses[0]:.3f} -> {losses[-1]:.3f}; flex vs SDPA (bf16) "
                       f"loss rel diff {rel:.1e}, grad cosine {cosine:.4f}")
    assert same_loss and same_grads
