"""The parity gate of `eval --engine`: is the drafter the engine serves the drafter we trained?

The engine decodes the token ids the in-process decoder decoded in the same run; both sides'
acceptance is compared per method. Up to a prompt's first near-tie (a deciding margin below
`specdec.draft_margin` or `specdec.target_margin`, where the engine's kernels may decide the other
way) the two must agree step for step where the engine reports ordered per-step figures, or, with
totals only, a prompt without any near-tie must match in its totals. Past it, prompts differ by chance, so a paired
two-sided sign test over prompts fails the gate below `SIGNIFICANCE`. The served stream must also be
lossless and must have drafted. Prompt lookup is shown, not gated. Per-position figures cover slots
1..B-1, a slot one side does not list counting as 0. Rules: docs/parity-gate.md; how
the constants were chosen: benchmarks/results/parity-gate_cpu-2core_2026-12-06.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import zip_longest
from typing import Any, Optional, Sequence

from dflash.eval.report_schema import TARGET, Departure, ParityRow, PromptParity
from launcher_core.errors import ParityFailed

# Chosen from the measured error rates (module doc; benchmarks/bench_parity_gate.py `choose_constants`): a step
# is a near-tie when a margin that decided it is below these many logits; the deterministic rule fails the gate
# when this many prompts depart before their first near-tie; the paired test fails it at this probability.
NEAR_TIE_DRAFT_LOGITS = 0.15
NEAR_TIE_TARGET_LOGITS = 0.02
PREFIX_PROMPTS = 4
SIGNIFICANCE = 0.005
GATED_METHODS = ("dflash",)
# The dtypes the constants were measured in (benchmarks/results/parity-gate_cpu-2core_2026-12-06.md). In another
# one the rounding moves margins far more (bfloat16: 14 of 64 prompts of a true drafter depart before their first
# near-tie at these margins, benchmarks/results/parity-dtype_cpu-2core_2026-12-07.md), so the rules that read
# margins cannot tell a wrong drafter from rounding there: the verdict is undecided until that dtype is measured.
CALIBRATED_DTYPES = ("float32",)
DTYPE_RECORD = "benchmarks/results/parity-dtype_cpu-2core_2026-12-07.md"

# The rules, by the name a failure reports.
RULE_NOT_SERVED = "drafted"
RULE_LOSSLESS = "lossless"
RULE_PREFIX = "deterministic prefix"
RULE_PAIRED = "paired test"

# The verdict of a gated method: a rule broken fails it; otherwise it passes only where its rules could have
# failed a wrong drafter that stays lossless (enough prompts, the engine's per-step figures).
VERDICT_PASS, VERDICT_FAIL, VERDICT_UNDECIDED = "pass", "fail", "undecided"


@dataclass(frozen=True)
class GateConstants:
    """The gate's constants (the defaults are the measured ones; the benchmark sweeps others)."""

    draft_logits: float = NEAR_TIE_DRAFT_LOGITS
    target_logits: float = NEAR_TIE_TARGET_LOGITS
    prefix_prompts: int = PREFIX_PROMPTS       # the gate fails when this many prompts depart before their near-tie
    significance: float = SIGNIFICANCE

    def describe(self) -> str:
        prompts = "no prompt" if self.prefix_prompts == 1 else f"fewer than {self.prefix_prompts} prompts"
        return (f"{prompts} departing before their first near-tie (a decisive margin under {self.draft_logits:g} "
                f"drafter / {self.target_logits:g} target logits), no paired two-sided sign test over prompts at "
                f"p < {self.significance:g}, lossless")


@dataclass(frozen=True)
class PromptAcceptance:
    """One prompt decoded by one side: its new tokens, its speculative steps and accepted draft tokens;
    `per_step` the accepted drafts of each step in order (None where the side gives totals only);
    in-process and greedy, the margins that decided each step (specdec.draft_margin / target_margin)."""

    tokens: list[int]
    steps: int = 0
    accepted: int = 0
    per_step: Optional[list[int]] = None
    draft_margins: Sequence[Optional[float]] = ()
    target_margins: Sequence[Optional[float]] = ()
    drafts: Sequence[Sequence[int]] = ()      # in-process: the draft tokens each step proposed

    def first_near_tie(self, constants: GateConstants) -> Optional[int]:
        """The index of the first step decided by a near-tie; None when no step was."""
        for step, (draft, target) in enumerate(zip_longest(self.draft_margins, self.target_margins)):
            if (draft is not None and draft < constants.draft_logits) or \
                    (target is not None and target < constants.target_logits):
                return step
        return None

    @property
    def rate(self) -> Optional[float]:
        """Accepted drafts per step (None: no step)."""
        return self.accepted / self.steps if self.steps else None


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
        position = first_difference(theirs, ours)
        if position is not None:
            pick = lambda tokens: tokens[position] if position < len(tokens) else None  # noqa: E731
            return Divergence(index, prompt_id, position, pick(theirs), pick(ours))
    return None


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where two token lists differ (the shorter one's end counts); None when equal."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class PairedTest:
    """The paired sign test over prompts: how many accepted fewer / more drafts per step served than
    in-process, and the two-sided probability of a split at least this uneven from a drafter served as trained."""

    fewer: int
    more: int
    p_value: float

    @classmethod
    def of(cls, served: Sequence[PromptAcceptance], inprocess: Sequence[PromptAcceptance]) -> PairedTest:
        differences = [theirs.rate - ours.rate for theirs, ours in zip(served, inprocess)
                       if theirs.rate is not None and ours.rate is not None]
        fewer, more = sum(d < 0 for d in differences), sum(d > 0 for d in differences)
        return cls(fewer, more, sign_test(fewer, more))


@lru_cache(maxsize=4096)
def sign_test(fewer: int, more: int) -> float:
    """Two-sided exact sign test: P(a Binomial(n, 1/2) split at least as uneven), n = fewer + more."""
    n = fewer + more
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(fewer, more) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def smallest_p_value(prompts: int) -> float:
    """The sign test's p when every one of `prompts` prompts differs the same way: below a significance of
    0.005 only from 9 prompts on."""
    return sign_test(prompts, 0)


def prompts_for_paired_test(significance: float) -> int:
    """The fewest prompts on which the paired test can fail (9 at a significance of 0.005)."""
    return next(n for n in range(1, 64) if smallest_p_value(n) < significance)


def first_departure(served: PromptAcceptance, ours: PromptAcceptance, constants: GateConstants) -> Optional[Departure]:
    """The first step before the prompt's first near-tie where the served side accepted other drafts than
    in-process, with both sides' figures there (None: none, or no per-step figures on either side)."""
    if served.per_step is None or ours.per_step is None:
        return None
    tie = ours.first_near_tie(constants)
    for step in range(len(ours.per_step) if tie is None else tie):
        theirs = served.per_step[step] if step < len(served.per_step) else None
        if theirs != ours.per_step[step]:
            start = 1 + sum(accepted + 1 for accepted in ours.per_step[:step])
            return Departure(step + 1, start, theirs, ours.per_step[step], _item(ours.draft_margins, step),
                             _item(ours.target_margins, step), list(_item(ours.drafts, step) or []),
                             list(ours.tokens[start:start + ours.per_step[step] + 1]))
    return None


def _item(values: Sequence[Any], index: int) -> Any:
    """values[index], None past the end (a side that recorded fewer steps)."""
    return values[index] if index < len(values) else None


def prefix_mismatch(served: PromptAcceptance, ours: PromptAcceptance, constants: GateConstants) -> Optional[str]:
    """How the served decoding departs from the in-process one before the prompt's first near-tie
    (None: it does not). Without the engine's per-step figures only a prompt with no near-tie is
    checked, on its totals."""
    tie = ours.first_near_tie(constants)
    where = f"before its first near-tie (step {tie + 1})" if tie is not None else "with no near-tie in it"
    if served.per_step is None or ours.per_step is None:
        if tie is None and (served.steps, served.accepted, served.tokens) != (ours.steps, ours.accepted, ours.tokens):
            return (f"{where}: served {served.accepted} accepted drafts over {served.steps} steps, in-process "
                    f"{ours.accepted} over {ours.steps}")
        return None
    upto = len(ours.per_step) if tie is None else tie
    for step in range(upto):
        theirs = served.per_step[step] if step < len(served.per_step) else None
        if theirs != ours.per_step[step]:
            return (f"step {step + 1} {where}: served accepted {'no step' if theirs is None else theirs} "
                    f"draft(s), in-process {ours.per_step[step]}")
    if tie is None and len(served.per_step) != len(ours.per_step):
        return f"{where}: served {len(served.per_step)} steps, in-process {len(ours.per_step)}"
    committed = 1 + sum(accepted + 1 for accepted in ours.per_step[:upto])   # the prefill's token, then each step's
    position = first_difference(served.tokens[:committed], ours.tokens[:committed])
    if position is not None:
        return f"new token {position} {where}: served {_at(served.tokens, position)}, in-process {_at(ours.tokens, position)}"
    return None


def _at(tokens: Sequence[int], position: int) -> str:
    return str(tokens[position]) if position < len(tokens) else "nothing (ended)"


def method_parity(name: str, served: SideFigures, inprocess: SideFigures, ids: Sequence[str],
                  served_target: Optional[Sequence[Sequence[int]]] = None,
                  constants: GateConstants = GateConstants(), dtype: str = "float32") -> ParityRow:
    """One method's row: both sides' figures, where their tokens diverge and, gated, the gate's verdict.
    `served_target`: the engine's own target-only tokens per prompt (what `lossless` was measured against);
    `dtype`: what both sides decoded in (model.dtype)."""
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
    return Verdict(served, inprocess, ids, served_target, constants, dtype).row(row)


@dataclass(frozen=True)
class Verdict:
    """The gate's rules applied to one gated method."""

    served: SideFigures
    inprocess: SideFigures
    ids: Sequence[str]
    served_target: Optional[Sequence[Sequence[int]]]
    constants: GateConstants = GateConstants()
    dtype: str = "float32"

    def row(self, row: ParityRow) -> ParityRow:
        paired = PairedTest.of(self.served.prompts, self.inprocess.prompts)
        prompts = self.prompt_rows()
        broken = {RULE_NOT_SERVED: self.not_served(), RULE_LOSSLESS: self.lossless_failure(),
                  RULE_PREFIX: self.prefix_failure(prompts), RULE_PAIRED: self.paired_failure(paired)}
        untrusted = self.untrusted_findings(broken)
        broken = {rule: None if rule in untrusted else message for rule, message in broken.items()}
        failures = [message for message in broken.values() if message]
        pairs = list(zip(self.served.prompts, self.inprocess.prompts))
        same = [(s, o) for s, o in pairs if s.tokens == o.tokens]
        undecided = [] if failures else [*self.undecided(), *untrusted.values()]
        verdict = VERDICT_FAIL if failures else (VERDICT_UNDECIDED if undecided else VERDICT_PASS)
        return replace(row, prompts_same_tokens=len(same),
                       prompts_same_acceptance=sum(_same_acceptance(s, o) for s, o in same),
                       steps_before_near_tie=self.steps_before_near_tie(), prompts_fewer=paired.fewer,
                       prompts_more=paired.more, p_value=paired.p_value,
                       conclusive=smallest_p_value(len(pairs)) < self.constants.significance,
                       failed_rules=[rule for rule, message in broken.items() if message], failures=failures,
                       within_tolerance={VERDICT_PASS: True, VERDICT_FAIL: False}.get(verdict), prompts=prompts,
                       verdict=verdict, undecided=undecided, rules_ran=self.rules_ran())

    def prompt_rows(self) -> list[PromptParity]:
        rows = []
        for prompt_id, served, ours in zip(self.ids, self.served.prompts, self.inprocess.prompts):
            tie = ours.first_near_tie(self.constants)
            rows.append(PromptParity(prompt_id, served.steps, served.accepted, ours.steps, ours.accepted,
                                     None if tie is None else tie + 1, prefix_mismatch(served, ours, self.constants),
                                     first_departure(served, ours, self.constants)))
        return rows

    def untrusted_findings(self, broken: dict[str, Optional[str]]) -> dict[str, str]:
        """In a dtype the constants were not measured in, what the margin-reading rules found, as reasons the
        gate cannot decide (rounding alone departs that often there): {rule: reason}."""
        if self.dtype in CALIBRATED_DTYPES:
            return {}
        return {rule: f"the {rule} rule found: {broken[rule]}; in {self.dtype} a drafter served as trained does "
                      f"that too" for rule in (RULE_PREFIX, RULE_PAIRED) if broken[rule]}

    def undecided(self) -> list[str]:
        """Why a wrong drafter that stays lossless could pass here: too few prompts for the deterministic rule
        or the paired test to fail, no per-step figures from the engine, or a dtype the near-tie margins were
        not measured in ([] where the rules can decide)."""
        reasons, count = [], len(self.served.prompts)
        if self.dtype not in CALIBRATED_DTYPES:
            reasons.append(f"both sides decoded in {self.dtype}; the near-tie margins are measured in "
                           f"{', '.join(CALIBRATED_DTYPES)} only, and {self.dtype}'s rounding departs a true drafter "
                           f"as often as a wrong one ({DTYPE_RECORD}): a {self.dtype} calibration of the gate is "
                           "needed (the lossless and served rules still apply)")
        needed = max(1, self.constants.prefix_prompts)
        if count < needed:
            reasons.append(f"{count} prompt(s): the deterministic rule fails from {needed} departing prompts and the "
                           f"paired test from {prompts_for_paired_test(self.constants.significance)} differing ones; "
                           f"at least {needed} prompts are needed (--num-prompts, eval.num_prompts)")
        totals_only = sum(prompt.per_step is None for prompt in self.served.prompts)
        if totals_only:
            reasons.append(f"the engine gave no per-step acceptance for {totals_only} of {count} prompts: those are "
                           "compared on their totals only where they have no near-tie, which misses most wrong "
                           "drafters; per-step figures are needed (vLLM >= 0.32; SGLang streaming one step a chunk)")
        return reasons

    def rules_ran(self) -> list[str]:
        """Each rule applied to this method, and on what."""
        count = len(self.served.prompts)
        per_step = sum(prompt.per_step is not None for prompt in self.served.prompts)
        lossless = "against the engine's own target-only output" if self.served.lossless is not None else \
            "not run (no target-only run to compare, or sampled decoding)"
        paired = f"p < {self.constants.significance:g} over {count} prompts" + \
            ("" if smallest_p_value(count) < self.constants.significance else
             f" (cannot fail below {prompts_for_paired_test(self.constants.significance)} prompts)")
        margins = "" if self.dtype in CALIBRATED_DTYPES else \
            f" (in {self.dtype}, where the margins are not measured: its findings leave the verdict undecided)"
        return [f"{RULE_NOT_SERVED}: the engine reported speculative steps", f"{RULE_LOSSLESS}: {lossless}",
                f"{RULE_PREFIX}: step by step on {per_step} of {count} prompts, totals of near-tie-free prompts on "
                f"the other {count - per_step}; fails from {self.constants.prefix_prompts} departing prompts{margins}",
                f"{RULE_PAIRED}: {paired}{margins}"]

    def not_served(self) -> Optional[str]:
        if self.inprocess.mean_tau is not None and self.served.mean_tau is None:
            return "the engine reported no speculative step: the drafter was not served"
        return None

    def lossless_failure(self) -> Optional[str]:
        if self.served.lossless is not False:
            return None
        where = ""
        if self.served_target is not None:
            divergence = first_divergence(self.ids, [p.tokens for p in self.served.prompts], self.served_target)
            where = f" (first difference: {divergence.describe('with the drafter', 'target alone')})" if divergence else ""
        return (f"the served output is not lossless: with the drafter the engine's output differs from its "
                f"target-only output{where}")

    def prefix_failure(self, prompts: Sequence[PromptParity]) -> Optional[str]:
        found = [(index, prompt) for index, prompt in enumerate(prompts) if prompt.prefix_mismatch]
        if len(found) < max(1, self.constants.prefix_prompts):
            return None
        listed = "; ".join(f"prompt {index + 1} ({prompt.prompt_id}): {prompt.prefix_mismatch}"
                           for index, prompt in found[:3])
        more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
        return (f"{len(found)} of {len(prompts)} prompts decoded differently where the same drafter must decode "
                f"alike, before any near-tie: {listed}{more}")

    def paired_failure(self, paired: PairedTest) -> Optional[str]:
        if paired.p_value >= self.constants.significance:
            return None
        direction = "fewer" if paired.fewer > paired.more else "more"
        count = max(paired.fewer, paired.more)
        return (f"the served drafter accepted {direction} drafts per step than in-process on {count} of the "
                f"{paired.fewer + paired.more} prompts that differ (paired two-sided sign test p = {paired.p_value:.2g} "
                f"< {self.constants.significance:g}: a drafter served as trained splits this unevenly less often)")

    def steps_before_near_tie(self) -> int:
        """The in-process steps the deterministic rule compared one by one (or as whole prompts)."""
        total = 0
        for served, ours in zip(self.served.prompts, self.inprocess.prompts):
            tie = ours.first_near_tie(self.constants)
            if served.per_step is not None or tie is None:
                total += ours.steps if tie is None else tie
        return total


def _same_acceptance(served: PromptAcceptance, ours: PromptAcceptance) -> bool:
    if served.per_step is not None and ours.per_step is not None:
        return served.per_step == ours.per_step
    return (served.steps, served.accepted) == (ours.steps, ours.accepted)


def check_parity(parity: dict[str, ParityRow], report_path: str) -> None:
    """ParityFailed naming each divergence of every gated method that failed the gate, or why the gate could not
    decide (undecided never passes); its last line names the rules broken and the report to read."""
    check_parity_sets([("", parity, report_path)])


def check_parity_sets(sets: Sequence[tuple[str, dict[str, ParityRow], str]]) -> None:
    """`check_parity` over every prompt set of one served check at once ((label, parity rows, report path) each):
    every set is gated and named, not only the first one that fails."""
    failed = [(label, parity, report) for label, parity, report in sets if _verdicts(parity) & {VERDICT_FAIL}]
    undecided = [(label, parity, report) for label, parity, report in sets
                 if _verdicts(parity) & {VERDICT_UNDECIDED} and (label, parity, report) not in failed]
    if not failed and not undecided:
        return
    lines, reports = ["eval --engine: the served drafter is not the trained one" if failed else
                      "eval --engine: the parity gate cannot decide whether the served drafter is the trained one"], []
    for label, parity, report in failed + undecided:
        lines += ([f"{label}:"] if label else []) + parity_summary(parity)
        reports.append(report)
    rules = tuple(sorted({rule for _, parity, _ in failed for row in parity.values() for rule in row.failed_rules or []}
                         | ({VERDICT_UNDECIDED} if undecided else set())))
    verb = "failed" if failed else "undecided"
    lines.append(f"parity gate {verb} ({', '.join(rules)}): read {', '.join(reports)} (per prompt: its .md) and "
                 "docs/parity-gate.md")
    raise ParityFailed("\n".join(lines), rules, reports[0])


def _verdicts(parity: dict[str, ParityRow]) -> set[Optional[str]]:
    return {row.verdict for row in parity.values() if row.gated}


def parity_summary(parity: dict[str, ParityRow]) -> list[str]:
    """Served vs in-process, one line per method, then the gate's notes."""
    lines = [f"served vs in-process, same token ids (gate on dflash: {GateConstants().describe()}):"]
    for name, row in parity.items():
        tau = f"tau {_fmt(row.served_tau)} vs {_fmt(row.inprocess_tau)}" if row.served_tau is not None else "tau -"
        positions = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip_longest(row.served_position_acceptance or [],
                                                                          row.inprocess_position_acceptance or [],
                                                                          fillvalue=0.0))
        gate = {VERDICT_PASS: "  PASS", VERDICT_FAIL: "  FAIL", VERDICT_UNDECIDED: "  UNDECIDED"}.get(row.verdict or "", "")
        diverged = "" if row.same_tokens_as_inprocess else f" (first divergence: {row.first_divergence})"
        lines.append(f"  {name:<14} {tau}  per position {positions or '-'}  lossless "
                     f"{_yes(row.served_identical_to_target)}/{_yes(row.inprocess_identical_to_target)}  "
                     f"same tokens {_yes(row.same_tokens_as_inprocess)}{diverged}{gate}")
        lines += [f"    {failure}" for failure in row.failures or []]
        if row.gated:
            departed = sum(1 for prompt in row.prompts or [] if prompt.prefix_mismatch)
            lines.append(f"    {row.steps_before_near_tie} steps compared one by one before their prompt's first "
                         f"near-tie, {departed} prompt(s) departing there (the gate fails from "
                         f"{GateConstants().prefix_prompts}); {row.prompts_same_acceptance} of {row.prompts_same_tokens} "
                         f"prompts with identical tokens accepted the same drafts; after near-ties {row.prompts_fewer} "
                         f"prompts accepted fewer served, {row.prompts_more} more (p = {_fmt(row.p_value)})")
        if row.conclusive is False:
            lines.append(f"    note: on this few prompts the paired test cannot reach p < {GateConstants().significance:g} "
                         "even if every prompt differed the same way: only the deterministic and lossless rules decide")
        lines += [f"    undecided: {reason}" for reason in row.undecided or []]
        lines += [f"    departed with no near-tie, {p.prompt_id}: {p.departure.describe()}"
                  for p in row.prompts or [] if p.departure is not None]
    return lines


def parity_lines(parity: dict[str, ParityRow]) -> list[str]:
    """The side-by-side table for the markdown report."""
    lines = ["| method | served tau | in-process tau | steps served / in-process | served acceptance per position "
             "| in-process | lossless served / in-process | same tokens | prompts with equal acceptance | steps "
             "compared before near-ties | fewer / more served (p) | first divergence | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in parity.items():
        lossless = f"{_yes(row.served_identical_to_target)} / {_yes(row.inprocess_identical_to_target)}"
        steps = f"{_int(row.served_steps)} / {_int(row.inprocess_steps)}"
        prompts = f"{row.prompts_same_acceptance} of {row.prompts_same_tokens}" if row.prompts_same_tokens is not None \
            else "-"
        paired = f"{row.prompts_fewer} / {row.prompts_more} ({_fmt(row.p_value)})" if row.p_value is not None else "-"
        gate = {VERDICT_PASS: "pass", VERDICT_FAIL: "FAIL: " + "; ".join(row.failures or []),
                VERDICT_UNDECIDED: "UNDECIDED: " + "; ".join(row.undecided or [])}.get(row.verdict or "", "-")
        lines.append(f"| {name} | {_fmt(row.served_tau)} | {_fmt(row.inprocess_tau)} | {steps} | "
                     f"{_fmt_list(row.served_position_acceptance)} | {_fmt_list(row.inprocess_position_acceptance)} | "
                     f"{lossless} | {_yes(row.same_tokens_as_inprocess)} | {prompts} | "
                     f"{_int(row.steps_before_near_tie)} | {paired} | {row.first_divergence or '-'} | {gate} |")
    return lines


def prompt_parity_lines(parity: dict[str, ParityRow]) -> list[str]:
    """Per prompt of each gated method: both sides' steps and accepted drafts, the first near-tie and the
    deterministic rule's finding."""
    lines = []
    for name, row in parity.items():
        if not row.prompts:
            continue
        lines += ["", f"### {name}, per prompt", "", "| prompt | served steps / accepted | in-process steps / accepted "
                  "| first near-tie step | before it |", "|---|---|---|---|---|"]
        lines += [f"| {p.prompt_id} | {p.served_steps} / {p.served_accepted} | {p.inprocess_steps} / "
                  f"{p.inprocess_accepted} | {_int(p.first_near_tie)} | {p.prefix_mismatch or 'identical'} |"
                  for p in row.prompts]
        lines += ["", f"Rules that ran on {name}: " + "; ".join(row.rules_ran or ["-"])]
        departed = [p for p in row.prompts if p.departure is not None]
        if departed:
            lines += ["", f"### {name}, where the served drafter departed before any near-tie", "",
                      "The engine reports no logits: the margins are the in-process ones. A large drafter margin with "
                      "the same context means the served drafter computed something else; a small one, the engine's "
                      "kernels.", "", "| prompt | step | new token | accepted served / in-process | in-process drafts "
                      "| target's tokens | drafter margin | target margin |", "|---|---|---|---|---|---|---|---|"]
            lines += [_departure_line(p.prompt_id, p.departure) for p in departed if p.departure is not None]
    return lines


def _departure_line(prompt_id: str, departure: Departure) -> str:
    served = "-" if departure.served_accepted is None else str(departure.served_accepted)
    return (f"| {prompt_id} | {departure.step} | {departure.new_token} | {served} / {departure.inprocess_accepted} | "
            f"{departure.drafts} | {departure.target_tokens} | {_fmt(departure.drafter_margin)} | "
            f"{_fmt(departure.target_margin)} |")


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _int(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _fmt_list(values: Optional[Sequence[float]]) -> str:
    return "-" if not values else " ".join(f"{v:.2f}" for v in values)


def _yes(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")
