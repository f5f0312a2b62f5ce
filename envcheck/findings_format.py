"""Findings for people (a table grouped by status, with hints) and for machines (JSON)."""
from __future__ import annotations

import textwrap
from dataclasses import asdict
from typing import Sequence

from envcheck.checks import STATUS_ORDER, Finding
from launcher_core.errors import EXIT_FAIL, EXIT_OK, EXIT_WARN_STRICT


def counts(findings: Sequence[Finding]) -> dict[str, int]:
    return {status: sum(1 for f in findings if f.status == status) for status in STATUS_ORDER}


def exit_code(findings: Sequence[Finding], strict: bool = False) -> int:
    """0 nothing failed, 1 any FAIL, 3 a WARN under --strict."""
    tally = counts(findings)
    if tally["FAIL"]:
        return EXIT_FAIL
    return EXIT_WARN_STRICT if strict and tally["WARN"] else EXIT_OK


def format_table(findings: Sequence[Finding], title: str = "", width: int = 100) -> str:
    width_id = max((len(f.id) for f in findings), default=8)
    lines = [title] if title else []
    for status in STATUS_ORDER:
        group = [f for f in findings if f.status == status]
        if not group:
            continue
        lines.append(f"\n{status} ({len(group)})")
        for finding in group:
            lines.extend(_format_finding(finding, width_id, width))
    tally = counts(findings)
    lines.append("\n" + ", ".join(f"{n} {status}" for status, n in tally.items()))
    return "\n".join(lines)


def _format_finding(finding: Finding, width_id: int, width: int) -> list[str]:
    indent = " " * (width_id + 4)
    body = textwrap.wrap(finding.message, width=max(40, width - len(indent)), break_on_hyphens=False) or [""]
    lines = [f"  {finding.id:<{width_id}}  {body[0]}", *(indent + line for line in body[1:])]
    if finding.hint and finding.status in ("FAIL", "WARN"):
        lines.append(f"{indent}-> {finding.hint}")
    return lines


def findings_document(findings: Sequence[Finding], **context: object) -> dict:
    return {**context, "counts": counts(findings), "findings": [asdict(f) for f in findings]}
