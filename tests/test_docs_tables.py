"""The docs' tables of profile keys, cross-field rules, launch checks and exit codes are generated from
the code (scripts/gen_docs_tables.py): a doc that disagrees with the code fails here, naming the part and
the command that regenerates it; so does a hand-written table row that names a key the schema lacks."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_docs_tables.py"
DOCS = ("docs/profile-keys.md", "docs/profile-rules.md", "docs/exit-codes.md")


def import_script():
    spec = importlib.util.spec_from_file_location("gen_docs_tables", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_docs(root: Path) -> Path:
    for doc in DOCS:
        (root / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / doc, root / doc)
    return root


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--root", str(root)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_the_docs_tables_are_what_the_code_generates():
    result = check(REPO)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("doc, old, new, part", [
    ("docs/profile-keys.md", "| `lr` | number | 0.0006 | a finite number > 0 |", "| `lr` | number | 0.0006 | a finite number >= 0 |",
     "profile-keys"),
    ("docs/profile-rules.md", "| `ranks_fit_gpus` |", "| `ranks_fit_the_gpus` |", "cross-field-rules"),
    ("docs/profile-rules.md", "| `loss_decay` |", "| `decay` |", "launch-checks"),
    ("docs/exit-codes.md", "| 6 | `EXIT_PARITY` |", "| 7 | `EXIT_PARITY` |", "exit-codes"),
])
def test_a_doc_that_drifted_from_the_code_fails_naming_the_part_and_the_command(tmp_path, doc, old, new, part):
    root = copy_docs(tmp_path)
    text = (root / doc).read_text(encoding="utf-8")
    assert old in text
    (root / doc).write_text(text.replace(old, new), encoding="utf-8")
    result = check(root)
    assert result.returncode == 1
    assert result.stderr.strip() == f"{doc}: {part}: differs from the code; regenerate it with " \
                                    "`python scripts/gen_docs_tables.py`"
    regenerate = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True,
                                cwd=REPO, timeout=120)
    assert regenerate.returncode == 0 and regenerate.stdout == f"{doc}: regenerated\n"
    assert (root / doc).read_text(encoding="utf-8") == (REPO / doc).read_text(encoding="utf-8")
    assert check(root).returncode == 0


def test_a_change_in_the_code_makes_the_docs_stale(monkeypatch):
    """The other direction: the tables follow the declarations (a range, a rule, a check, an exit code)."""
    from dflash.train.supervisor import launch_checks
    from launcher_core import errors, schema

    script = import_script()
    assert script.stale_parts(REPO) == []
    monkeypatch.setitem(schema.RANGES, "train.lr", schema.Range(0))
    monkeypatch.setattr(schema, "CROSS_FIELD_RULES", schema.CROSS_FIELD_RULES[1:])
    monkeypatch.setattr(launch_checks, "LAUNCH_CHECKS", launch_checks.LAUNCH_CHECKS[:-1])
    monkeypatch.setitem(errors.EXIT_MEANINGS, errors.EXIT_DATA, "something else")
    assert script.stale_parts(REPO) == ["docs/profile-keys.md: profile-keys", "docs/profile-rules.md: cross-field-rules",
                                        "docs/profile-rules.md: launch-checks", "docs/exit-codes.md: exit-codes"]


def test_a_doc_without_its_markers_is_refused(tmp_path):
    root = copy_docs(tmp_path)
    (root / "docs/exit-codes.md").write_text("# Exit codes\n", encoding="utf-8")
    assert check(root).stderr.strip().startswith("docs/exit-codes.md: exit-codes: differs from the code")
    result = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 2 and "docs/exit-codes.md: no `<!-- generated: exit-codes -->`" in result.stderr


def test_every_exit_code_has_its_meaning():
    from launcher_core import errors

    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_") and isinstance(value, int)}
    assert len(codes) >= 10 and codes == set(errors.EXIT_MEANINGS)
    assert all(len(meaning) > 5 for meaning in errors.EXIT_MEANINGS.values())
    documented = re.findall(r"^\| (\d+) \| `EXIT_", (REPO / "docs/exit-codes.md").read_text(encoding="utf-8"), re.M)
    assert sorted(map(int, documented)) == sorted(codes)


def test_every_key_row_of_a_hand_written_table_names_a_real_key():
    """A table row of any doc that starts with a `section.key` (the cpu-demo's choices, ...) names a key the
    schema has (or one it removed and explains), so a renamed key cannot leave a stale row behind."""
    from launcher_core.schema import KEYS, REMOVED_KEYS, Profile

    sections = "|".join(f.name for f in dataclasses.fields(Profile) if f.name not in ("name", "description"))
    row = re.compile(rf"^\| `((?:{sections})\.[a-z_0-9]+)`", re.M)
    named = {(path.name, key) for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
             for key in row.findall(path.read_text(encoding="utf-8"))}
    assert len(named) > 10
    assert sorted((doc, key) for doc, key in named if key not in KEYS and key not in REMOVED_KEYS) == []
