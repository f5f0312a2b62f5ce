"""The parity gate of `eval --engine`: is the drafter the engine serves the drafter we trained?

The engine decodes the token ids the in-process decoder decoded in the same eval run (target
alone, the DFlash drafter, prompt lookup), and both sides' acceptance is compared per method. A
gated method (the DFlash drafter) fails the gate, naming each divergence, when:

* its served gain is off: |served tau - in-process tau| > max(GAIN_SHARE x (in-process tau - 1),
  STANDARD_ERRORS x the standard error of that difference), or the served gain (tau - 1) is below
  GAIN_FLOOR x the in-process gain. The gain, not raw tau, because tau >= 1 for any drafter: a
  served drafter that accepts nothing sits 0.08 below a weak trained one (tau 1.08), inside any
  fixed tolerance, yet it has lost all of the drafter's gain;
* its served stream is not lossless (greedy: not token for token the engine's own target-only
  output);
* on prompts where the served and in-process token streams are identical, the number of steps or
  of accepted draft tokens differs, and the in-process drafter's own near-ties do not explain it.
  The same drafter proposes the same drafts from the same tokens, so such a prompt's acceptance
  must be equal, except where a draft was a near-tie: the engine's kernels and ours then pick
  different tokens and that step accepts a different number of drafts. Near-ties are measured, not
  assumed: the in-process decoder counts, per prompt, the steps at which a slot the acceptance
  reached was decided by less than `NEAR_TIE_LOGITS` (dflash/eval/specdec.py `near_tie_step`: an
  accepted draft led the drafter's next choice by less, or a rejected draft led the target's token
  by less). A differing prompt passes when it had at least one such step, its step count differs
  by at most its number of them, and its accepted drafts by at most that many blocks' drafts
  (B - 1 each); a prompt without a measured near-tie must accept exactly the same drafts.

Why a tolerance at all: the engine's kernels (attention, fused GEMMs, reduction order) differ from
ours, so at a near-tie the greedy token can flip, in the target or in the drafter; after a flip the
continuation is different text with a different acceptance. The standard error (from each side's
per-step acceptance counts) says how far such a change can move the mean on this many steps.
When the in-process gain is itself within STANDARD_ERRORS standard errors of zero, the gain rules
cannot tell a dead served drafter from this one: the row says so (`conclusive` false) and only the
losslessness and per-prompt rules decide. Prompt lookup is shown, not gated: the engines' n-gram
proposers match differently from ours, and vLLM counts only the steps where it proposed something.

The per-position figures cover slots 1..B-1 on both sides. With `eval.draft_tokens` k < B - 1 the
engines draft only k slots (vLLM's counters list k positions, SGLang's histogram stops at k): a
slot one side does not list accepted nothing there and counts as 0 (`positions_of_histogram`
pads to B - 1; the summary pads whichever list is shorter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Optional, Sequence

from dflash.eval.records import TARGET, ParityRow
from dflash.eval.specdec import NEAR_TIE_LOGITS
from launcher_core.errors import ParityFailed

GAIN_SHARE = 0.10         # |served - in-process| tau may reach this share of the in-process gain (tau - 1) ...
STANDARD_ERRORS = 3.0     # ... or this many standard errors of the difference, whichever is larger
GAIN_FLOOR = 0.90         # the served gain must reach this share of the in-process gain
GATED_METHODS = ("dflash",)
RULE = (f"|served - in-process| tau <= max({GAIN_SHARE} x in-process gain, {STANDARD_ERRORS:g} standard errors), "
        f"served gain >= {GAIN_FLOOR} x in-process gain, lossless, equal acceptance on prompts with identical tokens "
        f"(a prompt may differ only by its measured drafter near-ties)")


@dataclass(frozen=True)
class PromptAcceptance:
    """One prompt decoded by one side: its new tokens, its speculative steps and accepted draft tokens."""

    tokens: list[int]
    steps: int = 0
    accepted: int = 0
    near_ties: int = 0            # in-process, greedy: steps whose drafts were decided by a near-tie (specdec.near_tie_step)


@dataclass(frozen=True)
class SideFigures:
    """One method decoded by one side (served or in-process), as the gate reads it."""

    prompts: list[PromptAcceptance]
    histogram: list[int] = field(default_factory=list)   # steps that accepted k draft tokens, k = 0, 1, ...
    position_acceptance: Optional[list[float]] = None   # share of steps accepting the draft at slot k = 1..B-1
    lossless: Optional[bool] = None                      # greedy: the output equals target-only decoding

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.prompts)

    @property
    def mean_tau(self) -> Optional[float]:
        """1 + accepted draft tokens per step; None when no step drafted."""
        steps = self.steps
        return 1.0 + sum(p.accepted for p in self.prompts) / steps if steps else None

    @property
    def standard_error(self) -> Optional[float]:
        """Of the mean tau: the per-step acceptance's sample deviation over sqrt(steps); None without a
        histogram of every step."""
        steps = self.steps
        if steps < 2 or sum(self.histogram) != steps:
            return None
        mean = sum(k * n for k, n in enumerate(self.histogram)) / steps
        variance = sum(n * (k - mean) ** 2 for k, n in enumerate(self.histogram)) / (steps - 1)
        return math.sqrt(variance / steps)


def histogram_of_taus(taus: Sequence[int]) -> list[int]:
    """Per-step tau values -> steps that accepted k draft tokens (tau = k + 1)."""
    counts = [0] * (max(taus, default=0))
    for tau in taus:
        counts[tau - 1] += 1
    return counts


def histogram_of_positions(steps: int, accepted_at: Sequence[float]) -> list[int]:
    """vLLM's counters -> the histogram: `accepted_at[k]` steps accepted the draft at slot k + 1,
    and a step that accepted slot k + 1 accepted every slot before it."""
    at = [int(round(value)) for value in accepted_at]
    reached = [steps, *at]                        # steps that accepted at least k drafts, k = 0..B-1
    return [reached[k] - (reached[k + 1] if k + 1 < len(reached) else 0) for k in range(len(reached))]


def positions_of_histogram(histogram: Sequence[int], slots: int) -> Optional[list[float]]:
    """Share of steps accepting the draft at slot k = 1..slots (SGLang reports the histogram)."""
    steps = sum(histogram)
    if not steps:
        return None
    return [sum(histogram[k:]) / steps for k in range(1, slots + 1)]


@dataclass(frozen=True)
class Divergence:
    """Where one token stream first differs from another."""

    prompt_index: int
    prompt_id: str
    position: int                 # index of the first differing new token
    served_token: Optional[int]   # None: the stream ended there
    inprocess_token: Optional[int]

    def describe(self, left: str = "served", right: str = "in-process") -> str:
        return (f"prompt {self.prompt_index + 1} ({self.prompt_id}), new token {self.position}: "
                f"{left} {self.served_token}, {right} {self.inprocess_token}")


def first_divergence(ids: Sequence[str], served: Sequence[Sequence[int]],
                     inprocess: Sequence[Sequence[int]]) -> Optional[Divergence]:
    """The first prompt (and token) where the two token lists differ; None when all are equal."""
    for index, (prompt_id, ours, theirs) in enumerate(zip(ids, inprocess, served)):
        if list(ours) == list(theirs):
            continue
        position = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        pick = lambda tokens: tokens[position] if position < len(tokens) else None  # noqa: E731
        return Divergence(index, prompt_id, position, pick(theirs), pick(ours))
    return None


def method_parity(name: str, served: SideFigures, inprocess: SideFigures, ids: Sequence[str],
                  served_target: Optional[Sequence[Sequence[int]]] = None, *, block_size: int) -> ParityRow:
    """One method's row: both sides' figures, where their tokens diverge and, gated, the gate's verdict.
    `served_target`: the engine's own target-only tokens per prompt (what `lossless` was measured against);
    `block_size`: the drafter's B (a near-tie step may accept up to B - 1 drafts more or fewer)."""
    served_tokens = [p.tokens for p in served.prompts]
    divergence = first_divergence(ids, served_tokens, [p.tokens for p in inprocess.prompts])
    target = name == TARGET
    row = ParityRow(served_tau=1.0 if target else served.mean_tau, inprocess_tau=1.0 if target else inprocess.mean_tau,
                    served_position_acceptance=served.position_acceptance,
                    inprocess_position_acceptance=None if target else inprocess.position_acceptance,
                    served_identical_to_target=served.lossless, inprocess_identical_to_target=inprocess.lossless,
                    same_tokens_as_inprocess=divergence is None,
                    first_divergence=divergence.describe() if divergence else None, gated=name in GATED_METHODS,
                    served_steps=None if target else served.steps, inprocess_steps=None if target else inprocess.steps)
    if not row.gated:
        return row
    verdict = _Verdict(served, inprocess, ids, served_target, block_size)
    return verdict.row(row)


class _Verdict:
    """The gate's rules applied to one gated method."""

    def __init__(self, served: SideFigures, inprocess: SideFigures, ids: Sequence[str],
                 served_target: Optional[Sequence[Sequence[int]]], block_size: int):
        self.served, self.inprocess, self.ids, self.served_target = served, inprocess, ids, served_target
        self.block_size = block_size

    def row(self, row: ParityRow) -> ParityRow:
        from dataclasses import replace

        tolerance, error = self.tolerance()
        same, equal, near_tie, first_unequal = self.prompt_acceptance()
        failures = [*self.gain_failures(tolerance, error), *self.lossless_failures(),
                    *([first_unequal] if first_unequal else [])]
        return replace(row, tolerance=tolerance, standard_error=error, prompts_same_tokens=same,
                       prompts_same_acceptance=equal, prompts_near_tie=near_tie, failures=failures, conclusive=self.conclusive(),
                       within_tolerance=not failures)

    def difference_error(self) -> Optional[float]:
        errors = [self.served.standard_error, self.inprocess.standard_error]
        return math.sqrt(sum(e * e for e in errors if e is not None)) if any(e is not None for e in errors) else None

    def tolerance(self) -> tuple[Optional[float], Optional[float]]:
        tau = self.inprocess.mean_tau
        if tau is None:
            return None, self.difference_error()
        error = self.difference_error()
        return max(GAIN_SHARE * (tau - 1.0), STANDARD_ERRORS * (error or 0.0)), error

    def conclusive(self) -> Optional[bool]:
        """Whether the in-process gain stands clear of zero (else a dead served drafter passes the gain rules)."""
        tau, error = self.inprocess.mean_tau, self.inprocess.standard_error
        if tau is None:
            return None
        return tau - 1.0 > STANDARD_ERRORS * (error or 0.0)

    def gain_failures(self, tolerance: Optional[float], error: Optional[float]) -> list[str]:
        served, ours = self.served.mean_tau, self.inprocess.mean_tau
        if ours is None:
            return []
        if served is None:
            return ["the engine reported no speculative step: the drafter was not served"]
        failures = []
        if tolerance is not None and abs(served - ours) > tolerance:
            failures.append(f"served tau {served:.3f} vs in-process {ours:.3f}: they differ by {abs(served - ours):.3f}, "
                            f"beyond the tolerance {tolerance:.3f} (the larger of {GAIN_SHARE} x the in-process gain "
                            f"{ours - 1:.3f} and {STANDARD_ERRORS:g} standard errors {STANDARD_ERRORS * (error or 0):.3f})")
        if served - 1.0 < GAIN_FLOOR * (ours - 1.0):
            failures.append(f"served gain (tau - 1) {served - 1:.3f} is below {GAIN_FLOOR} x the in-process gain "
                            f"{ours - 1:.3f}: the served drafter accepts less than the trained one")
        return failures

    def lossless_failures(self) -> list[str]:
        if self.served.lossless is not False:
            return []
        where = ""
        if self.served_target is not None:
            divergence = first_divergence(self.ids, [p.tokens for p in self.served.prompts], self.served_target)
            where = f" (first difference: {divergence.describe('with the drafter', 'target alone')})" if divergence else ""
        return [f"the served output is not lossless: with the drafter the engine's output differs from its "
                f"target-only output{where}"]

    def prompt_acceptance(self) -> tuple[int, int, int, Optional[str]]:
        """(prompts with identical tokens, those accepting the same drafts, those differing within their
        measured near-ties, the failure described or None)."""
        same, unequal = 0, []
        for index, (served, ours) in enumerate(zip(self.served.prompts, self.inprocess.prompts)):
            if served.tokens != ours.tokens:
                continue
            same += 1
            if (served.steps, served.accepted) != (ours.steps, ours.accepted):
                unequal.append((index, served, ours))
        unexplained = [entry for entry in unequal if not _within_near_ties(entry[1], entry[2], self.block_size)]
        explained = len(unequal) - len(unexplained)
        if not unexplained:
            return same, same - len(unequal), explained, None
        listed = "; ".join(f"prompt {index + 1} ({self.ids[index]}): served {served.accepted} accepted drafts over "
                           f"{served.steps} steps vs in-process {ours.accepted} over {ours.steps}, "
                           f"{ours.near_ties} near-tie step(s)" for index, served, ours in unexplained[:4])
        more = f"; and {len(unexplained) - 4} more" if len(unexplained) > 4 else ""
        return same, same - len(unequal), explained, (
            f"{len(unexplained)} of {same} prompts with identical tokens accepted differently beyond what the in-process "
            f"drafter's near-ties explain (a prompt may differ by one step per near-tie step, drafts decided by less "
            f"than {NEAR_TIE_LOGITS:g} logits): {listed}{more}")


def _within_near_ties(served: PromptAcceptance, ours: PromptAcceptance, block_size: int) -> bool:
    """Each near-tie step can flip one draft: the step count moves by at most one per near-tie step,
    the accepted drafts by at most one block's drafts (B - 1) per near-tie step."""
    ties = ours.near_ties
    return ties > 0 and abs(served.steps - ours.steps) <= ties and \
        abs(served.accepted - ours.accepted) <= ties * max(block_size - 1, 1)


def check_parity(parity: dict[str, ParityRow], report_path: str) -> None:
    """ParityFailed naming each divergence of every gated method that failed the gate."""
    failed = {name: row for name, row in parity.items() if row.within_tolerance is False}
    if failed:
        reasons = "; ".join(f"{name}: {failure}" for name, row in failed.items() for failure in row.failures or [])
        raise ParityFailed(f"eval --engine: the served drafter is not the trained one: {reasons}. Report: "
                           f"{report_path}\n" + "\n".join(parity_summary(parity)))


def parity_summary(parity: dict[str, ParityRow]) -> list[str]:
    """Served vs in-process, one line per method, then the gate's notes."""
    lines = [f"served vs in-process, same token ids (gate on dflash: {RULE}):"]
    for name, row in parity.items():
        tau = f"tau {_fmt(row.served_tau)} vs {_fmt(row.inprocess_tau)}" if row.served_tau is not None else "tau -"
        positions = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip_longest(row.served_position_acceptance or [],
                                                                          row.inprocess_position_acceptance or [],
                                                                          fillvalue=0.0))
        gate = {True: "  PASS", False: "  FAIL", None: ""}[row.within_tolerance]
        diverged = "" if row.same_tokens_as_inprocess else f" (first divergence: {row.first_divergence})"
        lines.append(f"  {name:<14} {tau}  per position {positions or '-'}  lossless "
                     f"{_yes(row.served_identical_to_target)}/{_yes(row.inprocess_identical_to_target)}  "
                     f"same tokens {_yes(row.same_tokens_as_inprocess)}{diverged}{gate}")
        lines += [f"    {failure}" for failure in row.failures or []]
        if row.prompts_near_tie:
            lines.append(f"    {row.prompts_same_acceptance} of {row.prompts_same_tokens} prompts with identical tokens "
                         f"accepted the same drafts; {row.prompts_near_tie} differed within their measured drafter "
                         f"near-ties (drafts decided by less than {NEAR_TIE_LOGITS:g} logits)")
        if row.conclusive is False:
            lines.append(f"    note: the in-process gain {_fmt((row.inprocess_tau or 1.0) - 1.0)} is within "
                         f"{STANDARD_ERRORS:g} standard errors of 0: the gain rules cannot tell this drafter from one "
                         "that accepts nothing; only losslessness and the per-prompt rule decide")
    return lines


def parity_lines(parity: dict[str, ParityRow]) -> list[str]:
    """The side-by-side table for the markdown report."""
    lines = ["| method | served tau | in-process tau | steps served / in-process | tolerance | served acceptance "
             "per position | in-process | lossless served / in-process | same tokens | prompts with equal "
             "acceptance | first divergence | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in parity.items():
        lossless = f"{_yes(row.served_identical_to_target)} / {_yes(row.inprocess_identical_to_target)}"
        steps = f"{_int(row.served_steps)} / {_int(row.inprocess_steps)}"
        prompts = (f"{row.prompts_same_acceptance} of {row.prompts_same_tokens}"
                   + (f" (+{row.prompts_near_tie} within their near-ties)" if row.prompts_near_tie else "")
                   if row.prompts_same_tokens is not None else "-")
        gate = {True: "pass", False: "FAIL: " + "; ".join(row.failures or []), None: "-"}[row.within_tolerance]
        lines.append(f"| {name} | {_fmt(row.served_tau)} | {_fmt(row.inprocess_tau)} | {steps} | "
                     f"{_fmt(row.tolerance)} | {_fmt_list(row.served_position_acceptance)} | "
                     f"{_fmt_list(row.inprocess_position_acceptance)} | {lossless} | {_yes(row.same_tokens_as_inprocess)} "
                     f"| {prompts} | {row.first_divergence or '-'} | {gate} |")
    return lines


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _int(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _fmt_list(values: Optional[Sequence[float]]) -> str:
    return "-" if not values else " ".join(f"{v:.2f}" for v in values)


def _yes(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")
