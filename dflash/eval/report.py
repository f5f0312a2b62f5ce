"""The eval report: per-method and per-prompt figures as JSON, and the same as markdown tables.

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

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

TARGET = "target"


@dataclass
class MethodRun:
    """One prompt decoded by one method."""

    tokens: list[int]
    taus: list[int]
    wall_s: float


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


def method_summary(runs: Sequence[MethodRun], block_size: int, target_tokens_per_s: Optional[float],
                   identical: Optional[bool]) -> dict[str, Any]:
    taus = [tau for run in runs for tau in run.taus]
    tokens = sum(len(run.tokens) for run in runs)
    wall_s = sum(run.wall_s for run in runs)
    tokens_per_s = tokens / wall_s if wall_s > 0 else 0.0
    return {
        "mean_tau": sum(taus) / len(taus) if taus else 0.0,
        "steps": len(taus),
        "new_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / target_tokens_per_s if target_tokens_per_s else None,
        "tau_histogram": tau_histogram(taus, block_size),
        "position_acceptance": position_acceptance(taus, block_size),
        "identical_to_target": identical,
    }


def _identical(prompts: Sequence[PromptRuns], method: str, greedy: bool) -> Optional[bool]:
    if not greedy or method == TARGET:
        return None
    return all(p.runs[method].tokens == p.runs[TARGET].tokens for p in prompts)


def _prompt_entry(prompt: PromptRuns, greedy: bool) -> dict[str, Any]:
    target = prompt.runs[TARGET]
    target_rate = len(target.tokens) / target.wall_s if target.wall_s > 0 else 0.0
    methods = {}
    for name, run in prompt.runs.items():
        rate = len(run.tokens) / run.wall_s if run.wall_s > 0 else 0.0
        methods[name] = {
            "new_tokens": len(run.tokens), "steps": len(run.taus),
            "mean_tau": sum(run.taus) / len(run.taus) if run.taus else 0.0,
            "tokens_per_s": rate, "speedup": rate / target_rate if target_rate else None,
            "identical_to_target": (run.tokens == target.tokens) if greedy and name != TARGET else None,
        }
    return {"id": prompt.prompt_id, "prompt_tokens": prompt.prompt_tokens, "methods": methods}


def build_report(prompts: Sequence[PromptRuns], *, block_size: int, temperature: float,
                 context: dict[str, Any]) -> dict[str, Any]:
    """The report document; `context` (profile, target, checkpoint...) is copied in as is."""
    assert prompts and all(TARGET in p.runs for p in prompts), "every prompt needs a target-only run"
    greedy = temperature <= 0
    names = list(prompts[0].runs)
    target = method_summary([p.runs[TARGET] for p in prompts], block_size, None, None)
    methods = {TARGET: {**target, "speedup": 1.0}}
    for name in names:
        if name != TARGET:
            methods[name] = method_summary([p.runs[name] for p in prompts], block_size,
                                           target["tokens_per_s"], _identical(prompts, name, greedy))
    return {**context, "block_size": block_size, "temperature": temperature, "num_prompts": len(prompts),
            "methods": methods, "prompts": [_prompt_entry(p, greedy) for p in prompts]}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    methods, block = report["methods"], report["block_size"]
    lines = [f"# Speculative decoding eval: {report.get('profile', '')}", ""]
    lines += [f"Target `{report.get('target', '')}`, drafter `{report.get('checkpoint', '')}`, "
              f"block size {block}, temperature {report['temperature']}, {report['num_prompts']} prompts"
              f"{': ' + report['prompt_set'] if report.get('prompt_set') else ''}.", ""]
    lines += _table(["method", "mean tau", "steps", "new tokens", "tokens/s", "speedup", "identical to target"],
                    [[name, m["mean_tau"], m["steps"], m["new_tokens"], m["tokens_per_s"], m["speedup"],
                      m["identical_to_target"]] for name, m in methods.items()])
    drafted = [name for name in methods if name != TARGET]
    if report.get("also_sets"):
        lines += ["", "## Other prompt sets", ""]
        lines += _table(["prompt set", "prompts"] + [f"{n} tau" for n in drafted] + [f"{n} speedup" for n in drafted] + ["report"],
                        [[extra["prompt_set"], extra["num_prompts"]]
                         + [extra["methods"].get(n, {}).get("mean_tau") for n in drafted]
                         + [extra["methods"].get(n, {}).get("speedup") for n in drafted] + [extra["report"]]
                         for extra in report["also_sets"]])
    lines += ["", "## tau histogram (steps)", ""]
    lines += _table(["tau"] + drafted, [[t] + [methods[n]["tau_histogram"][str(t)] for n in drafted]
                                        for t in range(1, block + 1)])
    lines += ["", "## Acceptance per block position", ""]
    lines += _table(["position"] + drafted, [[k] + [methods[n]["position_acceptance"][k - 1] for n in drafted]
                                             for k in range(1, block)])
    lines += ["", "## Per prompt", ""]
    header = ["prompt", "prompt tokens", "new tokens"] + [f"{n} tau" for n in drafted] + [f"{n} speedup" for n in drafted]
    rows = [[p["id"], p["prompt_tokens"], p["methods"][TARGET]["new_tokens"]]
            + [p["methods"][n]["mean_tau"] for n in drafted] + [p["methods"][n]["speedup"] for n in drafted]
            for p in report["prompts"]]
    return "\n".join(lines + _table(header, rows)) + "\n"


def write_report(report: dict[str, Any], eval_dir) -> tuple:
    """`report.json` and `report.md` in `eval_dir`, each written atomically."""
    from pathlib import Path

    from launcher_core.fileio import write_json_atomic, write_text_atomic

    eval_dir = Path(eval_dir)
    return (write_json_atomic(eval_dir / "report.json", report),
            write_text_atomic(eval_dir / "report.md", render_markdown(report)))
