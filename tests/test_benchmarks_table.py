"""BENCHMARKS.md's tables and the README's demo figures are generated from the records' figures headers
(scripts/gen_benchmarks.py): a hand edit of a generated part fails here, naming the part and the command that
regenerates it; so do a malformed header (naming the record and the key), a row linking a file that is not
there, and two records claiming one benchmark's current row on the same date."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_benchmarks.py"
RESULTS = "benchmarks/results"
REGENERATE = "regenerate it with `python scripts/gen_benchmarks.py`"


def import_script():
    spec = importlib.util.spec_from_file_location("gen_benchmarks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = import_script()


def copy_repo(root: Path) -> Path:
    """The generator's inputs and outputs: BENCHMARKS.md, README.md and the records."""
    for doc in ("BENCHMARKS.md", "README.md"):
        shutil.copyfile(REPO / doc, root / doc)
    shutil.copytree(REPO / RESULTS, root / RESULTS)
    return root


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--root", str(root)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def read_header(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!-- figures\n")
    return json.loads(text.split("\n", 1)[1].split("\n-->\n", 1)[0])


def write_header(path: Path, rows: list[dict], body: str | None = None) -> None:
    if body is None:
        body = path.read_text(encoding="utf-8").split("\n-->\n", 1)[1]
    path.write_text("<!-- figures\n" + json.dumps(rows, indent=2) + "\n-->\n" + body, encoding="utf-8")


def record_of(benchmark: str) -> Path:
    """The record whose header holds the current row of `benchmark` in this repository."""
    standing = gen.resolve(gen.read_rows(REPO))
    return REPO / RESULTS / next(row.record for row in standing.current if row.benchmark == benchmark)


def test_benchmarks_md_and_the_readme_are_what_the_records_generate():
    result = run(REPO, "--check")
    assert result.returncode == 0, result.stderr


def test_one_current_row_per_benchmark_the_readme_from_the_newest_demo_record():
    rows = gen.read_rows(REPO)
    standing = gen.resolve(rows)
    ids = [row.benchmark for row in standing.current]
    assert len(ids) == len(set(ids)) and set(ids) == {row.benchmark for row in rows if row.superseded is None}
    demo = [row for row in rows if row.benchmark == gen.README_BENCHMARK]
    assert len(demo) >= 3
    current = next(row for row in standing.current if row.benchmark == gen.README_BENCHMARK)
    assert current.date == max(row.date for row in demo) and current.readme is not None
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"{RESULTS}/{current.record}" in readme
    assert all(" | ".join(line) in readme for line in current.readme.table[1:])
    benchmarks_md = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert sum(row.figure in benchmarks_md for row in demo) == len(demo)  # the current one and the superseded


@pytest.mark.parametrize("doc, part, old, new", [
    ("BENCHMARKS.md", "current-figures", "audit 0.426 s vs 5.786 s: **0.074x**", "audit 0.4 s vs 5.8 s: **0.07x**"),
    ("BENCHMARKS.md", "suite-figures", "930 passed, 26 skipped", "931 passed, 26 skipped"),
    ("BENCHMARKS.md", "superseded-figures", "**25 m 39 s**", "**21 m 39 s**"),
    ("README.md", "demo-figures", "| prompt lookup | 1.208 |", "| prompt lookup | 1.108 |"),
])
def test_a_hand_edit_of_a_generated_part_fails_naming_the_part_and_the_command(tmp_path, doc, part, old, new):
    root = copy_repo(tmp_path)
    text = (root / doc).read_text(encoding="utf-8")
    assert text.count(old) == 1
    (root / doc).write_text(text.replace(old, new), encoding="utf-8")
    result = run(root, "--check")
    assert result.returncode == 1
    assert result.stderr.strip() == f"{doc}: {part}: differs from the records; {REGENERATE}"
    regenerate = run(root)
    assert regenerate.returncode == 0 and regenerate.stdout == f"{doc}: regenerated\n"
    assert (root / doc).read_text(encoding="utf-8") == (REPO / doc).read_text(encoding="utf-8")
    assert run(root, "--check").returncode == 0


def test_a_new_record_takes_the_current_row_and_the_old_one_is_superseded(tmp_path):
    """What benchmarks/README.md tells a new record to do: a header with the benchmark's id, then the generator."""
    root = copy_repo(tmp_path)
    old = read_header(REPO / RESULTS / "merge-peak-memory_cpu-2core_2026-11-30.md")[0]
    name = "merge-peak-memory_cpu-2core_2026-12-09.md"
    new = dict(old, figure="2.24 GiB merged at 120 MiB peak RSS: data **19.1x** the peak", date="2026-12-09",
               records=[name])
    write_header(root / RESULTS / name, [new], body="# Merge peak memory again\n")
    assert run(root, "--check").stderr.splitlines() == [
        f"BENCHMARKS.md: {part}: differs from the records; {REGENERATE}" for part in ("current-figures",
                                                                                      "superseded-figures")]
    assert run(root).stdout == "BENCHMARKS.md: regenerated\n"
    text = (root / "BENCHMARKS.md").read_text(encoding="utf-8")
    current = text[text.index("<!-- generated: current-figures"):text.index("<!-- end generated: current-figures")]
    superseded = text[text.index("<!-- generated: superseded-figures"):]
    assert new["figure"] in current and old["figure"] not in current
    assert current.splitlines()[4].startswith("| merge peak memory |")  # newest first
    assert old["figure"] in superseded and f"[merge-peak-memory]({RESULTS}/{name}) (2026-12-09)" in superseded


@pytest.mark.parametrize("change, message", [
    (lambda row: row.update(date="2026-13-01"),
     'row 1 (merge-peak-memory): `date` is "2026-13-01"; valid: the day the figure was measured, YYYY-MM-DD'),
    (lambda row: row.pop("figure"),
     "row 1: `figure` is missing; valid: the figure as the record's body states it"),
    (lambda row: row.update(figures="x"),
     "row 1: unknown key `figures`; valid keys: benchmark, title"),
    (lambda row: row.update(benchmark="Merge Peak"),
     'row 1: `benchmark` is "Merge Peak"; valid: a stable id'),
    (lambda row: row.update(section="suite"),
     "row 1 (merge-peak-memory): `commit` is null; valid: the commit measured"),
    (lambda row: row.update(records=["audit-vs-collect-env_cpu-2core_2026-11-30.md"]),
     "row 1 (merge-peak-memory): `records` does not name merge-peak-memory_cpu-2core_2026-11-30.md itself"),
    (lambda row: row.update(records=["merge-peak-memory_cpu-2core_2026-11-30.md", "merge-peak-memory_h100_2026-12-01.md"]),
     'row 1 (merge-peak-memory): `records` names "merge-peak-memory_h100_2026-12-01.md", which is not a file in '
     "benchmarks/results/"),
    (lambda row: row.update(supersedes=["nowhere.md"]),
     'row 1 (merge-peak-memory): `supersedes` names "nowhere.md", which is not a file in benchmarks/results/'),
    (lambda row: row.update(figure="a --> b"),
     'row 1 (merge-peak-memory): `figure` is "a --> b"'),
], ids=["bad-date", "missing-field", "unknown-key", "bad-id", "suite-row-without-commit", "records-without-itself",
        "link-to-a-missing-file", "supersedes-a-missing-file", "text-closing-the-comment"])
def test_a_malformed_header_is_refused_naming_the_record_and_the_key(tmp_path, change, message):
    root = copy_repo(tmp_path)
    path = root / RESULTS / "merge-peak-memory_cpu-2core_2026-11-30.md"
    rows = read_header(path)
    change(rows[0])
    write_header(path, rows)
    for args in (("--check",), ()):
        result = run(root, *args)
        assert result.returncode == 2
        assert f"error: {RESULTS}/merge-peak-memory_cpu-2core_2026-11-30.md: figures header, {message}" in result.stderr
        assert "Traceback" not in result.stderr
    assert (root / "BENCHMARKS.md").read_text(encoding="utf-8") == (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")


def test_a_header_that_is_not_json_or_not_first_is_refused_naming_the_line(tmp_path):
    root = copy_repo(tmp_path)
    path = root / RESULTS / "merge-peak-memory_cpu-2core_2026-11-30.md"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"target": "data several', '"target" "data several'), encoding="utf-8")
    line = text.splitlines().index(next(line for line in text.splitlines() if '"target"' in line)) + 1
    result = run(root, "--check")
    assert result.returncode == 2
    assert f"error: {RESULTS}/merge-peak-memory_cpu-2core_2026-11-30.md, line {line}: the figures header is not JSON" \
           in result.stderr
    path.write_text("# Merge peak memory\n\n" + text, encoding="utf-8")
    result = run(root, "--check")
    assert result.returncode == 2 and "a figures header must open the file" in result.stderr


def test_two_records_claiming_one_current_row_on_the_same_date_are_ambiguous(tmp_path):
    """The two runs of the README's first command of 2026-12-07: the newer one names the older in `supersedes`;
    without it neither is the current row, and nothing is written."""
    root = copy_repo(tmp_path)
    newer = root / RESULTS / record_of(gen.README_BENCHMARK).name
    rows = read_header(newer)
    replaced = rows[0].pop("supersedes")
    assert replaced and all(read_header(root / RESULTS / name)[0]["date"] == rows[0]["date"] for name in replaced)
    claimants = sorted([newer.name, *replaced])      # no row names the winner now: every one of that date claims it
    write_header(newer, rows)
    before = (root / "BENCHMARKS.md").read_text(encoding="utf-8")
    pair = ", ".join(claimants)
    for args in (("--check",), ()):
        result = run(root, *args)
        assert result.returncode == 2
        assert result.stderr.strip() == (f"error: benchmark `{gen.README_BENCHMARK}`: {len(claimants)} rows claim its current row "
                                         f"with the same date {rows[0]['date']} ({pair}); name the replaced record "
                                         "in the newer row's `supersedes`")
    assert (root / "BENCHMARKS.md").read_text(encoding="utf-8") == before


def test_two_rows_of_one_benchmark_in_one_record_on_one_date_are_ambiguous(tmp_path):
    root = copy_repo(tmp_path)
    path = root / RESULTS / "merge-peak-memory_cpu-2core_2026-11-30.md"
    rows = read_header(path)
    write_header(path, rows + [dict(rows[0], figure="another figure")])
    result = run(root, "--check")
    assert result.returncode == 2
    name = "merge-peak-memory_cpu-2core_2026-11-30.md"
    assert f"benchmark `merge-peak-memory`: 2 rows claim its current row with the same date 2026-11-30 ({name}, {name})" \
           in result.stderr


def test_a_doc_without_its_markers_is_refused(tmp_path):
    root = copy_repo(tmp_path)
    text = (root / "README.md").read_text(encoding="utf-8")
    start, end = text.index("<!-- generated: demo-figures"), text.index("<!-- end generated: demo-figures -->")
    (root / "README.md").write_text(text[:start] + text[end + len("<!-- end generated: demo-figures -->"):],
                                    encoding="utf-8")
    assert run(root, "--check").stderr.strip() == f"README.md: demo-figures: differs from the records; {REGENERATE}"
    result = run(root)
    assert result.returncode == 2 and "README.md: no `<!-- generated: demo-figures -->`" in result.stderr
