"""A step whose loss cannot train the drafter is skipped, or stops the run before any of its weights are saved (exit 4).

Two ways a step trains on nothing usable, both judged from figures every rank has alike (the step's
loss weight and sums are all-reduced, the gradient norm is global), so every rank decides alike at the
same step, right after it (dflash.train.rank.worker.train_loop), before the next save; when it stops, a
save of an earlier step still being written is finished first, so `latest` stays on the last good checkpoint:

* no supervised position: the step's loss weight (every block slot with a label, weighted, over all
  ranks' rows) is 0. Such a step is skipped before any forward (dflash.train.rank.step.skipped_step: no
  update), counted (`skipped` in its metrics.jsonl line, `skipped_steps` there and in the manifest's
  train stage) and said on rank 0's output; a run of more than train.max_skipped_steps of them in a row
  stops the run. A block starts at an anchor, a position i with
  loss_mask[i] and loss_mask[i + 1] inside the row as data.max_length cuts it (dflash.drafter.anchors);
  a label outside the draft vocabulary (drafter.draft_vocab_size) carries no loss. Each rank names,
  from its own rows of the step, which decides it: the profile's data.max_length (every row's first
  anchor lies past it), the data (rows without two consecutive trained tokens) or the draft vocabulary;
* a loss or gradient norm that is not finite (NaN, inf): the update writes it into the weights.
  The message names the keys that usually cause it: train.lr, train.compute_dtype, train.autocast,
  model.dtype, train.grad_clip.

Before launch, dflash.train.supervisor.launch_checks refuses a profile whose data.max_length leaves every row of
the dataset without an anchor (`anchors_within`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

from launcher_core.errors import DataError

if TYPE_CHECKING:
    from dflash.train.rank.setup import TrainState
    from dflash.train.rank.step import StepStats
    from launcher_core.schema import Profile


class UnusableLoss(DataError):
    """A step trained on no supervised position, or its loss or gradient norm is not finite (exit 4)."""


def check_step(state: TrainState, stats: StepStats, profile: Profile) -> None:
    """Every rank, after step `state.step`: a skipped step counted, or UnusableLoss when the step's loss
    cannot train the drafter (one skipped step more than train.max_skipped_steps in a row, or not finite)."""
    if stats.skipped or stats.weight_sum <= 0:
        count_skipped(state, profile)
        return
    state.skipped_in_a_row = 0
    norm = stats.grad_norm if stats.grad_norm is not None else 0.0
    if not (math.isfinite(stats.loss) and math.isfinite(norm)):
        raise UnusableLoss(f"step {state.step}: the loss is {stats.loss:g} and the gradient norm {norm:g}, not finite: the "
                           f"update made the weights NaN, and the run stopped before saving them. Usual causes: "
                           f"{non_finite_candidates(profile)}")


def count_skipped(state: TrainState, profile: Profile) -> None:
    """Count a step skipped without a supervised position; rank 0 says it, with the cause its rows show.
    UnusableLoss once more than train.max_skipped_steps of them come in a row."""
    bound, rows, in_a_row = profile.train.max_skipped_steps, profile.train.global_batch, state.skipped_in_a_row + 1
    if in_a_row > bound:
        steps = f"step {state.step}" if in_a_row == 1 else f"steps {state.step - in_a_row + 1}..{state.step} ({in_a_row} in a row)"
        whose = "its" if in_a_row == 1 else "each one's"
        raise UnusableLoss(f"{steps} trained on nothing: no supervised position in {whose} {rows} rows (loss weight 0); "
                           f"{no_supervision_cause(state, profile)}. The run stopped before saving (train."
                           f"max_skipped_steps = {bound} skipped in a row at most)")
    state.skipped_steps, state.skipped_in_a_row = state.skipped_steps + 1, in_a_row
    if state.env.is_main:
        print(f"step {state.step}: skipped, no supervised position in its {rows} rows (loss weight 0; "
              f"{state.skipped_in_a_row} in a row, train.max_skipped_steps = {bound}; {state.skipped_steps} in this "
              f"run); {no_supervision_cause(state, profile)}", flush=True)


def non_finite_candidates(profile: Profile) -> str:
    """The settings that usually make a loss NaN or inf, with this profile's values."""
    from dflash.train.rank.step import autocast_wanted

    train, dtype = profile.train, profile.model.dtype
    narrow = (train.compute_dtype != "float32" or dtype != "float32"
              or autocast_wanted(profile.machine.device, train.autocast))
    arithmetic = (f"bfloat16 arithmetic overflowing (train.compute_dtype = \"{train.compute_dtype}\", train.autocast = "
                  f"\"{train.autocast}\", model.dtype = \"{dtype}\"; \"float32\" and autocast \"off\" rule it out)"
                  if narrow else "not a bfloat16 overflow: this run computes in float32")
    return (f"train.lr = {train.lr:g} too high (the default is 6e-4; train.warmup_ratio = {train.warmup_ratio:g}); "
            f"train.grad_clip = {train.grad_clip:g}; {arithmetic}")


def no_supervision_cause(state: TrainState, profile: Profile) -> str:
    """Which setting leaves this rank's rows of the step (the last one run) without a supervised position."""
    from dflash.train.rank.data import TrainData

    data = state.data
    if not isinstance(data, TrainData):
        return "the rows' loss masks, data.max_length or drafter.draft_vocab_size"
    _epoch, rows = data.step_rows(state.step - 1)
    return supervision_cause(data.loss_masks(rows), profile.data.max_length, profile.drafter.draft_vocab_size,
                             state.env.rank)


def supervision_cause(masks: Sequence[Sequence[int]], max_length: int, draft_vocab_size: int, rank: int) -> str:
    """Why rows with these (whole) loss masks yield no supervised position: the data, data.max_length or the
    draft vocabulary."""
    firsts = [first_anchor(mask) for mask in masks]
    found = [first for first in firsts if first is not None]
    lengths = f"{min(map(len, masks))}..{max(map(len, masks))}" if masks else "0"
    if not found:
        return (f"the data decides it: none of rank {rank}'s {len(masks)} row(s) of {lengths} tokens has two "
                f"consecutive trained tokens (loss_mask), where a block starts; tokenize drops such rows with "
                f"data.min_loss_tokens, so re-tokenize the dataset or remove them")
    if min(found) + 1 >= max_length:
        return (f"the profile decides it: data.max_length = {max_length} cuts each of rank {rank}'s row(s) of "
                f"{lengths} tokens before its first two consecutive trained tokens (the earliest at position "
                f"{min(found)}), where a block starts; set data.max_length to the length the dataset was tokenized "
                f"at, at least {min(found) + 2}")
    return (f"the profile decides it: drafter.draft_vocab_size = {draft_vocab_size} leaves every trained label "
            f"of rank {rank}'s row(s) outside the draft vocabulary; raise it (0: the whole vocabulary)")


def first_anchor(mask: Sequence[int]) -> Optional[int]:
    """The first position i with mask[i] and mask[i + 1] (a block's anchor), None when there is none."""
    from dflash.drafter.anchors import valid_anchor_positions

    positions = valid_anchor_positions(mask)
    return int(positions[0]) if len(positions) else None
