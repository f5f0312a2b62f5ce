"""The eval report built from the runs: per-method and per-prompt figures, written as JSON and as markdown
tables (the records and their JSON: dflash.eval.report_schema).

Definitions (all methods decode the same prompts with the same block size B):
* tau of a step = accepted draft tokens + 1 (the target's bonus token); mean tau = mean over all
  draft steps of all prompts (the prefill's first token is not a step).
* tau histogram: steps with tau = 1..B.
* acceptance at block position k (1..B-1): share of steps whose draft token at slot k was
  accepted (tau > k).
* tokens/s = new tokens / decoding wall time (prefill included); speedup = a method's tokens/s
  over target-only decoding's on the same prompts.
* identical_to_target (greedy only): every prompt's output equals target-only greedy decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from dflash.eval.report_schema import TARGET, EvalReport, MethodFigures, PromptFigures, ReportContext


@dataclass
class MethodRun:
    """One prompt decoded by one method."""

    tokens: list[int]
    taus: list[int]
    wall_s: float
    draft_margins: list[Optional[float]] = field(default_factory=list)    # greedy, per step (specdec.draft_margin)
    target_margins: list[Optional[float]] = field(default_factory=list)   # greedy, per step (specdec.target_margin)
    drafts: list[list[int]] = field(default_factory=list)                # the draft tokens each step proposed


@dataclass
class PromptRuns:
    prompt_id: str
    prompt_tokens: int
    runs: dict[str, MethodRun] = field(default_factory=dict)   # method name -> run


def tau_histogram(taus: Sequence[int], block_size: int) -> dict[str, int]:
    counts = {str(t): 0 for t in range(1, block_size + 1)}
    for tau in taus:
        counts[str(tau)] += 1
    return counts


def position_acceptance(taus: Sequence[int], block_size: int) -> list[float]:
    """[share of steps with tau > k for k in 1..B-1]."""
    if not taus:
        return [0.0] * (block_size - 1)
    return [sum(tau > k for tau in taus) / len(taus) for k in range(1, block_size)]


def _rate(tokens: int, wall_s: float) -> float:
    return tokens / wall_s if wall_s > 0 else 0.0


def method_summary(runs: Sequence[MethodRun], block_size: int, target_tokens_per_s: Optional[float],
                   identical: Optional[bool]) -> MethodFigures:
    taus = [tau for run in runs for tau in run.taus]
    tokens = sum(len(run.tokens) for run in runs)
    wall_s = sum(run.wall_s for run in runs)
    tokens_per_s = _rate(tokens, wall_s)
    return MethodFigures(
        mean_tau=sum(taus) / len(taus) if taus else 0.0, steps=len(taus), new_tokens=tokens, wall_s=wall_s,
        tokens_per_s=tokens_per_s, speedup=tokens_per_s / target_tokens_per_s if target_tokens_per_s else None,
        tau_histogram=tau_histogram(taus, block_size), position_acceptance=position_acceptance(taus, block_size),
        identical_to_target=identical)


def _identical(prompts: Sequence[PromptRuns], method: str, greedy: bool) -> Optional[bool]:
    if not greedy or method == TARGET:
        return None
    return all(p.runs[method].tokens == p.runs[TARGET].tokens for p in prompts)


def _prompt_figures(prompt: PromptRuns, greedy: bool) -> PromptFigures:
    target = prompt.runs[TARGET]
    target_rate = _rate(len(target.tokens), target.wall_s)
    methods = {}
    for name, run in prompt.runs.items():
        rate = _rate(len(run.tokens), run.wall_s)
        methods[name] = MethodFigures(
            new_tokens=len(run.tokens), steps=len(run.taus),
            mean_tau=sum(run.taus) / len(run.taus) if run.taus else 0.0,
            tokens_per_s=rate, speedup=rate / target_rate if target_rate else None,
            identical_to_target=(run.tokens == target.tokens) if greedy and name != TARGET else None)
    return PromptFigures(prompt.prompt_id, prompt.prompt_tokens, methods)


def build_report(prompts: Sequence[PromptRuns], *, block_size: int, temperature: float,
                 context: ReportContext = ReportContext()) -> EvalReport:
    """The in-process report of these decoded prompts; `context` says where they come from."""
    assert prompts and all(TARGET in p.runs for p in prompts), "every prompt needs a target-only run"
    greedy = temperature <= 0
    target = method_summary([p.runs[TARGET] for p in prompts], block_size, None, None)
    methods = {TARGET: replace(target, speedup=1.0)}
    for name in prompts[0].runs:
        if name != TARGET:
            methods[name] = method_summary([p.runs[name] for p in prompts], block_size,
                                           target.tokens_per_s, _identical(prompts, name, greedy))
    return EvalReport(block_size=block_size, temperature=temperature, num_prompts=len(prompts), methods=methods,
                      context=context, prompts=[_prompt_figures(p, greedy) for p in prompts])


def _fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def render_markdown(report: EvalReport) -> str:
    methods, block, context = report.methods, report.block_size, report.context
    drafted = list(report.drafted())
    lines = [f"# Speculative decoding eval: {context.profile or ''}", ""]
    lines += [f"Target `{context.target or ''}`, drafter `{context.checkpoint or ''}`, "
              f"block size {block}, temperature {report.temperature}, {report.num_prompts} prompts"
              f"{': ' + context.prompt_set if context.prompt_set else ''}.", ""]
    lines += mode_lines(context)
    lines += _table(["method", "mean tau", "steps", "new tokens", "tokens/s", "speedup", "identical to target"],
                    [[row_name(name, context), m.mean_tau, m.steps, m.new_tokens, m.tokens_per_s, m.speedup, m.identical_to_target]
                     for name, m in methods.items()])
    lines += _also_sets_table(report, drafted)
    lines += _benchmarks_table(report, drafted)
    lines += ["", "## tau histogram (steps)", ""]
    lines += _table(["tau"] + drafted, [[t] + [(methods[n].tau_histogram or {}).get(str(t)) for n in drafted]
                                        for t in range(1, block + 1)])
    lines += ["", "## Acceptance per block position", ""]
    lines += _table(["position"] + drafted, [[k] + [_at(methods[n].position_acceptance, k - 1) for n in drafted]
                                             for k in range(1, block)])
    return "\n".join(lines + _selector_table(report) + _per_prompt_table(report, drafted)) + "\n"


def mode_lines(context: ReportContext) -> list[str]:
    """How the prompts were rendered (dflash.eval.mode), and the mismatch measured on purpose."""
    lines = [f"Prompts rendered {context.rendering}.", ""] if context.rendering else []
    return lines + ([f"**{context.mode_mismatch}**", ""] if context.mode_mismatch else [])


def row_name(name: str, context: ReportContext) -> str:
    return f"{name} (mode mismatch, on purpose)" if context.mode_mismatch else name


def _selector_table(report: EvalReport) -> list[str]:
    """A DFlash 2 drafter: its selector path beside its unary argmax, per block position."""
    from dflash.eval.report_schema import DFLASH, DFLASH_UNARY

    path, unary, lift = report.methods.get(DFLASH), report.methods.get(DFLASH_UNARY), report.selector_lift()
    if path is None or path.candidate_recall is None:
        return []
    lines = ["", "## DFlash 2 selector", "",
             f"tau with the selector's path (`dflash`) {_fmt(path.mean_tau)}, with the unary argmax (`dflash_unary`) "
             f"{_fmt(unary.mean_tau if unary else None)}: the selector's lift {_fmt(lift, 3)}. Candidate recall: the "
             "verified token was among the selector's candidates; overrides: its token differs from the unary argmax.", ""]
    return lines + _table(["position", "selector path accepted", "unary accepted", "candidate recall", "overrides"],
                          [[k, _at(path.position_acceptance, k - 1), _at(unary.position_acceptance if unary else None, k - 1),
                            _at(path.candidate_recall, k - 1), _at(path.selector_overrides, k - 1)]
                           for k in range(1, report.block_size)])


def _at(values: Optional[Sequence[Optional[float]]], index: int) -> Optional[float]:
    return values[index] if values is not None and index < len(values) else None


def _also_sets_table(report: EvalReport, drafted: Sequence[str]) -> list[str]:
    sets = [extra for extra in report.also_sets if not extra.benchmark]
    if not sets:
        return []
    header = ["prompt set", "prompts"] + [f"{n} tau" for n in drafted] + [f"{n} speedup" for n in drafted] + ["report"]
    rows = [[extra.prompt_set, extra.num_prompts]
            + [extra.methods[n].mean_tau if n in extra.methods else None for n in drafted]
            + [extra.methods[n].speedup if n in extra.methods else None for n in drafted] + [extra.report]
            for extra in sets]
    return ["", "## Other prompt sets", "", *_table(header, rows)]


def _benchmarks_table(report: EvalReport, drafted: Sequence[str]) -> list[str]:
    """`eval.benchmarks`: one row per benchmark and drafting method (tau, acceptance per block position,
    speedup, lossless)."""
    sets = [extra for extra in report.also_sets if extra.benchmark]
    if not sets:
        return []
    header = ["benchmark", "decoded turns", "method", "mean tau", "acceptance at positions 1..B-1", "speedup",
              "identical to target", "report"]
    rows = [[extra.benchmark, extra.num_prompts, name, method.mean_tau, acceptance_cell(method.position_acceptance),
             method.speedup, method.identical_to_target, extra.report]
            for extra in sets for name in drafted if (method := extra.methods.get(name)) is not None]
    return ["", "## Benchmarks", "", *_table(header, rows)]


def acceptance_cell(shares: Optional[Sequence[float]]) -> Optional[str]:
    """`0.81 0.62 0.40 ...`: the accepted share at each block position, in one cell."""
    return None if shares is None else " ".join(f"{share:.2f}" for share in shares)


def _per_prompt_table(report: EvalReport, drafted: Sequence[str]) -> list[str]:
    header = ["prompt", "prompt tokens", "new tokens"] + [f"{n} tau" for n in drafted] + [f"{n} speedup" for n in drafted]
    rows = [[p.prompt_id, p.prompt_tokens, p.methods[TARGET].new_tokens]
            + [p.methods[n].mean_tau for n in drafted] + [p.methods[n].speedup for n in drafted]
            for p in report.prompts]
    return ["", "## Per prompt", "", *_table(header, rows)]


def write_report(report: EvalReport, eval_dir: Path) -> tuple[Path, Path]:
    """`report.json` and `report.md` in `eval_dir`, each written atomically."""
    from launcher_core.fileio import write_text_atomic

    return (report.write_json(Path(eval_dir) / "report.json"),
            write_text_atomic(Path(eval_dir) / "report.md", render_markdown(report)))
