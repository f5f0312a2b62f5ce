"""The bisect's report: the culprit group, the memory delta it causes, every step taken; and the
plan (`--plan`): the groups, why each is one, what orders them, and the probe bound."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from envcheck.bisect.changes import Group
from envcheck.bisect.log import BisectLog, StepRecord
from envcheck.bisect.metadata import pin_key
from envcheck.bisect.runner import BisectPlan
from envcheck.bisect.search import probe_bound, search_state
from launcher_core.fileio import write_json_atomic, write_text_atomic


def build_report(plan: BisectPlan, log: BisectLog, complete: bool) -> dict[str, Any]:
    groups = plan.groups
    by_k = {step.k: step for step in log.steps}
    state = search_state(len(groups), {step.k: step.result for step in log.steps})
    first, last = state.culprit_range
    return {
        "complete": complete,
        "groups": group_entries(groups),
        "probes_used": sum(1 for step in log.steps if step.exit_code is not None),
        "probe_bound": probe_bound(len(groups)),
        "skipped": sum(1 for step in log.steps if step.result == "skip" and step.reason != "regrouped"),
        "regrouped": sum(1 for step in log.steps if step.reason == "regrouped"),
        "learned": [asdict(item) for item in log.learned],
        "culprit": _culprit(groups, by_k, state.lo, state.hi) if complete else None,
        "candidates_left": [groups[index - 1].name for index in range(first, last + 1)],
        "steps": [asdict(step) for step in log.steps],
        "log": str(log.path),
    }


def group_entries(groups: list[Group]) -> list[dict[str, Any]]:
    """Each group with its changes, the rules that made it, why, and what it is applied after."""
    return [{"index": index, "name": group.name, "changes": [change.describe() for change in group.changes],
             "rules": list(group.rules), "reasons": list(group.reasons),
             "after": [{"group": name, "reason": reason} for name, reason in group.after]}
            for index, group in enumerate(groups, start=1)]


def _culprit(groups: list[Group], by_k: dict[int, StepRecord], lo: int, hi: int) -> dict[str, Any]:
    good_memory = by_k[lo].memory_mib if lo in by_k else None
    bad_step = by_k.get(hi)
    bad_memory = bad_step.memory_mib if bad_step else None
    delta = round(bad_memory - good_memory, 1) if good_memory is not None and bad_memory is not None else None
    suspects = groups[lo:hi]
    return {
        "groups": [group.name for group in suspects],
        "packages": [name for group in suspects for name in group.packages],
        "changes": [change.describe() for group in suspects for change in group.changes],
        "why_together": [reason for group in suspects for reason in group.reasons],
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
    lines += [f"  learned after step {item['after_step']}: {item['mover']} needs {item['needs']} moved with or "
              f"before it ({item['reason']})" for item in report["learned"]]
    lines += ["", "groups (in bisect order):"]
    lines += [line for group in report["groups"] for line in _group_lines(group)]
    return "\n".join(lines)


def _group_lines(group: dict[str, Any]) -> list[str]:
    lines = [f"  {group['index']:>2} {group['name']}: {'; '.join(group['changes'])}",
             f"       rule: {', '.join(group['rules'])}"]
    lines += [f"         - {reason}" for reason in group["reasons"]]
    lines += [f"       after {item['group']}: {item['reason']}" for item in group["after"]]
    return lines


def build_plan_report(plan: BisectPlan) -> dict[str, Any]:
    """What `--plan` shows: groups, why, order, probe bound, where each version's metadata came from."""
    sides = [(change.name, pin) for change in plan.changes for pin in (change.old, change.new) if pin is not None]
    return {
        "good": plan.header["good"], "bad": plan.header["bad"],
        "changed_packages": len(plan.changes),
        "groups": group_entries(plan.groups),
        "probe_bound": probe_bound(len(plan.groups)),
        "metadata": {f"{name}=={pin.version}": (plan.metadata[pin_key(pin)].source if pin_key(pin) in plan.metadata
                                                else None) for name, pin in sides},
    }


def format_plan(plan_report: dict[str, Any]) -> str:
    groups = plan_report["groups"]
    lines = [f"{plan_report['changed_packages']} changed package(s) in {len(groups)} group(s); probe bound "
             f"{plan_report['probe_bound']} (GOOD + ceil(log2 {len(groups)}), without skips)",
             "", "groups (in bisect order):"]
    lines += [line for group in groups for line in _group_lines(group)]
    lines += ["", "metadata read (Requires-Dist):"]
    lines += [f"  {key}: {source or 'none readable (family fallback or alone)'}"
              for key, source in plan_report["metadata"].items()]
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
