"""The DFlash training loss: decay-weighted hard-label cross entropy over slots 1..B-1.

Slot k of the block anchored at a predicts input_ids[a + k] (slot 0, the anchor, is excluded),
weighted by loss_mask[a + k] * exp(-(k - 1) / gamma) and normalised by the weight sum of the whole
optimizer step. Logits (rows x vocab) are computed in chunks under activation checkpointing, so at
most one chunk is alive in forward or backward. tau counts as eval does: 1 + accepted / blocks,
a block's accepted run being its leading slots whose argmax is the label (`counted_tau`).

DFlash 2 (`dflash2_block_loss`): the same loss on the unary logits plus alpha x the teacher-forced
selector's K-way cross entropy, same weights, same normaliser; `SelectorParts` measures the
selector's own lift. Rules and their upstream sources: docs/drafter.md "DFlash 2", docs/train.md "tau: one
definition".

`train.loss` chooses the objective (`LossObjective`): "ce" (the above, SpecForge 0.2.0's), "dpace"
(the same cross entropy weighted by D-PACE's detached per-position weights, `dpace_weights`) or
"distill" (KL from the target's own next-token distribution at each slot's position, with the decay
weights; `TeacherRows` carries the target's last hidden states of those positions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from dflash.drafter.dflash2 import CandidateSelector, DFlash2Drafter
    from dflash.drafter.network import DFlashDrafter


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for k = 1..B-1 -> [B-1]; w_1 = 1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


LOSS_KINDS = ("ce", "dpace", "distill")


@dataclass(frozen=True)
class LossObjective:
    """train.loss and train.dpace_alpha (DFlash drafters; docs/drafter.md "The loss")."""

    kind: str = "ce"
    dpace_alpha: float = 0.5

    @property
    def needs_teacher(self) -> bool:
        """The target's own logits at the block slots' positions (its forward runs to its last layer)."""
        return self.kind == "distill"


def normaliser_weights(decay: torch.Tensor, objective: LossObjective) -> torch.Tensor:
    """Per slot 1..B-1, what one supervised position adds to the step's normaliser (the GLOBAL weight sum,
    known before any forward): the decay weights, or for D-PACE, whose weights come out of the forward,
    1 (the normaliser is the count of supervised positions, as Speculators' `loss_function` divides by)."""
    return torch.ones_like(decay) if objective.kind == "dpace" else decay


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's per-position weights (no gradient): ce, mask [..., B-1] over slots 1..B-1 -> [..., B-1].

    D-PACE (Dynamic Position-Aware Cross-Entropy, arXiv:2605.18810; sgl-project/SpecForge PR #578,
    specforge/core/dflash.py `OnlineDFlashModel._dpace_weight`; vllm-project/speculators PR #736,
    `dpace_loss_decay`, its DFlash default since PR #980; NVIDIA/Model-Optimizer PR #1724): the draft's
    confidence in the label q_i = exp(-CE_i), smoothed q~_i = (1 - alpha) q_i + alpha (Eq. 7), and
    w_j = sum_{m >= j, m supervised} prod_{i <= m} q~_i (Eq. 8) for a supervised slot j, 0 otherwise:
    the expected accepted length that slot j's prefix carries. An unsupervised slot is a no-op in the
    products (q~ = 1) and adds nothing to the sums."""
    with torch.no_grad():
        supervised = mask > 0
        smooth = torch.where(supervised, (1.0 - alpha) * torch.exp(-ce.float()) + alpha, torch.ones_like(ce, dtype=torch.float32))
        prefix = torch.cumprod(smooth, dim=-1) * supervised
        suffix = torch.flip(torch.cumsum(torch.flip(prefix, dims=[-1]), dim=-1), dims=[-1])
        return suffix * supervised


@dataclass(frozen=True)
class TeacherRows:
    """The target's last decoder layer's output [b, S, H] (before its final norm: the head that turns a row
    into logits, its final norm and lm_head, runs on the rows the loss keeps, in `_chunk_kl`)."""

    hidden: torch.Tensor

    def at_slots(self, anchors: torch.Tensor, slots: int) -> torch.Tensor:
        """Rows predicting slots 1..B-1 of each block: position anchor + k - 1 -> [b, N, B-1, H]."""
        positions = (anchors[:, :, None] + torch.arange(slots, device=anchors.device)).clamp(max=self.hidden.shape[1] - 1)
        index = positions.flatten(1)[..., None].expand(-1, -1, self.hidden.shape[-1])
        return torch.gather(self.hidden, 1, index).view(*positions.shape, -1)


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
    the accepted draft tokens (leading correct slots) summed over its `blocks` counted blocks;
    `selector`: a DFlash 2 drafter's own figures (None for DFlash)."""

    weighted_ce: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    accepted: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    selector: Optional[SelectorParts] = None

    def figure_sums(self) -> torch.Tensor:
        """Every figure as one float64 CPU vector (summed over micro-batches and ranks, `read_step_figures`):
        weighted CE, weight sum, correct [B-1], counted [B-1], then the selector's (`SelectorParts.sums`)."""
        parts = [self.weighted_ce.detach().reshape(1), self.weight_sum.detach().reshape(1), self.correct, self.counted]
        if self.selector is not None:
            parts.append(self.selector.sums())
        return torch.cat([part.detach().double().cpu() for part in parts])


@dataclass(frozen=True)
class SelectorObjective:
    """train.selector_loss_alpha and train.selector_stop_gradient (DFlash 2 only)."""

    alpha: float = 1.0
    stop_gradient: bool = False


SELECTOR_ROWS = 6     # per-slot vectors of SelectorParts


@dataclass
class SelectorParts:
    """A DFlash 2 micro-batch's sums: the unary and the selector CE (slot-weighted, before alpha), and
    per slot 1..B-1: the true token in the strict top K (recall), the selector's teacher-forced pick
    right, and for the unary chain and the selector path: blocks accepted through slot k (`*_run`)
    out of those accepted through k - 1 whose slot k carries a label (`*_alive`)."""

    unary_ce: torch.Tensor
    selector_ce: torch.Tensor
    recall: torch.Tensor
    selector_correct: torch.Tensor
    unary_run: torch.Tensor
    unary_alive: torch.Tensor
    selector_run: torch.Tensor
    selector_alive: torch.Tensor

    def sums(self) -> torch.Tensor:
        return torch.cat([self.unary_ce.detach().reshape(1), self.selector_ce.detach().reshape(1), self.recall,
                          self.selector_correct, self.unary_run, self.unary_alive, self.selector_run,
                          self.selector_alive]).detach().double().cpu()


def figure_width(block_size: int, selector: bool) -> int:
    """Length of `LossParts.figure_sums` for a drafter of this block size (with a selector: DFlash 2)."""
    slots = block_size - 1
    return 2 + 2 * slots + ((2 + SELECTOR_ROWS * slots) if selector else 0)


@dataclass(frozen=True)
class SelectorStats:
    """A step's selector figures (all ranks): losses per weight, per-slot shares, simulated taus
    (`simulated_tau`: 1 + expected accepted draft tokens per block, as eval counts a step) and the
    selector's lift."""

    unary_loss: float
    selector_loss: float
    candidate_recall: list[float]
    selector_acc: list[float]
    unary_accept: list[float]           # per slot, given the chain was accepted before it
    selector_accept: list[float]
    unary_tau: float
    selector_tau: float

    @property
    def lift(self) -> float:
        return self.selector_tau - self.unary_tau

    def to_json(self) -> dict[str, object]:
        def shares(values: list[float]) -> list[Optional[float]]:
            return [None if math.isnan(v) else v for v in values]

        return {"unary_loss": self.unary_loss, "selector_loss": self.selector_loss,
                "candidate_recall": shares(self.candidate_recall), "selector_acc": shares(self.selector_acc),
                "unary_accept": shares(self.unary_accept), "selector_accept": shares(self.selector_accept),
                "unary_tau": self.unary_tau, "selector_tau": self.selector_tau, "lift": self.lift}


def read_selector_stats(totals: torch.Tensor, block_size: int) -> Optional[SelectorStats]:
    """The selector's figures from a step's summed `figure_sums` (None for a DFlash drafter)."""
    slots = block_size - 1
    if totals.numel() < figure_width(block_size, True):
        return None
    weight, counted = float(totals[1]), totals[2 + slots:2 + 2 * slots]
    extra = totals[2 + 2 * slots:]
    rows = extra[2:].view(SELECTOR_ROWS, slots)
    unary_accept, selector_accept = per_slot_accuracy(rows[2], rows[3]), per_slot_accuracy(rows[4], rows[5])
    return SelectorStats(
        unary_loss=float(extra[0]) / weight if weight else math.nan,
        selector_loss=float(extra[1]) / weight if weight else math.nan,
        candidate_recall=per_slot_accuracy(rows[0], counted), selector_acc=per_slot_accuracy(rows[1], counted),
        unary_accept=unary_accept, selector_accept=selector_accept,
        unary_tau=simulated_tau([0.0 if math.isnan(a) else a for a in unary_accept]),
        selector_tau=simulated_tau([0.0 if math.isnan(a) else a for a in selector_accept]))


def block_loss(hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], targets: BlockTargets,
               decay: torch.Tensor, chunk_rows: int = 2048, objective: LossObjective = LossObjective(),
               teacher: Optional[torch.Tensor] = None,
               teacher_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> LossParts:
    """hidden [b, N, B, H] (normed drafter output) -> LossParts; logits computed in row chunks. `objective`:
    train.loss; "distill" needs `teacher` [b, N, B-1, H] (`TeacherRows.at_slots`) and `teacher_head`."""
    slots = hidden.shape[2] - 1
    rows = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])
    slot_index = torch.arange(slots, device=hidden.device).expand(*targets.labels.shape).reshape(-1)
    label_mask = targets.label_mask.reshape(-1)
    keep = label_mask > 0
    rows, labels, slot_index = rows[keep], targets.labels.reshape(-1)[keep], slot_index[keep]
    weights = decay.to(hidden.device)[slot_index] * label_mask[keep]
    if objective.kind == "dpace":
        weighted_ce, correct, weights = _dpace_ce(rows, labels, keep, targets.label_mask, lm_head, chunk_rows,
                                                  objective.dpace_alpha)
    elif objective.kind == "distill":
        assert teacher is not None and teacher_head is not None, "train.loss = \"distill\" needs the target's rows"
        teacher_rows = teacher.reshape(-1, teacher.shape[-1])[keep]
        weighted_ce, correct = _chunked_kl(rows, teacher_rows, labels, weights, lm_head, teacher_head, chunk_rows)
    else:
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


def _dpace_ce(rows: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor, label_mask: torch.Tensor,
              lm_head: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int,
              alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of D-PACE-weighted CE, argmax right [n], the supervised positions' normaliser weights [n]).
    One pass over the logits: each row's CE (its gradient kept) gives the weights, detached."""
    ce, correct = _chunked_row_ce(rows, labels, lm_head, chunk_rows)
    grid = torch.zeros(keep.numel(), dtype=torch.float32, device=rows.device)
    grid[keep] = ce.detach().float()
    weights = dpace_weights(grid.view(label_mask.shape), label_mask, alpha).reshape(-1)[keep]
    mask = label_mask.reshape(-1)[keep]
    return (ce.float() * weights * mask).sum(), correct, mask


def _chunked_row_ce(rows: torch.Tensor, labels: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
                    chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's CE [n] (carries grad) and argmax right [n], one chunk of logits alive at a time."""
    ces, hits = [], []
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        if rows.requires_grad:
            ce, hit = checkpoint(_chunk_row_ce, rows[part], labels[part], lm_head, use_reentrant=False)
        else:
            ce, hit = _chunk_row_ce(rows[part], labels[part], lm_head)
        ces.append(ce)
        hits.append(hit)
    if not ces:
        return rows.new_zeros(0, dtype=torch.float32), rows.new_zeros(0, dtype=torch.float32)
    return torch.cat(ces), torch.cat(hits)


def _chunk_row_ce(rows: torch.Tensor, labels: torch.Tensor,
                  lm_head: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(rows).float()
    return F.cross_entropy(logits, labels, reduction="none"), (logits.argmax(dim=-1) == labels).float()


def _chunked_kl(rows: torch.Tensor, teacher_rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                lm_head: Callable[[torch.Tensor], torch.Tensor], teacher_head: Callable[[torch.Tensor], torch.Tensor],
                chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `_chunked_ce` with KL(target || drafter) per row: the target's logits of a chunk are computed
    inside it (no gradient; again in the backward's recomputation), so one chunk of each is alive at a time."""
    total = rows.new_zeros((), dtype=torch.float32)
    correct = []
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        args = (rows[part], teacher_rows[part], labels[part], weights[part], lm_head, teacher_head)
        kl, hit = checkpoint(_chunk_kl, *args, use_reentrant=False) if rows.requires_grad else _chunk_kl(*args)
        total = total + kl
        correct.append(hit)
    hits = torch.cat(correct) if correct else rows.new_zeros(0, dtype=torch.float32)
    return total, hits


def _chunk_kl(rows: torch.Tensor, teacher_rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
              lm_head: Callable[[torch.Tensor], torch.Tensor],
              teacher_head: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(rows).float()
    with torch.no_grad():
        teacher_log_probs = F.log_softmax(teacher_head(teacher_rows).float(), dim=-1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1), teacher_log_probs, reduction="none", log_target=True).sum(dim=-1)
    return (kl * weights).sum(), (logits.argmax(dim=-1) == labels).float()


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


# --- DFlash 2 ---------------------------------------------------------------------------------------

def drafter_loss(drafter: DFlashDrafter, hidden: torch.Tensor, targets: BlockTargets, anchor_ids: torch.Tensor,
                 decay: torch.Tensor, chunk_rows: int = 2048, objective: SelectorObjective = SelectorObjective(),
                 loss: LossObjective = LossObjective(), teacher: Optional[torch.Tensor] = None,
                 teacher_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> LossParts:
    """The training loss of `drafter`'s blocks: `block_loss` (train.loss `loss`; "distill": the target's rows
    `teacher` and `teacher_head`), or for a DFlash 2 drafter `dflash2_block_loss`. anchor_ids [b, N]: the
    anchor tokens (slot 1's predecessor)."""
    from dflash.drafter.dflash2 import DFlash2Drafter

    if isinstance(drafter, DFlash2Drafter):
        return dflash2_block_loss(hidden, drafter, targets, anchor_ids, decay, chunk_rows, objective)
    return block_loss(hidden, drafter.logits, targets, decay, chunk_rows, loss, teacher, teacher_head)


def dflash2_block_loss(hidden: torch.Tensor, drafter: DFlash2Drafter, targets: BlockTargets, anchor_ids: torch.Tensor,
                       decay: torch.Tensor, chunk_rows: int = 2048,
                       objective: SelectorObjective = SelectorObjective()) -> LossParts:
    """hidden [b, N, B, H] -> LossParts whose weighted CE is unary + alpha * selector (module docstring)."""
    slots, top_k = hidden.shape[2] - 1, drafter.selector.top_k
    label_mask = targets.label_mask.reshape(-1)
    keep = label_mask > 0
    predecessors = torch.cat([anchor_ids[..., None], targets.labels[..., :-1]], dim=-1).reshape(-1)[keep]
    slot_index = torch.arange(slots, device=hidden.device).expand(*targets.labels.shape).reshape(-1)[keep]
    rows, labels = hidden[:, :, 1:].reshape(-1, hidden.shape[-1])[keep], targets.labels.reshape(-1)[keep]
    weights = decay.to(hidden.device)[slot_index] * label_mask[keep]
    head = _chunked_head(rows, labels, weights, drafter.logits, top_k, chunk_rows)
    selector_ce, selector_right, recall = selector_terms(drafter.selector, rows, labels, predecessors, head, weights,
                                                         objective.stop_gradient)

    def per_slot(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(slots, device=hidden.device).index_add_(0, slot_index, values.float())

    def grid(values: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(keep.numel(), dtype=torch.bool, device=hidden.device)
        full[keep] = values.bool()
        return full.view(targets.labels.shape)

    valid = keep.view(targets.labels.shape)
    unary_run, unary_alive = accepted_runs(grid(head.hit), valid)
    selector_run, selector_alive = accepted_runs(grid(selector_right), valid)
    parts = SelectorParts(unary_ce=head.weighted_ce, selector_ce=selector_ce, recall=per_slot(recall),
                          selector_correct=per_slot(selector_right), unary_run=unary_run, unary_alive=unary_alive,
                          selector_run=selector_run, selector_alive=selector_alive)
    accepted, blocks = leading_accepted(selector_right, keep, targets.label_mask)
    return LossParts(weighted_ce=head.weighted_ce + objective.alpha * selector_ce, weight_sum=weights.sum(),
                     correct=per_slot(head.hit), counted=per_slot(torch.ones_like(head.hit)), accepted=accepted,
                     blocks=blocks, selector=parts)


@dataclass
class HeadRows:
    """The unary head on the kept rows: weighted CE sum, argmax right [n], top-K values / ids [n, K], true token's logit [n]."""

    weighted_ce: torch.Tensor
    hit: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    gold: torch.Tensor


def _chunked_head(rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                  head: Callable[[torch.Tensor], torch.Tensor], top_k: int, chunk_rows: int) -> HeadRows:
    """As `_chunked_ce` (one chunk of vocabulary-wide logits alive at a time, recomputed in backward),
    keeping each row's top K and true-token logit for the selector."""
    outputs = []
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        args = (rows[part], labels[part], weights[part], head, top_k)
        outputs.append(checkpoint(_chunk_head, *args, use_reentrant=False) if rows.requires_grad else _chunk_head(*args))
    if not outputs:
        outputs.append(_chunk_head(rows, labels, weights, head, top_k))
    ce, hit, values, ids, gold = (list(column) for column in zip(*outputs))
    return HeadRows(torch.stack(ce).sum(), torch.cat(hit), torch.cat(values), torch.cat(ids), torch.cat(gold))


def _chunk_head(rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                head: Callable[[torch.Tensor], torch.Tensor], top_k: int) -> tuple[torch.Tensor, ...]:
    logits = head(rows).float()
    ce = F.cross_entropy(logits, labels, reduction="none") if rows.shape[0] else logits.new_zeros(0)
    values, ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
    gold = logits.gather(1, labels[:, None])[:, 0]
    return (ce * weights).sum(), (logits.argmax(dim=-1) == labels).float(), values, ids, gold


def selector_terms(selector: CandidateSelector, rows: torch.Tensor, labels: torch.Tensor, predecessors: torch.Tensor,
                   head: HeadRows, weights: torch.Tensor, stop_gradient: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted selector CE, teacher-forced pick right [n], true token in the strict top K [n]).

    The CE's candidates are the strict top K with the true token in place of the K-th when it is
    missing; the pick (a figure) is the decoder's: the best of the strict top K."""
    values, gold = head.top_values, head.gold
    if stop_gradient:
        rows, values, gold = rows.detach(), values.detach(), gold.detach()
    top_k = head.top_ids.shape[1]
    in_top = head.top_ids == labels[:, None]
    recall = in_top.any(dim=-1)
    transitions = selector(rows, predecessors, torch.cat([head.top_ids, labels[:, None]], dim=1)).float()
    strict = values.float() + transitions[:, :top_k]
    inserted = torch.where(recall, strict[:, -1], gold.float() + transitions[:, -1])
    scores = torch.cat([strict[:, :-1], inserted[:, None]], dim=1)
    target = torch.where(recall, in_top.long().argmax(dim=-1), torch.full_like(labels, top_k - 1))
    ce = F.cross_entropy(scores, target, reduction="none") if rows.shape[0] else scores.new_zeros(0)
    with torch.no_grad():
        picked = head.top_ids.gather(1, strict.argmax(dim=-1, keepdim=True))[:, 0]
    return (ce * weights).sum(), picked == labels, recall


def accepted_runs(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """correct / valid [..., S] per block slot -> per slot: blocks right through slot k (`run`), and blocks
    right through k - 1 whose slot k is valid (`alive`: those that could be accepted at k)."""
    run = torch.cumprod((correct & valid).long(), dim=-1).bool()
    before = torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], dim=-1)
    alive = before & valid
    return run.reshape(-1, run.shape[-1]).sum(0).float(), alive.reshape(-1, run.shape[-1]).sum(0).float()
