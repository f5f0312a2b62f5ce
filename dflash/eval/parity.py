"""The parity gate of `eval --engine vllm`: the served acceptance against the in-process one.

The engine decodes the same token-id prompts that the in-process decoder decodes in the same eval
run (target alone, the DFlash drafter, prompt lookup). Side by side per method: mean tau,
acceptance per block position, identical to the target or not. The DFlash drafter's served tau
and per-position acceptance must lie within TAU_TOLERANCE / POSITION_TOLERANCE of the in-process
figures, else `ParityFailed` (exit code 6) names the first prompt and token position where the
served and in-process outputs diverge. Why a tolerance at all: vLLM's CPU float32 kernels
(attention, GEMMs, reduction order) differ from ours, so at a near-tie the greedy token can flip;
the continuation after a flip is different text, with a different acceptance.
The two per-position lists may differ in length (vLLM reports the `eval.draft_tokens` slots it
drafts, the in-process report every slot of the block): a slot one side does not list accepted
nothing there, and counts as 0.
Prompt lookup is shown, not gated: vLLM's n-gram proposer and ours pick matches differently.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import zip_longest
from typing import Optional, Sequence

from dflash.eval.records import TARGET, MethodFigures, ParityRow
from launcher_core.errors import ParityFailed

TAU_TOLERANCE = 0.10          # |served - in-process| mean tau of the DFlash drafter
POSITION_TOLERANCE = 0.10     # |served - in-process| acceptance at each block position
GATED_METHODS = ("dflash",)


@dataclass(frozen=True)
class Divergence:
    """Where a method's served output first differs from its in-process output."""

    prompt_index: int
    prompt_id: str
    position: int                 # index of the first differing new token
    served_token: Optional[int]   # None: the served output ended there
    inprocess_token: Optional[int]

    def describe(self) -> str:
        return (f"prompt {self.prompt_index + 1} ({self.prompt_id}), new token {self.position}: "
                f"served {self.served_token}, in-process {self.inprocess_token}")


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


def method_parity(name: str, served: MethodFigures, inprocess: MethodFigures, ids: Sequence[str],
                  served_tokens: Sequence[Sequence[int]], inprocess_tokens: Sequence[Sequence[int]]) -> ParityRow:
    """One method's row: both taus, both per-position acceptances, both losslessness flags, the divergence."""
    target = name == TARGET
    divergence = first_divergence(ids, served_tokens, inprocess_tokens)
    row = ParityRow(served_tau=1.0 if target else served.mean_tau, inprocess_tau=1.0 if target else inprocess.mean_tau,
                    served_position_acceptance=served.position_acceptance,
                    inprocess_position_acceptance=None if target else inprocess.position_acceptance,
                    served_identical_to_target=served.identical_to_target,
                    inprocess_identical_to_target=inprocess.identical_to_target,
                    same_tokens_as_inprocess=divergence is None,
                    first_divergence=divergence.describe() if divergence else None, gated=name in GATED_METHODS)
    return replace(row, within_tolerance=_within(row)) if row.gated else row


def _within(row: ParityRow) -> bool:
    if row.served_tau is None or row.inprocess_tau is None or abs(row.served_tau - row.inprocess_tau) > TAU_TOLERANCE:
        return False
    served, ours = row.served_position_acceptance or [], row.inprocess_position_acceptance or []
    return all(abs(a - b) <= POSITION_TOLERANCE for a, b in zip_longest(served, ours, fillvalue=0.0))


def check_parity(parity: dict[str, ParityRow], report_path: str) -> None:
    """ParityFailed naming the method, both taus and the first divergence, if a gated method is off."""
    for name, row in parity.items():
        if row.within_tolerance is False:
            where = row.first_divergence or "no token differs (the acceptance counts do)"
            raise ParityFailed(
                f"eval --engine: {name} served tau {_fmt(row.served_tau)} vs in-process {_fmt(row.inprocess_tau)}, "
                f"per position {_fmt_list(row.served_position_acceptance)} vs "
                f"{_fmt_list(row.inprocess_position_acceptance)}: beyond the tolerance (tau {TAU_TOLERANCE}, "
                f"per position {POSITION_TOLERANCE}); first divergence: {where}. Report: {report_path}\n"
                + "\n".join(parity_summary(parity)))


def parity_summary(parity: dict[str, ParityRow]) -> list[str]:
    """Served vs in-process, one line per method (the gate: dflash within the tolerance)."""
    lines = [f"served vs in-process, same token ids (gate: dflash tau within {TAU_TOLERANCE}, "
             f"acceptance per position within {POSITION_TOLERANCE}):"]
    for name, row in parity.items():
        tau = f"tau {_fmt(row.served_tau)} vs {_fmt(row.inprocess_tau)}" if row.served_tau is not None else "tau -"
        positions = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(row.served_position_acceptance or [],
                                                                  row.inprocess_position_acceptance or []))
        gate = {True: "  within tolerance", False: "  BEYOND TOLERANCE", None: ""}[row.within_tolerance]
        diverged = "" if row.same_tokens_as_inprocess else f" (first divergence: {row.first_divergence})"
        lines.append(f"  {name:<14} {tau}  per position {positions or '-'}  lossless "
                     f"{_yes(row.served_identical_to_target)}/{_yes(row.inprocess_identical_to_target)}  "
                     f"same tokens {_yes(row.same_tokens_as_inprocess)}{diverged}{gate}")
    return lines


def parity_lines(parity: dict[str, ParityRow]) -> list[str]:
    """The side-by-side table for the terminal and the markdown report."""
    lines = ["| method | served tau | in-process tau | served acceptance per position | in-process | "
             "lossless served / in-process | same tokens | first divergence | within tolerance |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in parity.items():
        lossless = f"{_yes(row.served_identical_to_target)} / {_yes(row.inprocess_identical_to_target)}"
        lines.append(f"| {name} | {_fmt(row.served_tau)} | {_fmt(row.inprocess_tau)} | "
                     f"{_fmt_list(row.served_position_acceptance)} | {_fmt_list(row.inprocess_position_acceptance)} | "
                     f"{lossless} | {_yes(row.same_tokens_as_inprocess)} | {row.first_divergence or '-'} | "
                     f"{_yes(row.within_tolerance)} |")
    return lines


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _fmt_list(values: Optional[Sequence[float]]) -> str:
    return "-" if not values else " ".join(f"{v:.2f}" for v in values)


def _yes(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")
