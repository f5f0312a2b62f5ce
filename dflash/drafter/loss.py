"""The DFlash training loss: decay-weighted hard-label cross entropy over slots 1..B-1.

Slot k of the block anchored at a predicts the token at a + k (label input_ids[a + k]); slot 0
(the anchor itself) is excluded. Each slot is weighted by loss_mask[a + k] * exp(-(k - 1) / gamma)
(slot 1 has weight 1) and the sum is normalised by the weight sum of the whole optimizer step.
The logits (rows x vocab, vocab up to ~152K) are computed in chunks under activation
checkpointing, so at most one chunk of logits is alive in forward or backward.

tau, here as in eval and the serving engines, is the acceptance length of a step: accepted draft
tokens + 1 (the target's bonus token). `LossParts.accepted` / `blocks` count it as eval does: per
block, the leading run of slots whose argmax is the label (a slot without a label, outside the
loss mask or the draft vocabulary, ends the run), so tau = 1 + accepted / blocks
(`counted_tau`). `simulated_tau` estimates the same figure from per-slot accuracies alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for k = 1..B-1 -> [B-1]; w_1 = 1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


@dataclass(frozen=True)
class BlockTargets:
    """labels [b, N, B-1] and label_mask [b, N, B-1] (loss_mask at a + k; 0 past the end)."""

    labels: torch.Tensor
    label_mask: torch.Tensor


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  anchor_valid: torch.Tensor, block_size: int) -> BlockTargets:
    """Labels of slots 1..B-1: the tokens at anchor + 1 .. anchor + B - 1."""
    seq_len = input_ids.shape[1]
    offsets = torch.arange(1, block_size, device=anchors.device)
    positions = anchors[:, :, None] + offsets                                  # [b, N, B-1]
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1).flatten(1)
    labels = torch.gather(input_ids, 1, clamped).view_as(positions)
    mask = torch.gather(loss_mask.to(torch.float32), 1, clamped).view_as(positions)
    mask = mask * inside * anchor_valid[:, :, None]
    return BlockTargets(labels=labels, label_mask=mask)


@dataclass
class LossParts:
    """Sums over one micro-batch: weighted CE (carries grad), weight sum, per-slot correct/counted,
    and the accepted draft tokens (leading correct slots) summed over its `blocks` counted blocks."""

    weighted_ce: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    accepted: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


def block_loss(hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], targets: BlockTargets,
               decay: torch.Tensor, chunk_rows: int = 2048) -> LossParts:
    """hidden [b, N, B, H] (normed drafter output) -> LossParts; logits computed in row chunks."""
    slots = hidden.shape[2] - 1
    rows = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])
    slot_index = torch.arange(slots, device=hidden.device).expand(*targets.labels.shape).reshape(-1)
    label_mask = targets.label_mask.reshape(-1)
    keep = label_mask > 0
    rows, labels, slot_index = rows[keep], targets.labels.reshape(-1)[keep], slot_index[keep]
    weights = decay.to(hidden.device)[slot_index] * label_mask[keep]
    weighted_ce, correct = _chunked_ce(rows, labels, weights, lm_head, chunk_rows)
    accepted, blocks = leading_accepted(correct, keep, targets.label_mask)
    return LossParts(
        weighted_ce=weighted_ce, weight_sum=weights.sum(),
        correct=torch.zeros(slots, device=hidden.device).index_add_(0, slot_index, correct),
        counted=torch.zeros(slots, device=hidden.device).index_add_(0, slot_index, torch.ones_like(correct)),
        accepted=accepted, blocks=blocks,
    )


def leading_accepted(correct: torch.Tensor, keep: torch.Tensor, label_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted draft tokens summed over blocks, blocks): per block, the run of leading slots whose
    prediction was right, as a verify step accepts them. `correct` [kept rows] in the order of the
    flattened slots `keep` selects; label_mask [b, N, B-1]. A block counts when its slot 1 has a label."""
    hits = torch.zeros(keep.shape[0], dtype=torch.float32, device=keep.device)
    hits[keep] = correct.detach().float()
    per_block = hits.view(-1, label_mask.shape[-1]).cumprod(dim=1).sum(dim=1)
    counted = label_mask.reshape(-1, label_mask.shape[-1])[:, 0] > 0
    return per_block[counted].sum(), counted.sum().float()


def counted_tau(accepted: float, blocks: float) -> float:
    """tau = 1 + accepted draft tokens per block (eval's definition); 1.0 with no block."""
    return 1.0 + accepted / blocks if blocks > 0 else 1.0


def _chunked_ce(rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                lm_head: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    total = rows.new_zeros((), dtype=torch.float32)
    correct = []
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        if rows.requires_grad:
            ce, hit = checkpoint(_chunk_ce, rows[part], labels[part], weights[part], lm_head, use_reentrant=False)
        else:
            ce, hit = _chunk_ce(rows[part], labels[part], weights[part], lm_head)
        total = total + ce
        correct.append(hit)
    hits = torch.cat(correct) if correct else rows.new_zeros(0, dtype=torch.float32)
    return total, hits


def _chunk_ce(rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
              lm_head: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(rows).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    hit = (logits.argmax(dim=-1) == labels).float()
    return (ce * weights).sum(), hit


def simulated_tau(acc: list[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: tau (accepted draft tokens + the bonus token, as eval counts a
    step) estimated from per-slot accuracies, as if each slot were right independently."""
    total, running = 1.0, 1.0
    for value in acc:
        running *= value
        total += running
    return total


def per_slot_accuracy(correct: torch.Tensor, counted: torch.Tensor) -> list[float]:
    return [float(c / n) if n > 0 else math.nan for c, n in zip(correct.tolist(), counted.tolist())]
