"""The DFlash 2 drafter behind the `Drafter` protocol: it drafts its candidate selector's path.

Each step runs the drafter's block as DFlash does (the same context K/V cache,
dflash.eval.dflash_drafter), takes the unary logits of slots 1..k, and walks the selector from the
anchor (dflash.drafter.dflash2.CandidateSelector.walk): greedy, the best edge per slot; sampled,
one inverse-CDF draw per slot from q = softmax(scores / T) over the K candidates. The proposal's q
is that distribution spread over the target's vocabulary (zero outside the candidates), which is
what the speculative rejection test needs to stay lossless.

Besides the `dflash` method (the selector's path, what the engines serve), the eval decodes the
same drafter's unary argmax as `dflash_unary` (`unary_draft`): the selector's lift is the
difference of the two taus. While it drafts, a DFlash2Draft counts per block position the
verified positions whose token was among its candidates (candidate recall: the selector can
only ever pick one of them) and the positions where its pick differs from the unary argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, cast

from dflash.eval.dflash_drafter import DFlashDraft
from dflash.eval.specdec import Proposal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.eval.report_schema import EvalReport

UNARY = "dflash_unary"


@dataclass
class SelectorTally:
    """Counts per block position 1..B-1 over one decoded prompt."""

    hits: list[int]            # verified positions whose token was a candidate
    verified: list[int]        # positions whose token the target verified (accepted + the bonus, per step)
    overrides: list[int]       # drafted positions where the selector's token is not the unary argmax
    drafted: list[int]

    @classmethod
    def empty(cls, positions: int) -> "SelectorTally":
        return cls([0] * positions, [0] * positions, [0] * positions, [0] * positions)

    def add(self, other: "SelectorTally") -> "SelectorTally":
        def pairwise(a: list[int], b: list[int]) -> list[int]:
            return [x + y for x, y in zip(a, b)]

        return SelectorTally(pairwise(self.hits, other.hits), pairwise(self.verified, other.verified),
                             pairwise(self.overrides, other.overrides), pairwise(self.drafted, other.drafted))

    def candidate_recall(self) -> list[Optional[float]]:
        return [h / n if n else None for h, n in zip(self.hits, self.verified)]

    def override_share(self) -> list[Optional[float]]:
        return [o / n if n else None for o, n in zip(self.overrides, self.drafted)]


@dataclass
class DFlash2Draft(DFlashDraft):
    name: str = "dflash"
    tallies: list[SelectorTally] = field(default_factory=list)    # one per decoded prompt (per `reset`)
    _last_block: Optional[tuple[int, "torch.Tensor"]] = None       # (anchor position, candidates [k, K]) to score

    @property
    def drafter(self) -> DFlash2Drafter:
        return cast("DFlash2Drafter", self.model)

    def reset(self) -> None:
        super().reset()
        self._last_block = None
        self.tallies.append(SelectorTally.empty(self.block_size - 1))

    def propose(self, committed: Sequence[int], features: Optional["torch.Tensor"], k: int,
                temperature: float) -> Proposal:
        import torch

        anchor_pos = len(committed) - 1
        assert features is not None and features.shape[0] == anchor_pos, "context features must cover the prefix"
        self._score_last_block(committed)
        with torch.no_grad():
            hidden = self._block_hidden(features, int(committed[-1]))[1:1 + min(k, self.proposed)]
            unary = self.drafter.logits(hidden)
            walk = self.drafter.selector.walk(unary, hidden, int(committed[-1]), temperature, self.generator)
        self._last_block = (anchor_pos, walk.candidates)
        self._count_overrides(walk.tokens, unary.argmax(dim=-1))
        tokens = [int(token) for token in walk.tokens]
        if walk.q is None:
            return Proposal(tokens=tokens)
        probs = torch.zeros(unary.shape, dtype=walk.q.dtype, device=walk.q.device)
        return Proposal(tokens=tokens, probs=probs.scatter_(1, walk.candidates, walk.q))

    def _tally(self) -> SelectorTally:
        if not self.tallies:
            self.tallies.append(SelectorTally.empty(self.block_size - 1))
        return self.tallies[-1]

    def _score_last_block(self, committed: Sequence[int]) -> None:
        """The previous block's candidates against the tokens the target verified for it (accepted + bonus)."""
        if self._last_block is None:
            return
        anchor_pos, candidates = self._last_block
        tally = self._tally()
        for slot, token in enumerate(committed[anchor_pos + 1:anchor_pos + 1 + candidates.shape[0]]):
            tally.verified[slot] += 1
            tally.hits[slot] += int(bool((candidates[slot] == token).any()))

    def _count_overrides(self, tokens: "torch.Tensor", unary_argmax: "torch.Tensor") -> None:
        tally = self._tally()
        for slot, different in enumerate((tokens != unary_argmax).tolist()):
            tally.drafted[slot] += 1
            tally.overrides[slot] += int(different)

    def tally_of_last(self, prompts: int) -> SelectorTally:
        """The counts of the last `prompts` decoded prompts (a warm-up decode before them is left out)."""
        total = SelectorTally.empty(self.block_size - 1)
        for tally in self.tallies[-prompts:] if prompts else []:
            total = total.add(tally)
        return total


def load_draft(checkpoint: str, target_model: PreTrainedModel, draft_tokens: int = 0) -> DFlashDraft:
    """The checkpoint's drafter as the decoder's `dflash` method: a DFlash 2 drafter drafts its
    selector's path (DFlash2Draft), a DFlash drafter its head's argmax (or samples); `draft_tokens`
    a step (eval.draft_tokens; 0: B - 1)."""
    from dflash.drafter.checkpoint_files import load_drafter
    from dflash.drafter.dflash2 import DFlash2Drafter

    model = load_drafter(checkpoint, target_model)
    if isinstance(model, DFlash2Drafter):
        return DFlash2Draft(model=model, draft_tokens=draft_tokens)
    return DFlashDraft(model=model, draft_tokens=draft_tokens)


def unary_draft(draft: DFlash2Draft) -> DFlashDraft:
    """The same DFlash 2 drafter drafting its unary argmax (`dflash_unary`): the selector switched off."""
    return DFlashDraft(model=draft.model, name=UNARY, use_cache=draft.use_cache, draft_tokens=draft.draft_tokens)


def with_unary(draft: DFlashDraft) -> list[DFlashDraft]:
    """The eval's drafter methods: `dflash`, and for a DFlash 2 drafter `dflash_unary` beside it."""
    return [draft, unary_draft(draft)] if isinstance(draft, DFlash2Draft) else [draft]


def with_selector_figures(report: EvalReport, draft: DFlashDraft, prompts: int) -> EvalReport:
    """The report with the DFlash 2 method's candidate recall and override share per block position
    (counted over the last `prompts` decoded prompts); unchanged for a DFlash drafter."""
    from dataclasses import replace

    if not isinstance(draft, DFlash2Draft) or draft.name not in report.methods:
        return report
    tally = draft.tally_of_last(prompts)
    method = replace(report.methods[draft.name], candidate_recall=tally.candidate_recall(),
                     selector_overrides=tally.override_share())
    return replace(report, methods={**report.methods, draft.name: method})
