"""One optimizer step of online DFlash training, run inside each torchrun rank.

One optimizer step = `accum_steps` micro-batches of `micro_batch` sequences on every rank (a
`dflash.memory.plan.BatchPlan`; the same number of forward/backward calls everywhere). The loss
of the step is the weighted cross entropy summed over all ranks' micro-batches divided by the
GLOBAL weight sum (all_reduce SUM before any backward), so gradients do not depend on how the
batch is split, and the micro-batch may change between steps (`run_step` re-runs from the same
rows and anchors).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from dflash.drafter.loss import BlockTargets, LossParts, SelectorStats, block_targets, drafter_loss, figure_width, per_slot_accuracy, read_selector_stats, simulated_tau
from dflash.drafter.model import DFlashDrafter, forward_blocks
from dflash.train import dist
from dflash.train.data import MicroBatch

if TYPE_CHECKING:
    from dflash.memory.plan import BatchPlan
    from dflash.train.setup import TrainState

FAIL_RANK_ENV = "DFLASH_FAIL_RANK"       # fault injection for tests: "RANK:STEP" raises on that rank


@dataclass
class StepStats:
    loss: float
    acc: list[float]
    sim_tau: float
    tokens: int
    weight_sum: float
    seconds: float
    selector: SelectorStats | None = None      # DFlash 2: the selector's own figures (dflash.drafter.loss)


def step_targets(drafter: DFlashDrafter, batch: MicroBatch) -> BlockTargets:
    """Labels of every block slot, as columns of the drafter's logits; slots whose token is
    outside the draft vocabulary (drafter.draft_vocab_size) carry no loss."""
    targets = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.anchor_valid, drafter.block_size)
    labels, inside = drafter.draft_labels(targets.labels)
    return BlockTargets(labels=labels, label_mask=targets.label_mask * inside)


def micro_weight_sum(state: TrainState, batch: MicroBatch) -> float:
    return float((step_targets(state.drafter, batch).label_mask * state.decay.cpu()).sum())


def forward_micro(state: TrainState, batch: MicroBatch) -> LossParts:
    """Target taps (no grad, truncated forward) -> drafter over all blocks -> loss parts."""
    from dflash.drafter.taps import extract_taps

    batch = batch.to(state.device)
    if state.feature_cache is None:
        features = extract_taps(state.target, batch.input_ids, state.layer_ids)
    else:
        features = state.feature_cache.features(batch, lambda ids: extract_taps(state.target, ids, state.layer_ids))
    with autocast_context(state.device, state.autocast):
        hidden = forward_blocks(compute_model(state), batch.input_ids, batch.anchors, features, state.backend,
                                state.layer_attends)
        anchor_ids = torch.gather(batch.input_ids, 1, batch.anchors)
        parts = drafter_loss(state.drafter, hidden, step_targets(state.drafter, batch), anchor_ids, state.decay,
                             state.chunk_rows, state.selector)
    parts.weighted_ce = parts.weighted_ce + 0.0 * hidden.sum()   # keep every parameter in the graph
    return parts


def compute_model(state: TrainState) -> torch.nn.Module:
    """What the forward calls: the drafter (or its wrapper), or with train.compute_dtype = "bfloat16"
    the drafter on bf16 copies of its parameters (dflash.drafter.model.ComputeIn)."""
    if state.compute_dtype == "float32":
        return state.drafter
    from dflash.drafter.model import ComputeIn

    return ComputeIn(state.drafter, getattr(torch, state.compute_dtype))


def autocast_context(device: torch.device, setting: str = "auto") -> contextlib.AbstractContextManager[object]:
    """The drafter's forward: bf16 autocast on CUDA ("auto"), on CPU only with train.autocast = "bfloat16"."""
    if autocast_wanted(device.type, setting):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def autocast_wanted(device_type: str, setting: str = "auto") -> bool:
    return setting == "bfloat16" or (setting == "auto" and device_type == "cuda")


def run_next_step(state: TrainState) -> tuple[StepStats, int]:
    """The schedule's next optimizer step: this rank's rows of step `state.step` (dflash.train.data.TrainData),
    split by the current micro-batch, then `state.step` advances. Returns the step's figures and its epoch.
    The worker's loop and the training benchmarks step through this."""
    from dflash.memory.plan import batch_plan
    from dflash.train.data import TrainData

    data = state.data
    assert isinstance(data, TrainData), "the schedule's steps read the rank's dataset (build_state)"
    epoch, rows = data.step_rows(state.step)
    stats = run_step(state, rows, epoch, batch_plan(data.global_batch, state.env.world_size, state.micro_batch))
    state.step += 1
    return stats, epoch


def run_step(state: TrainState, rows: list[int], epoch: int, plan: BatchPlan) -> StepStats:
    """One optimizer step over this rank's `rows`, split as `plan` says. Re-runnable from the same rows.

    Collectives, identical on every rank: all_reduce(SUM) of the step's loss weight; the
    micro-batches' forward/backward (no collective); the gradient sum (in place, in buckets of
    `state.grad_bucket_mib`: dflash.train.dist.GradientSum); the update. With `state.autobatch` (dflash.train.autobatch.AutoBatch) the
    micro-batch is agreed across ranks and halved on all of them after an out-of-memory error.
    """
    started = time.perf_counter()
    local_weight = micro_weight_sum(state, state.data.collate(rows, epoch))
    global_weight = max(dist.global_weight(local_weight), 1e-12)
    finished: list[tuple[torch.Tensor, int]] = []      # (loss sums, tokens) of the pass that got through

    def accumulate(micro_batch: int) -> None:
        finished.append(accumulate_step(state, rows, epoch, micro_batch, global_weight))

    if state.autobatch is not None:
        state.micro_batch = state.autobatch.run_step(state.step + 1, accumulate, state.optimizer,
                                                     lambda: update(state)).micro_batch
    else:
        finished.append(plain_step(state, rows, epoch, plan.micro_batch, global_weight))
    sums, tokens = finished[-1]
    return step_stats(state, sums, tokens, time.perf_counter() - started)


def plain_step(state: TrainState, rows: list[int], epoch: int, micro_batch: int, global_weight: float,
               mark: Callable[[str], None] = lambda phase: None) -> tuple[torch.Tensor, int]:
    """The step without AutoBatch: micro-batches, gradient sum, update. `mark` names each phase as
    it starts (the memory trace, dflash.train.trace, keeps a peak per phase)."""
    mark("micro-batches")
    sums = accumulate_step(state, rows, epoch, micro_batch, global_weight)
    mark("gradient sum")
    sum_gradients(state)
    mark("update")
    update(state)
    return sums


def accumulate_step(state: TrainState, rows: list[int], epoch: int, micro_batch: int,
                    global_weight: float) -> tuple[torch.Tensor, int]:
    """Fresh gradients from every micro-batch of `rows` -> (loss sums, tokens)."""
    state.optimizer.zero_grad(set_to_none=True)
    batches = [state.data.collate(rows[i:i + micro_batch], epoch) for i in range(0, len(rows), micro_batch)]
    return accumulate_micro_batches(state, batches, global_weight), sum(b.tokens for b in batches)


def sum_gradients(state: TrainState) -> None:
    """The gradient sum over the ranks (identity on one process)."""
    dist.sync_gradients(state.drafter.parameters(), bucket_mib=state.grad_bucket_mib)


def update(state: TrainState) -> None:
    torch.nn.utils.clip_grad_norm_(state.drafter.parameters(), state.grad_clip)
    state.optimizer.step()
    state.scheduler.step()


def accumulate_micro_batches(state: TrainState, batches: list[MicroBatch], global_weight: float) -> torch.Tensor:
    """Forward/backward of each micro-batch, loss / GLOBAL weight; gradients stay local (summed later)."""
    selector = hasattr(state.drafter, "candidate_selector")
    totals = torch.zeros(figure_width(state.drafter.block_size, selector), dtype=torch.float64)
    for batch in batches:
        if state.autobatch is not None:
            state.autobatch.inject("forward")
        parts = forward_micro(state, batch)
        (parts.weighted_ce / global_weight).backward()
        totals += parts.figure_sums()
    return totals


def step_stats(state: TrainState, totals: torch.Tensor, tokens: int, local_seconds: float) -> StepStats:
    slots = state.drafter.block_size - 1
    reduced = dist.all_reduce_tensor(torch.cat([totals, torch.tensor([float(tokens)], dtype=torch.float64)]))
    acc = per_slot_accuracy(reduced[2:2 + slots], reduced[2 + slots:2 + 2 * slots])
    weight = float(reduced[1])
    return StepStats(loss=float(reduced[0]) / weight if weight else math.nan, acc=acc,
                     sim_tau=simulated_tau([0.0 if math.isnan(a) else a for a in acc]),
                     tokens=int(reduced[-1]), weight_sum=weight, seconds=local_seconds,
                     selector=read_selector_stats(reduced[:-1], state.drafter.block_size))


def maybe_inject_failure(rank: int, step: int) -> None:
    """Fault injection (tests, docs/train.md): DFLASH_FAIL_RANK=RANK:STEP raises on that rank;
    RANK:STEP:ATTEMPT only in that torchrun attempt (TORCHELASTIC_RESTART_COUNT), so a restart runs through."""
    spec = os.environ.get(FAIL_RANK_ENV, "")
    here = [str(rank), str(step), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")]
    if spec and spec.split(":") in (here[:2], here):
        raise RuntimeError(f"injected failure on rank {rank} at step {step} ({FAIL_RANK_ENV}={spec})")
