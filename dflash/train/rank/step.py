"""One optimizer step of online DFlash training, run inside each torchrun rank.

One optimizer step = `accum_steps` micro-batches of `micro_batch` sequences on every rank (a
`dflash.memory.budget.BatchPlan`; the same number of forward/backward calls everywhere: the drafter
is sharded by FSDP2, whose collectives run inside them). The loss of the step is the weighted
cross entropy summed over all ranks' micro-batches divided by the GLOBAL weight sum (all_reduce
SUM before any backward), and FSDP2 sums (never averages) the ranks' gradients
(dflash.train.rank.parallel), so gradients do not depend on how the batch is split: a step redone at
another micro-batch, or on another number of ranks, gives the same update. A step whose global weight
is 0 (no supervised position in any rank's rows) is skipped on every rank alike (`skipped_step`).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from dflash.drafter.loss import (
    BlockTargets,
    LossParts,
    SelectorStats,
    TeacherRows,
    block_targets,
    drafter_loss,
    figure_width,
    normaliser_weights,
    per_slot_accuracy,
    read_selector_stats,
    simulated_tau,
)
from dflash.drafter.network import DFlashDrafter, forward_blocks
from dflash.train.rank import parallel
from dflash.train.rank.data import MicroBatch

if TYPE_CHECKING:
    from dflash.memory.budget import BatchPlan
    from dflash.train.rank.setup import TrainState


@dataclass
class StepStats:
    loss: float
    acc: list[float]
    sim_tau: float
    tokens: int
    weight_sum: float
    seconds: float
    selector: SelectorStats | None = None      # DFlash 2: the selector's own figures (dflash.drafter.loss)
    grad_norm: float | None = None             # the global gradient norm before clipping (None: not measured)
    skipped: bool = False                      # no supervised position on any rank: no forward, no update (skipped_step)


def step_targets(drafter: DFlashDrafter, batch: MicroBatch) -> BlockTargets:
    """Labels of every block slot, as columns of the drafter's logits; slots whose token is
    outside the draft vocabulary (drafter.draft_vocab_size) carry no loss."""
    targets = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.anchor_valid, drafter.block_size)
    labels, inside = drafter.draft_labels(targets.labels)
    return BlockTargets(labels=labels, label_mask=targets.label_mask * inside)


def micro_weight_sum(state: TrainState, batch: MicroBatch) -> float:
    """The micro-batch's share of the step's normaliser (dflash.drafter.loss.normaliser_weights)."""
    weights = normaliser_weights(state.decay, state.loss).cpu()
    return float((step_targets(state.drafter, batch).label_mask * weights).sum())


def forward_micro(state: TrainState, batch: MicroBatch) -> LossParts:
    """Target taps (no grad, truncated forward; with train.loss = "distill" to the last layer) -> drafter
    over all blocks -> loss parts."""
    batch = batch.to(state.device)
    features, last = target_features(state, batch)
    with autocast_context(state.device, state.autocast):
        hidden = forward_blocks(state.drafter, batch.input_ids, batch.anchors, features, state.backend,
                                state.layer_attends)
        anchor_ids = torch.gather(batch.input_ids, 1, batch.anchors)
        head = None if last is None else teacher_head(state)
        teacher = None if last is None else TeacherRows(last).at_slots(batch.anchors, hidden.shape[2] - 1)
        parts = drafter_loss(state.drafter, hidden, step_targets(state.drafter, batch), anchor_ids, state.decay,
                             state.chunk_rows, state.selector, state.loss, teacher, head)
    parts.weighted_ce = parts.weighted_ce + 0.0 * hidden.sum()   # keep every parameter in the graph
    return parts


def target_features(state: TrainState, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tap features, the target's last layer output or None): from the online forward, or the state's
    feature source (the feature cache; the memory trace's fake features, which then carry the last
    layer's columns too)."""
    from dflash.drafter.taps import extract_taps, extract_taps_and_last, split_last

    teacher = state.loss.needs_teacher
    extract = extract_taps_and_last if teacher else extract_taps
    if state.feature_cache is None:
        features = extract(state.target, batch.input_ids, state.layer_ids)
    else:
        features = state.feature_cache.features(batch, lambda ids: extract(state.target, ids, state.layer_ids))
    if not teacher:
        return features, None
    return split_last(features, state.target.config.hidden_size)


def teacher_head(state: TrainState) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of the target's last layer output -> its logits over the drafter's columns: the target's final
    norm, then its lm_head's rows of the draft vocabulary (all rows without one)."""
    import torch.nn.functional as F

    drafter, norm = state.drafter, state.target.model.norm
    lm_head = state.target.get_output_embeddings()
    rows = drafter.draft_vocab if drafter.has_draft_vocab else slice(None)
    weight, bias = lm_head.weight[rows], None if lm_head.bias is None else lm_head.bias[rows]
    return lambda hidden: F.linear(norm(hidden).to(weight.dtype), weight, bias)


def autocast_context(device: torch.device, setting: str = "auto") -> contextlib.AbstractContextManager[object]:
    """The drafter's forward: bf16 autocast on CUDA ("auto"), on CPU only with train.autocast = "bfloat16"."""
    if autocast_wanted(device.type, setting):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def autocast_wanted(device_type: str, setting: str = "auto") -> bool:
    return setting == "bfloat16" or (setting == "auto" and device_type == "cuda")


def run_next_step(state: TrainState) -> tuple[StepStats, int]:
    """The schedule's next optimizer step: this rank's rows of step `state.step` (dflash.train.rank.data.TrainData),
    split by the current micro-batch, then `state.step` advances. Returns the step's figures and its epoch.
    The worker's loop and the training benchmarks step through this."""
    from dflash.memory.budget import batch_plan
    from dflash.train.rank.data import TrainData

    data = state.data
    assert isinstance(data, TrainData), "the schedule's steps read the rank's dataset (build_state)"
    epoch, rows = data.step_rows(state.step)
    stats = run_step(state, rows, epoch, batch_plan(data.global_batch, state.env.world_size, state.micro_batch))
    state.step += 1
    return stats, epoch


def run_step(state: TrainState, rows: list[int], epoch: int, plan: BatchPlan) -> StepStats:
    """One optimizer step over this rank's `rows`, split as `plan` says (`plan.micro_batch` is the
    agreed one when `state.autobatch` is set).

    Collectives, identical on every rank: all_reduce(SUM) of the step's loss weight; each
    micro-batch's forward and backward (FSDP2: a unit's all-gather before its forward and again
    before its backward, its gradients' reduce-scatter as its backward ends -- every micro-batch,
    or only the last with train.gradient_sync = "last_micro_batch"); the gradient norm's all-reduce
    in clipping; the update is local (AdamW on this rank's shards). With `state.autobatch`, an
    out-of-memory error anywhere in the step is recorded and ends this rank for a restart of every
    rank at half the micro-batch (dflash.train.rank.autobatch: recovery by restart).

    Each phase is marked on `state.progress` as it starts (data, reduction, forward, backward, update),
    which the rank's heartbeat reports (dflash.train.supervisor.heartbeat); nothing else is installed in the step.
    """
    started = time.perf_counter()
    progress = state.progress
    progress.enter("data", state.step + 1)
    local_weight = micro_weight_sum(state, state.data.collate(rows, epoch))
    progress.enter("reduction")
    global_weight = parallel.global_weight(local_weight)
    if global_weight <= 0:
        return skipped_step(state, time.perf_counter() - started)
    micro_batch = state.autobatch.micro_batch if state.autobatch is not None else plan.micro_batch
    guard = (state.autobatch.guard(state.step + 1, lambda: progress.phase) if state.autobatch is not None
             else contextlib.nullcontext())
    state.micro_batch = micro_batch
    with guard:
        sums, tokens, norm = plain_step(state, rows, epoch, micro_batch, global_weight)
    return step_stats(state, sums, tokens, time.perf_counter() - started, grad_norm=global_value(norm))


def skipped_step(state: TrainState, seconds: float) -> StepStats:
    """A step whose rows hold no supervised position on any rank (the all-reduced loss weight is 0: every
    rank sees it alike, so none runs a forward or a backward, as FSDP2 needs): no update, the weights, AdamW
    and the schedule stay as they were (dflash.train.rank.loss_check counts it and bounds a run of them)."""
    slots = state.drafter.block_size - 1
    return StepStats(loss=math.nan, acc=[math.nan] * slots, sim_tau=simulated_tau([0.0] * slots), tokens=0,
                     weight_sum=0.0, seconds=seconds, skipped=True)


def plain_step(state: TrainState, rows: list[int], epoch: int, micro_batch: int, global_weight: float,
               mark: Callable[[str], None] = lambda phase: None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The step's work: every micro-batch's forward/backward (the gradient reductions run inside
    the backward), then the update. `mark` names each phase as it starts (the memory trace,
    dflash.measure.trace, keeps a peak per phase). Returns the loss sums, the tokens and the gradient norm."""
    mark("micro-batches")
    sums, tokens = accumulate_step(state, rows, epoch, micro_batch, global_weight)
    mark("update")
    return sums, tokens, update(state)


def accumulate_step(state: TrainState, rows: list[int], epoch: int, micro_batch: int,
                    global_weight: float) -> tuple[torch.Tensor, int]:
    """Fresh gradients from every micro-batch of `rows` -> (loss sums, tokens)."""
    state.optimizer.zero_grad(set_to_none=True)
    state.progress.enter("data")
    batches = [state.data.collate(rows[i:i + micro_batch], epoch) for i in range(0, len(rows), micro_batch)]
    return accumulate_micro_batches(state, batches, global_weight), sum(b.tokens for b in batches)


def update(state: TrainState) -> torch.Tensor:
    """Clip (the norm over every rank's shards: one all-reduce) and step AdamW and the schedule. Returns
    the gradient norm before clipping (a DTensor under FSDP2: `global_value` reads it)."""
    state.progress.enter("update")
    norm = torch.nn.utils.clip_grad_norm_(state.drafter.parameters(), state.grad_clip)
    state.optimizer.step()
    state.scheduler.step()
    return norm


def global_value(norm: torch.Tensor) -> float:
    """A scalar every rank has alike: a sharded (DTensor) norm's whole value (every rank calls this)."""
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def accumulate_micro_batches(state: TrainState, batches: list[MicroBatch], global_weight: float) -> torch.Tensor:
    """Forward/backward of each micro-batch, loss / GLOBAL weight. Gradients are reduce-scattered
    into this rank's shards as each backward ends, or with train.gradient_sync = "last_micro_batch"
    kept unsharded until the last micro-batch's backward reduces their sum."""
    from dflash.train.rank.parallel import set_gradient_sync

    selector = hasattr(state.drafter, "candidate_selector")
    totals = torch.zeros(figure_width(state.drafter.block_size, selector), dtype=torch.float64)
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        set_gradient_sync(state.drafter, last or state.gradient_sync == "every_micro_batch")
        state.progress.enter("forward")
        parts = forward_micro(state, batch)
        state.progress.enter("backward")           # FSDP2's gradient reduce-scatter runs inside it
        (parts.weighted_ce / global_weight).backward()
        totals += parts.figure_sums()
    return totals


def step_stats(state: TrainState, totals: torch.Tensor, tokens: int, local_seconds: float,
               grad_norm: float | None = None) -> StepStats:
    slots = state.drafter.block_size - 1
    state.progress.enter("reduction")
    reduced = parallel.all_reduce_tensor(torch.cat([totals, torch.tensor([float(tokens)], dtype=torch.float64)]))
    acc = per_slot_accuracy(reduced[2:2 + slots], reduced[2 + slots:2 + 2 * slots])
    weight = float(reduced[1])
    return StepStats(loss=float(reduced[0]) / weight if weight else math.nan, acc=acc,
                     sim_tau=simulated_tau([0.0 if math.isnan(a) else a for a in acc]),
                     tokens=int(reduced[-1]), weight_sum=weight, seconds=local_seconds,
                     selector=read_selector_stats(reduced[:-1], state.drafter.block_size), grad_norm=grad_norm)
