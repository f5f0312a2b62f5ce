"""The training tests (FSDP2 steps, DCP checkpoints saved, resharded and resumed, the automatic micro-batch,
the memory trace, the flight recorder, the stuck-rank drills) under the torch each GPU requirement file pins: 2.9.1
in requirements-cu128.txt, 2.13.0 in requirements-cu130.txt. 2.13.0 is also the torch of this run
(requirements-cpu.txt), so the suite itself is its lane; a GPU file pinning another torch gets a scratch venv
(compat_venvs.torch_venv): that torch from the package index (on x86_64 the CUDA 12.8 build and its nvidia-*
wheels, which import and run on CPU) with the file's transformers, accelerate, datasets and pyarrow, as the nodes
train with them, and the tests' own packages at the CPU pins. The selected test files run in it, their torchrun
ranks started by the venv's python; tests/test_torch_private.py there checks NCCL's private entry points, which
only a CUDA wheel has.

When it runs. A cold venv downloads 4.3 GB (kept in uv's cache and the project cache, reused while the pins
stay) and the tests take 5-7.5 minutes on the 2-core machine (benchmarks/results/torch-2.9.1-lane_cpu-2core_2026-12-07.md).
The README's test command does not run it: `.ci/run` runs it after that command whenever something a training rank
runs changed (tests/compat/torch_lane.py: the triggers, read from the rank's import graph, and the decision, the
same on a shallow clone as on a full one), as `DFLASH_TORCH_COMPAT=1 pytest tests/compat/test_torch_compat.py`.
DFLASH_TORCH_COMPAT=1 runs it anywhere; without it the lane's test skips, saying so.

Marked `compat` and `slow`; `pytest -m compat tests` runs the transformers lane and these decision tests.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from compat_venvs import CPU_REQUIREMENTS, REPO_ROOT, ensure_venv, read_pin, run_in, torch_venv
from torch_lane import TESTS, import_graph, lane_decision, triggers

pytestmark = [pytest.mark.compat, pytest.mark.slow]

GPU_REQUIREMENTS = ("requirements-cu128.txt", "requirements-cu130.txt")
TORCH_PINS = {name: read_pin(REPO_ROOT / name, "torch") for name in GPU_REQUIREMENTS}
OTHER_TORCH = sorted(name for name, pin in TORCH_PINS.items() if pin != read_pin(CPU_REQUIREMENTS, "torch"))


def test_the_gpu_pins_name_the_versions_under_test():
    assert TORCH_PINS == {"requirements-cu128.txt": "2.9.1", "requirements-cu130.txt": "2.13.0"}, \
        "a GPU requirements file changed its torch: update this test's docstring and BENCHMARKS.md"
    assert read_pin(CPU_REQUIREMENTS, "torch") == "2.13.0", "the suite's own torch is the cu130 lane"
    assert OTHER_TORCH == ["requirements-cu128.txt"]
    assert read_pin(REPO_ROOT / "requirements-cu128.txt", "transformers") == "5.3.0"


def test_the_lane_guards_what_a_training_rank_imports():
    """The triggers are the rank's import graph (worker and supervisor), not a list: the modules every rank runs
    are in it, those no rank imports are not."""
    guarded = triggers()
    for path in ("dflash/target_model.py", "dflash/drafter/network.py", "dflash/drafter/checkpoint_files.py", "dflash/memory/reserve.py",
                 "dflash/memory/launch_plan.py", "envcheck/allocator.py", "launcher_core/profile.py",
                 "launcher_core/processes.py", "dflash/train/rank/worker.py", "dflash/train/supervisor/launch.py",
                 "dflash/torch_private.py", "dflash/measure/trace.py", "requirements-cu128.txt", *TESTS):
        assert path in guarded, path
    for path in ("README.md", "dflash/commands/train.py", "dflash/eval/evaluate.py", "launcher.py", "scripts/gpu_check.py"):
        assert path not in guarded, path


def test_type_checking_imports_are_not_followed(tmp_path):
    package = tmp_path / "dflash"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "typed.py").write_text("x = 1\n")
    (package / "lazy.py").write_text("y = 2\n")
    (package / "named.py").write_text("z = 3\n")
    (package / "root.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash import typed\n"
                                     "MODULES = ('dflash.named',)\ndef f():\n    from . import lazy\n")
    graph = {path.name for path in import_graph([package / "root.py"], tmp_path)}
    assert graph == {"root.py", "__init__.py", "lazy.py", "named.py"}


def commit_all(repo: Path, message: str) -> None:
    for argv in (["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message]):
        subprocess.run(["git", *argv], cwd=repo, check=True, capture_output=True)


@pytest.mark.parametrize("changed, runs", [("dflash/target_model.py", True), ("README.md", False)])
def test_a_shallow_clone_decides_the_lane_as_a_full_clone_does(tmp_path, changed, runs):
    """A change to dflash/target_model.py makes the lane run, one to README.md does not, on a full clone and on a
    shallow one (depth 1: HEAD's parent absent until the decision fetches it), with this repository's triggers."""
    origin = tmp_path / "origin"
    (origin / "dflash").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(origin)], check=True)
    for path in ("dflash/target_model.py", "README.md"):
        (origin / path).write_text("first\n")
    commit_all(origin, "first")
    (origin / changed).write_text("second\n")
    commit_all(origin, "second")
    full, shallow = tmp_path / "full", tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", str(origin), str(full)], check=True)
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{origin}", str(shallow)], check=True)
    assert subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=shallow, capture_output=True,
                          text=True).stdout.strip() == "true"
    guarded = triggers()
    decisions = [lane_decision(clone, env={}, guarded=guarded) for clone in (full, shallow)]
    assert decisions[0] == decisions[1] and decisions[0][0] is runs, decisions
    assert (changed in decisions[0][1]) is runs


def test_a_forced_setting_decides_the_lane(tmp_path):
    assert lane_decision(tmp_path, env={"DFLASH_TORCH_COMPAT": "0"}) == (False, "DFLASH_TORCH_COMPAT=0")
    assert lane_decision(tmp_path, env={"DFLASH_TORCH_COMPAT": "1"}) == (True, "DFLASH_TORCH_COMPAT=1")


def test_ci_runs_the_lane_after_the_readme_command_when_a_trigger_changed():
    """.ci/run asks torch_lane.py and runs the lane's test with DFLASH_TORCH_COMPAT=1 after the README's test
    command, whose text stays as the README has it."""
    ci = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme_command = "bash scripts/setup.sh && .venv/bin/python -m pytest -q tests"
    assert readme_command in (REPO_ROOT / "README.md").read_text(encoding="utf-8") and readme_command in ci
    script = ci.index("set -uo pipefail")                     # the commands, after the header's words
    lane = ci.index(".venv/bin/python tests/compat/torch_lane.py", ci.index(readme_command, script))
    assert "DFLASH_TORCH_COMPAT=1 .venv/bin/python -m pytest" in ci[lane:] and "test_torch_compat.py" in ci[lane:]
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "compat" / "torch_lane.py")], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "DFLASH_TORCH_COMPAT": "0"})
    assert done.returncode == 0 and done.stdout == "skip: DFLASH_TORCH_COMPAT=0\n", done.stdout + done.stderr


@pytest.mark.timeout(3600)            # the suite's 600 s is per test; this one runs nine modules' tests
@pytest.mark.parametrize("requirements", OTHER_TORCH)
def test_training_tests_pass_under_the_gpu_sets_torch(requirements):
    if os.environ.get("DFLASH_TORCH_COMPAT") != "1":
        pytest.skip("run by .ci/run after the README's test command when something a training rank runs changed "
                    "(tests/compat/torch_lane.py); DFLASH_TORCH_COMPAT=1 runs it here")
    from launcher_core.paths import cache_dir

    torch_pin = TORCH_PINS[requirements]
    transformers_pin = read_pin(REPO_ROOT / requirements, "transformers")
    venv = ensure_venv(torch_venv(REPO_ROOT / requirements), cache_dir() / "compat", timeout_s=3600)
    installed = run_in(venv, ["-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
                       300)
    versions = installed.stdout.split()
    assert installed.returncode == 0 and versions[0].startswith(torch_pin), installed.stdout + installed.stderr
    assert versions[1] == transformers_pin, installed.stdout
    done = run_in(venv, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra --timeout=600", *TESTS],
                  3600)                  # the scratch venv has no pytest-xdist: not the suite's -n
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"torch {versions[0]} ({requirements}): venv built in {venv.build_s} s "
          f"(0: reused); {summary}")
    assert done.returncode == 0, f"torch {versions[0]}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert re.search(r"\d+ passed", summary) and "failed" not in summary
