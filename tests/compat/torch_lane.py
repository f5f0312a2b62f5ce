"""When the torch compat lane (tests/compat/test_torch_compat.py) runs: whenever something a training rank runs
changed, read from the code, not listed by hand.

What a rank runs is the import graph of the rank's entry point (dflash/train/rank/worker.py) and the supervisor
(dflash/train/supervisor/: the launcher's and the torchrun agent's side, which the rank imports its records
from), and what the lane's tests run of the project (dflash/measure/ for the memory trace): every project module reachable through `import` statements anywhere in a module (the project imports
torch and its own heavy modules inside functions), less those under `if TYPE_CHECKING:`, plus the modules named
by dotted strings (the agent's RANK_IMPORTS, dflash/data's lazy names) and the packages' `__init__.py` files.
The lane's TESTS and the conftest.py files above them, the GPU requirement files and the lane's own files are
triggers by name (the tests' helpers in tests/ are not followed).

The decision compares the working tree with the merge base with origin/main (or main) where HEAD is not on it,
else with HEAD's first parent (on a merge commit: everything it merged). A shallow clone lacks that commit:
it fetches the history it lacks first (`git fetch --unshallow`), then decides as a full clone does.
DFLASH_TORCH_COMPAT=1 runs the lane and DFLASH_TORCH_COMPAT=0 skips it, whatever changed.

`.ci/run` asks `python tests/compat/torch_lane.py`: it prints `run: WHY` or `skip: WHY` (exit 0 either way).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("dflash", "envcheck", "launcher_core")
RANK_ROOTS = ("dflash/train/rank/worker.py", "dflash/train/supervisor")
TESTS = ("tests/train/test_fsdp_step.py", "tests/train/test_meta_init.py", "tests/train/test_torchrun.py",
         "tests/train/test_retention.py", "tests/train/test_safety_checkpoint.py",
         "tests/safety/test_safety_async_save.py", "tests/safety/test_safety_checkpoints.py",
         "tests/memory/test_autobatch.py", "tests/measure/test_trace.py", "tests/test_torch_private.py",
         "tests/train/test_faults.py", "tests/train/test_plain_run.py", "tests/safety/test_safety_stuck.py",
         "tests/safety/test_safety_signals.py")
LANE_FILES = ("requirements-cu128.txt", "requirements-cu130.txt", "tests/compat/compat_venvs.py",
              "tests/compat/test_torch_compat.py", "tests/compat/torch_lane.py")
DOTTED_NAME = re.compile(r"^(%s)(\.[A-Za-z_]\w*)+$" % "|".join(PROJECT_PACKAGES))


# ---- the import graph ------------------------------------------------------------------------------

def module_file(name: str, root: Path) -> Optional[Path]:
    """The file of project module `name` (a.b.c -> a/b/c.py or a/b/c/__init__.py), None when there is none."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_time_nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks (their `else:` kept)."""
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        yield node
        if is_type_checking(node):
            pending.extend(node.orelse)          # type: ignore[attr-defined]
        else:
            pending.extend(ast.iter_child_nodes(node))


def imported_names(path: Path, root: Path) -> set[str]:
    """The module names a file imports at run time (absolute; relative imports resolved), with the names its
    `from X import Y` statements take from X (Y may be a module) and its dotted project strings."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module_name(path, root).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path, root)
    names: set[str] = set()
    for node in run_time_nodes(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED_NAME.match(node.value):
            names.add(node.value)
    return names


def resolve(name: str, root: Path) -> list[Path]:
    """The project files importing `name` runs: the module and its packages' __init__.py files (none for a
    name outside the project's packages, or a test helper: the lane's own tests are triggers by name)."""
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return []
    found = [module_file(".".join(parts[:i]), root) for i in range(1, len(parts) + 1)]
    return [path for path in found if path is not None]


def import_graph(roots: Iterable[Path], root: Path) -> set[Path]:
    """Every project file reachable from `roots` by run-time imports (the roots included, a test file too)."""
    seen: set[Path] = set()
    pending = [path.resolve() for path in roots]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_names(path, root):
            pending.extend(found.resolve() for found in resolve(name, root) if found.resolve() not in seen)
    return seen


def rank_files(root: Path) -> list[Path]:
    """The rank's entry point and every module of the supervisor."""
    files: list[Path] = []
    for entry in RANK_ROOTS:
        path = root / entry
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


def lane_test_files(root: Path) -> set[str]:
    """The lane's tests and the conftest.py files above them (the fixtures they run with)."""
    files = set(TESTS)
    for test in TESTS:
        files.update((folder / "conftest.py").relative_to(root).as_posix() for folder in (root / test).parents
                     if folder.is_relative_to(root) and (folder / "conftest.py").is_file())
    return files


def triggers(root: Path = REPO_ROOT) -> tuple[str, ...]:
    """The repository paths (relative, sorted) whose change makes the lane run: what a rank runs (the import
    graph), the lane's tests and their conftest.py files, the GPU requirement files and the lane's own files."""
    root = root.resolve()
    tested = [root / test for test in TESTS if (root / test).is_file()]
    graph = {path.relative_to(root).as_posix() for path in import_graph([*rank_files(root), *tested], root)}
    return tuple(sorted(graph | lane_test_files(root) | set(LANE_FILES)))


# ---- what changed ----------------------------------------------------------------------------------

def git(root: Path, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=timeout_s)


def compared_commit(root: Path) -> Optional[str]:
    """The merge base with origin/main (or main) where HEAD is not on it, else HEAD's first parent; a shallow
    clone fetches its history first. None where there is no such commit (not a git checkout, a first commit,
    a shallow clone whose history cannot be fetched)."""
    if git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        git(root, "fetch", "--quiet", "--unshallow", timeout_s=600)
    head = git(root, "rev-parse", "HEAD").stdout.strip()
    for branch in ("origin/main", "main"):
        base = git(root, "merge-base", "HEAD", branch)
        if base.returncode == 0 and head and base.stdout.strip() != head:
            return base.stdout.strip()
    parent = git(root, "rev-parse", "--verify", "--quiet", "HEAD~1")
    return parent.stdout.strip() if parent.returncode == 0 else None


def lane_decision(root: Path = REPO_ROOT, env: Mapping[str, str] = os.environ,
                  guarded: Optional[tuple[str, ...]] = None) -> tuple[bool, str]:
    """Whether the lane runs now, and why (or why not). `guarded`: the trigger paths (default: `triggers(root)`)."""
    asked = env.get("DFLASH_TORCH_COMPAT", "")
    if asked in ("0", "1"):
        return asked == "1", f"DFLASH_TORCH_COMPAT={asked}"
    try:
        commit = compared_commit(root)
        if commit is None:
            return True, "no commit to compare HEAD with (not a git checkout, a first commit, or a shallow clone " \
                         "whose history could not be fetched)"
        changed = git(root, "diff", "--name-only", commit)            # commit -> the working tree
    except (OSError, subprocess.SubprocessError) as error:
        return True, f"git could not say what changed ({error})"
    if changed.returncode != 0:
        return True, f"git could not say what changed: {changed.stderr.strip()}"
    guarded = triggers(root) if guarded is None else guarded
    touched = [path for path in changed.stdout.split() if path in guarded]
    if touched:
        return True, f"changed since {commit[:12]}: {', '.join(touched[:5])}" + (" ..." if len(touched) > 5 else "")
    return False, (f"nothing a training rank runs changed since {commit[:12]} ({len(guarded)} paths: "
                   f"tests/compat/torch_lane.py); DFLASH_TORCH_COMPAT=1 runs it")


def main(argv: Optional[list[str]] = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments == ["--triggers"]:
        print("\n".join(triggers()))
        return 0
    run, reason = lane_decision()
    print(f"{'run' if run else 'skip'}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
