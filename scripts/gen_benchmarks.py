#!/usr/bin/env python3
"""BENCHMARKS.md's tables and the README's demo figures, generated from the records under benchmarks/results/.

    python scripts/gen_benchmarks.py            # rewrite the generated parts of BENCHMARKS.md and README.md
    python scripts/gen_benchmarks.py --check    # exit 1, naming each part that differs from the records

A record whose figures BENCHMARKS.md shows starts with its figures header: an HTML comment (nothing of it is
rendered) holding a JSON list of rows, one per benchmark the record measured:

    <!-- figures
    [
      {
        "benchmark": "audit-vs-collect-env",
        "title": "preflight audit vs `torch.utils.collect_env`",
        "command": "`bench_audit.py --repeat 5`",
        "figure": "audit 0.426 s vs 5.786 s: **0.074x**",
        "target": "<= 0.5x",
        "date": "2026-11-30",
        "machine": "cpu-2core",
        "records": ["audit-vs-collect-env_cpu-2core_2026-11-30.md"]
      }
    ]
    -->

Each benchmark id has one current row: the newest by `date`. On the same date a row wins only by naming the
other rows' records in its `supersedes`; otherwise the two claims are ambiguous and nothing is written. The rows
that lost (and those that say why they are `superseded`) go to BENCHMARKS.md's superseded table. The README's
figures come from the current row of the README's first command (`readme`). Every field: HEADER_FIELDS.

tests/test_benchmarks_table.py runs `--check`, so a hand edit of a generated part fails the suite.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent
for _path in (REPO_ROOT, SCRIPTS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gen_docs_tables import _region, _table, regenerated  # noqa: E402  (the docs tables' markers and table format)

COMMAND = "python scripts/gen_benchmarks.py"
RESULTS = "benchmarks/results"
HEADER_OPEN = "<!-- figures"
HEADER_CLOSE = "-->"
README_BENCHMARK = "demo-pipeline"
SECTIONS = ("current", "suite")
BENCHMARK_ID = re.compile(r"[a-z0-9]+(?:[.-][a-z0-9]+)*")
COMMIT = re.compile(r"[0-9a-f]{7,40}")

# Every key a header row may have, and what is valid for it (the error for a bad value quotes this).
HEADER_FIELDS = {
    "benchmark": "a stable id, lowercase words joined by '-' or '.' (the same in every record of that benchmark)",
    "title": "what was measured, as BENCHMARKS.md's first column says it",
    "command": "the command that measured it (markdown)",
    "figure": "the figure as the record's body states it (markdown)",
    "target": "the target it is held against, or '-'",
    "date": "the day the figure was measured, YYYY-MM-DD",
    "machine": "the machine and its state, e.g. 'cpu-2core, idle'",
    "records": "a list of the files under benchmarks/results/ the row links, this record among them",
    "commit": "the commit measured, 7 to 40 lowercase hex digits (required in the suite section)",
    "section": "'current' (the current figures, the default) or 'suite' (the test suite's time)",
    "supersedes": "a list of records under benchmarks/results/ whose rows of this benchmark this row replaces",
    "superseded": "why this row is no longer current (it goes to the superseded table)",
    "readme": 'the README\'s demo figures: {"run": text, "table": [[header cells], [row cells], ...], "note": text}',
}
REQUIRED_FIELDS = ("benchmark", "title", "command", "figure", "target", "date", "machine", "records")


class HeaderError(ValueError):
    """A record's figures header that cannot be read, or rows that cannot be resolved to one current row each."""


@dataclass(frozen=True)
class DemoFigures:
    """What the README shows of the demo's current run: one sentence, a table, a note."""

    run: str
    table: tuple[tuple[str, ...], ...]
    note: str


@dataclass(frozen=True)
class FigureRow:
    """One row of a record's figures header."""

    record: str  # the file under benchmarks/results/ whose header holds the row
    benchmark: str
    title: str
    command: str
    figure: str
    target: str
    date: str
    machine: str
    records: tuple[str, ...]
    commit: str | None = None
    section: str = "current"
    supersedes: tuple[str, ...] = ()
    superseded: str | None = None
    readme: DemoFigures | None = None


@dataclass(frozen=True)
class Standing:
    """The rows resolved: the current row of each benchmark, and each older row with the row that replaced it."""

    current: list[FigureRow]
    superseded: list[tuple[FigureRow, FigureRow | None]] = field(default_factory=list)


def _invalid(where: str, key: str, value: Any) -> HeaderError:
    return HeaderError(f"{where}: `{key}` is {json.dumps(value, ensure_ascii=False)}; valid: {HEADER_FIELDS[key]}")


def _is_text(value: Any) -> bool:
    """One non-empty string that cannot close the header's comment."""
    return isinstance(value, str) and bool(value.strip()) and HEADER_CLOSE not in value


def _text(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if isinstance(value, str) and _is_text(value):
        return value
    raise _invalid(where, key, value)


def _optional_text(row: dict[str, Any], key: str, where: str) -> str | None:
    return _text(row, key, where) if key in row else None


def _date(row: dict[str, Any], where: str) -> str:
    value = _text(row, "date", where)
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", value) and datetime.date.fromisoformat(value):
            return value
    except ValueError:
        pass
    raise _invalid(where, "date", value)


def _files(row: dict[str, Any], key: str, where: str, results: Path) -> tuple[str, ...]:
    """A list of file names under `results`; each must exist there."""
    value = row.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(name, str) for name in value):
        raise _invalid(where, key, value)
    for name in value:
        if "/" in name or "\\" in name or not (results / name).is_file():
            raise HeaderError(f"{where}: `{key}` names {json.dumps(name)}, which is not a file in {RESULTS}/; "
                              f"valid: {HEADER_FIELDS[key]}")
    return tuple(value)


def _demo_figures(row: dict[str, Any], where: str) -> DemoFigures | None:
    if "readme" not in row:
        return None
    value = row["readme"]
    if not isinstance(value, dict) or set(value) != {"run", "table", "note"}:
        raise _invalid(where, "readme", value)
    table = value["table"]
    well_formed = (_is_text(value["run"]) and _is_text(value["note"]) and isinstance(table, list) and len(table) >= 2
                   and all(isinstance(line, list) and line and all(_is_text(cell) for cell in line) for line in table)
                   and len({len(line) for line in table}) == 1)
    if not well_formed:
        raise _invalid(where, "readme", value)
    return DemoFigures(run=value["run"], table=tuple(tuple(line) for line in table), note=value["note"])


def parse_row(row: Any, where: str, record: str, results: Path) -> FigureRow:
    """One header row, every field checked; HeaderError naming the record, the row and the field."""
    if not isinstance(row, dict):
        raise HeaderError(f"{where}: a row is a JSON object with the keys {', '.join(REQUIRED_FIELDS)}")
    unknown = sorted(set(row) - set(HEADER_FIELDS))
    if unknown:
        raise HeaderError(f"{where}: unknown key `{unknown[0]}`; valid keys: {', '.join(HEADER_FIELDS)}")
    missing = [key for key in REQUIRED_FIELDS if key not in row]
    if missing:
        raise HeaderError(f"{where}: `{missing[0]}` is missing; valid: {HEADER_FIELDS[missing[0]]}")
    benchmark = _text(row, "benchmark", where)
    if not BENCHMARK_ID.fullmatch(benchmark):
        raise _invalid(where, "benchmark", benchmark)
    where = f"{where} ({benchmark})"
    records = _files(row, "records", where, results)
    if record not in records:
        raise HeaderError(f"{where}: `records` does not name {record} itself; valid: {HEADER_FIELDS['records']}")
    section = row.get("section", "current")
    if section not in SECTIONS:
        raise _invalid(where, "section", section)
    commit = _optional_text(row, "commit", where)
    if (commit is None and section == "suite") or (commit is not None and not COMMIT.fullmatch(commit)):
        raise _invalid(where, "commit", commit)
    supersedes = _files(row, "supersedes", where, results) if "supersedes" in row else ()
    if record in supersedes:
        raise HeaderError(f"{where}: `supersedes` names the record itself; valid: {HEADER_FIELDS['supersedes']}")
    return FigureRow(record=record, benchmark=benchmark, title=_text(row, "title", where),
                     command=_text(row, "command", where), figure=_text(row, "figure", where),
                     target=_text(row, "target", where), date=_date(row, where), machine=_text(row, "machine", where),
                     records=records, commit=commit, section=section, supersedes=supersedes,
                     superseded=_optional_text(row, "superseded", where), readme=_demo_figures(row, where))


def header_rows(path: Path, results: Path) -> list[FigureRow]:
    """The rows of one record's figures header ([] for a record without one)."""
    where = f"{RESULTS}/{path.name}"
    text = path.read_text(encoding="utf-8")
    if not text.startswith(HEADER_OPEN + "\n"):
        if HEADER_OPEN in text:
            raise HeaderError(f"{where}: a figures header must open the file: its first line `{HEADER_OPEN}`, "
                              f"then the JSON rows, then a line `{HEADER_CLOSE}`")
        return []
    lines = text.split("\n")
    try:
        close = lines.index(HEADER_CLOSE)
    except ValueError:
        raise HeaderError(f"{where}: the figures header has no closing line `{HEADER_CLOSE}`") from None
    try:
        rows = json.loads("\n".join(lines[1:close]))
    except json.JSONDecodeError as error:
        raise HeaderError(f"{where}, line {error.lineno + 1}: the figures header is not JSON: {error.msg}") from None
    if not isinstance(rows, list) or not rows:
        raise HeaderError(f"{where}: the figures header is a JSON list of one or more rows")
    return [parse_row(row, f"{where}: figures header, row {number}", path.name, results)
            for number, row in enumerate(rows, start=1)]


def read_rows(root: Path) -> list[FigureRow]:
    """Every header row of every record under `root`/benchmarks/results/, in file order."""
    results = root / RESULTS
    return [row for path in sorted(results.glob("*.md")) for row in header_rows(path, results)]


def _newest(benchmark: str, claims: list[FigureRow]) -> FigureRow:
    """The one row of `claims` (same benchmark, same date) that supersedes all the others' records."""
    winners = [row for row in claims
               if all(other.record in row.supersedes for other in claims if other is not row)]
    if len(winners) != 1:
        names = ", ".join(sorted(row.record for row in claims))
        raise HeaderError(f"benchmark `{benchmark}`: {len(claims)} rows claim its current row with the same date "
                          f"{claims[0].date} ({names}); name the replaced record in the newer row's `supersedes`")
    return winners[0]


def resolve(rows: Sequence[FigureRow]) -> Standing:
    """One current row per benchmark (the newest), the others superseded, each list newest first (then by
    benchmark id); HeaderError on an ambiguous claim."""
    by_benchmark: dict[str, list[FigureRow]] = {}
    for row in rows:
        by_benchmark.setdefault(row.benchmark, []).append(row)
    standing = Standing(current=[])
    for benchmark in sorted(by_benchmark):
        group = by_benchmark[benchmark]
        sections = sorted({row.section for row in group})
        if len(sections) > 1:
            raise HeaderError(f"benchmark `{benchmark}`: its rows are in the sections {' and '.join(sections)}; "
                              "one benchmark is in one section")
        live = [row for row in group if row.superseded is None]
        current = _newest(benchmark, [row for row in live if row.date == max(r.date for r in live)]) if live else None
        if current is not None:
            standing.current.append(current)
        standing.superseded.extend((row, None if row.superseded else current) for row in group if row is not current)
    standing.current.sort(key=lambda row: row.date, reverse=True)  # newest first; a stable sort keeps the ids' order
    standing.superseded.sort(key=lambda pair: pair[0].date, reverse=True)
    return standing


def _links(files: Sequence[str]) -> str:
    """Markdown links to records, each named by its topic (the file name before the first `_`), or by its whole
    name where two share a topic."""
    topics = [name.split("_")[0] for name in files]
    labels = [topic if topics.count(topic) == 1 else name.removesuffix(".md") for topic, name in zip(topics, files)]
    return ", ".join(f"[{label}]({RESULTS}/{name})" for label, name in zip(labels, files))


def _figures_table(rows: Sequence[FigureRow]) -> str:
    return _table(["benchmark", "command", "figure", "target", "date", "commit", "machine", "record"],
                  [[row.title, row.command, row.figure, row.target, row.date, row.commit or "-", row.machine,
                    _links(row.records)] for row in rows])


def render_current(standing: Standing) -> str:
    return _figures_table([row for row in standing.current if row.section == "current"])


def render_suite(standing: Standing) -> str:
    return _figures_table([row for row in standing.current if row.section == "suite"])


def render_superseded(standing: Standing) -> str:
    def why(row: FigureRow, by: FigureRow | None) -> str:
        return f"{_links([by.record])} ({by.date})" if by is not None else row.superseded or "-"

    return _table(["benchmark", "figure", "date", "machine", "record", "replaced by"],
                  [[row.title, row.figure, row.date, row.machine, _links(row.records), why(row, by)]
                   for row, by in standing.superseded])


def render_readme(standing: Standing) -> str:
    """The README's demo figures: the current row of the README's first command, its `readme` part."""
    row = next((row for row in standing.current if row.benchmark == README_BENCHMARK), None)
    if row is None or row.readme is None:
        raise HeaderError(f"benchmark `{README_BENCHMARK}`: its current row has no `readme` part; "
                          f"valid: {HEADER_FIELDS['readme']}")
    demo = row.readme
    head = f"What the default profile's run reached {demo.run} ({row.date}, {row.machine}; [record]({RESULTS}/{row.record})):"
    return f"{head}\n\n{_table(demo.table[0], demo.table[1:])}\n\n{demo.note}"


# doc (relative to the repository root) -> its generated parts, by name, each rendered from the resolved rows.
GENERATED: dict[str, dict[str, Callable[[Standing], str]]] = {
    "BENCHMARKS.md": {"current-figures": render_current, "suite-figures": render_suite,
                      "superseded-figures": render_superseded},
    "README.md": {"demo-figures": render_readme},
}


def _parts(standing: Standing, doc: str) -> dict[str, Callable[[], str]]:
    return {name: functools.partial(render, standing) for name, render in GENERATED[doc].items()}


def stale_parts(root: Path) -> list[str]:
    """`DOC: NAME` for each generated part under `root` that differs from what the records generate."""
    standing = resolve(read_rows(root))
    stale = []
    for doc in GENERATED:
        path = root / doc
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        for name, render in _parts(standing, doc).items():
            match = _region(name).search(text)
            if match is None or match.group(2) != "\n" + render() + "\n\n":
                stale.append(f"{doc}: {name}")
    return stale


def write_parts(root: Path) -> list[str]:
    """Rewrite each doc whose generated parts are stale; the docs rewritten."""
    from launcher_core.fileio import write_text_atomic

    standing = resolve(read_rows(root))
    written = []
    for doc in GENERATED:
        path = root / doc
        before = path.read_text(encoding="utf-8")
        after = regenerated(before, _parts(standing, doc), doc)
        if after != before:
            write_text_atomic(path, after)
            written.append(doc)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a generated part is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the repository read (default: this one)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_parts(args.root)
            for part in stale:
                print(f"{part}: differs from the records; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1 if stale else 0
        for doc in write_parts(args.root):
            print(f"{doc}: regenerated")
    except ValueError as error:  # HeaderError, or a doc without its markers
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
