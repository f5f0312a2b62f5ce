"""The bisect's report: the culprit group, the memory delta it causes, every step taken."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from envcheck.bisect.log import BisectLog, StepRecord
from envcheck.bisect.runner import BisectPlan
from envcheck.bisect.search import probe_bound, search_state
from core.fileio import write_json_atomic, write_text_atomic


def build_report(plan: BisectPlan, log: BisectLog, complete: bool) -> dict[str, Any]:
    groups = plan.groups
    by_k = {step.k: step for step in log.steps}
    state = search_state(len(groups), {step.k: step.result for step in log.steps})
    first, last = state.culprit_range
    return {
        "complete": complete,
        "groups": [{"index": index, "name": group.name, "changes": [change.describe() for change in group.changes]}
                   for index, group in enumerate(groups, start=1)],
        "probes_used": sum(1 for step in log.steps if step.exit_code is not None),
        "probe_bound": probe_bound(len(groups)),
        "culprit": _culprit(groups, by_k, state.lo, state.hi) if complete else None,
        "candidates_left": [groups[index - 1].name for index in range(first, last + 1)],
        "steps": [asdict(step) for step in log.steps],
        "log": str(log.path),
    }


def _culprit(groups: list, by_k: dict[int, StepRecord], lo: int, hi: int) -> dict[str, Any]:
    good_memory = by_k[lo].memory_mib if lo in by_k else None
    bad_step = by_k.get(hi)
    bad_memory = bad_step.memory_mib if bad_step else None
    delta = round(bad_memory - good_memory, 1) if good_memory is not None and bad_memory is not None else None
    suspects = groups[lo:hi]
    return {
        "groups": [group.name for group in suspects],
        "changes": [change.describe() for group in suspects for change in group.changes],
        "exact": hi - lo == 1,
        "memory_delta_mib": delta,
        "last_good_k": lo,
        "first_bad_k": hi,
        "first_bad_probed": bad_step is not None,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [_culprit_line(report), _probes_line(report), "", "steps:"]
    lines.append(f"  {'#':>2} {'k':>3}  {'result':<6} {'reason':<15} {'MiB':>8} {'build s':>8} {'probe s':>8}  environment")
    lines += [_step_line(step, report) for step in report["steps"]]
    lines += ["", "groups (in bisect order):"]
    lines += [f"  {group['index']:>2} {group['name']}: {'; '.join(group['changes'])}" for group in report["groups"]]
    return "\n".join(lines)


def _culprit_line(report: dict[str, Any]) -> str:
    culprit = report["culprit"]
    if culprit is None:
        return f"bisect incomplete: candidates left {', '.join(report['candidates_left'])}; rerun to resume"
    what = "culprit" if culprit["exact"] else "culprit is one of (the others in between could not be tested)"
    delta = _delta_text(culprit["memory_delta_mib"], culprit["first_bad_probed"])
    caveat = "" if culprit["first_bad_probed"] else " [unconfirmed: BAD was assumed bad; rerun with --verify-bad]"
    return f"{what}: {', '.join(culprit['groups'])} ({'; '.join(culprit['changes'])}); memory delta {delta}{caveat}"


def _delta_text(delta: Optional[float], probed: bool) -> str:
    if delta is not None:
        return f"{delta:+.1f} MiB"
    return "unknown" if not probed else "unknown (the probe wrote no report)"


def _probes_line(report: dict[str, Any]) -> str:
    return (f"probes used: {report['probes_used']} for {len(report['groups'])} changed group(s) "
            f"(bound without skips: {report['probe_bound']})")


def _step_line(step: dict[str, Any], report: dict[str, Any]) -> str:
    memory = "-" if step["memory_mib"] is None else f"{step['memory_mib']:.1f}"
    build = sum(step["seconds"].get(stage, 0.0) for stage in ("venv", "install", "check"))
    probe = step["seconds"].get("probe")
    environment = "GOOD" if step["k"] == 0 else "GOOD + " + ", ".join(step["groups"])
    return (f"  {step['step']:>2} {step['k']:>3}  {step['result']:<6} {step['reason'] or '-':<15} {memory:>8} "
            f"{build:>8.2f} {'-' if probe is None else f'{probe:.2f}':>8}  {environment}")


def save_report(report: dict[str, Any], work_dir: Path) -> None:
    write_json_atomic(work_dir / "report.json", report)
    write_text_atomic(work_dir / "report.md", "```\n" + format_report(report) + "\n```\n")
