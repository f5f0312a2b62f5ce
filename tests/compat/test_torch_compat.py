"""The training tests (FSDP2 steps, DCP checkpoints saved, resharded and resumed, the automatic micro-batch,
the memory trace) under the torch each GPU requirement file pins: 2.9.1 in requirements-cu128.txt, 2.13.0 in
requirements-cu130.txt. 2.13.0 is also the torch of this run (requirements-cpu.txt), so the suite itself is its
lane; a GPU file pinning another torch gets a scratch venv (compat_venvs.torch_venv): that torch from the package
index (on x86_64 the CUDA 12.8 build and its nvidia-* wheels, which import and run on CPU) with the file's
transformers, accelerate, datasets and pyarrow, as the nodes train with them, and the tests' own packages at the
CPU pins. The selected test files run in it, their torchrun ranks started by the venv's python.

When it runs. A cold venv downloads 4.3 GB (kept in uv's cache and the project cache, reused while the pins
stay) and the tests take 5-6.5 minutes on the 2-core machine (benchmarks/results/torch-2.9.1-lane_cpu-2core_2026-12-07.md), so the
lane runs only when something it guards changed, else it is skipped, saying why:
* DFLASH_TORCH_COMPAT=1 runs it, DFLASH_TORCH_COMPAT=0 skips it;
* otherwise it runs when a path in TRIGGERS (the GPU requirement files, dflash/train/, dflash/measure/, the checkpoint
  modules, this lane and the tests it runs) differs between the working tree and the commit it is compared
  with: the merge base with origin/main (or main) where HEAD is not on it, else HEAD's first parent (on a merge
  commit: everything it merged);
* where that cannot be told (no git, a shallow clone without the parent), it runs.

Marked `compat` and `slow`; `pytest -m compat tests` runs both compatibility lanes.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from compat_venvs import CPU_REQUIREMENTS, REPO_ROOT, ensure_venv, read_pin, run_in, torch_venv

pytestmark = [pytest.mark.compat, pytest.mark.slow]

GPU_REQUIREMENTS = ("requirements-cu128.txt", "requirements-cu130.txt")
TORCH_PINS = {name: read_pin(REPO_ROOT / name, "torch") for name in GPU_REQUIREMENTS}
OTHER_TORCH = sorted(name for name, pin in TORCH_PINS.items() if pin != read_pin(CPU_REQUIREMENTS, "torch"))
TESTS = ["tests/train/test_fsdp_step.py", "tests/train/test_meta_init.py", "tests/train/test_torchrun.py",
         "tests/train/test_retention.py", "tests/train/test_safety_checkpoint.py",
         "tests/safety/test_safety_async_save.py", "tests/safety/test_safety_checkpoints.py",
         "tests/memory/test_autobatch.py", "tests/measure/test_trace.py", "tests/test_torch_private.py",
         "tests/train/test_faults.py", "tests/train/test_plain_run.py", "tests/safety/test_safety_stuck.py",
         "tests/safety/test_safety_signals.py"]
TRIGGERS = ("requirements-cu", "dflash/train/", "dflash/measure/", "dflash/drafter/checkpoint.py",
            "dflash/torch_private.py",
            "tests/compat/compat_venvs.py", "tests/compat/test_torch_compat.py", *TESTS)


def git(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def compared_commit() -> str | None:
    """The merge base with origin/main (or main) where HEAD is not on it, else HEAD's first parent; None if
    there is none (not a git checkout, a shallow clone)."""
    head = git("rev-parse", "HEAD").stdout.strip()
    for branch in ("origin/main", "main"):
        base = git("merge-base", "HEAD", branch)
        if base.returncode == 0 and head and base.stdout.strip() != head:
            return base.stdout.strip()
    parent = git("rev-parse", "--verify", "--quiet", "HEAD~1")
    return parent.stdout.strip() if parent.returncode == 0 else None


def lane_decision() -> tuple[bool, str]:
    """Whether the lane runs now, and why (or why not)."""
    asked = os.environ.get("DFLASH_TORCH_COMPAT", "")
    if asked in ("0", "1"):
        return asked == "1", f"DFLASH_TORCH_COMPAT={asked}"
    try:
        commit = compared_commit()
        if commit is None:
            return True, "no commit to compare HEAD with (not a git checkout, or a shallow clone)"
        changed = git("diff", "--name-only", commit)            # commit -> the working tree
    except (OSError, subprocess.SubprocessError) as error:
        return True, f"git could not say what changed ({error})"
    if changed.returncode != 0:
        return True, f"git could not say what changed: {changed.stderr.strip()}"
    touched = [path for path in changed.stdout.split() if path.startswith(TRIGGERS)]
    if touched:
        return True, f"changed since {commit[:12]}: {', '.join(touched[:5])}"
    return False, (f"nothing the lane guards (the GPU requirement files, dflash/train/, ...: TRIGGERS) changed since "
                   f"{commit[:12]}; DFLASH_TORCH_COMPAT=1 runs it")


def test_the_gpu_pins_name_the_versions_under_test():
    assert TORCH_PINS == {"requirements-cu128.txt": "2.9.1", "requirements-cu130.txt": "2.13.0"}, \
        "a GPU requirements file changed its torch: update this test's docstring and BENCHMARKS.md"
    assert read_pin(CPU_REQUIREMENTS, "torch") == "2.13.0", "the suite's own torch is the cu130 lane"
    assert OTHER_TORCH == ["requirements-cu128.txt"]
    assert read_pin(REPO_ROOT / "requirements-cu128.txt", "transformers") == "5.3.0"


def test_a_shallow_clone_or_a_forced_setting_decides_the_lane(monkeypatch):
    monkeypatch.setenv("DFLASH_TORCH_COMPAT", "0")
    assert lane_decision() == (False, "DFLASH_TORCH_COMPAT=0")
    monkeypatch.setenv("DFLASH_TORCH_COMPAT", "1")
    assert lane_decision() == (True, "DFLASH_TORCH_COMPAT=1")
    monkeypatch.delenv("DFLASH_TORCH_COMPAT")
    monkeypatch.setattr(sys.modules[__name__], "compared_commit", lambda: None)
    assert lane_decision()[0]


@pytest.mark.parametrize("changed, runs", [("README.md\ndocs/train.md\n", False), ("docs/x.md\ndflash/train/rank/step.py\n", True),
                                            ("requirements-cu128.txt\n", True), ("", False)])
def test_the_lane_runs_when_a_path_it_guards_changed(monkeypatch, changed, runs):
    monkeypatch.delenv("DFLASH_TORCH_COMPAT", raising=False)
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "compared_commit", lambda: "0123456789abcdef")
    monkeypatch.setattr(module, "git", lambda *argv: subprocess.CompletedProcess(argv, 0, changed, ""))
    assert lane_decision()[0] is runs


@pytest.mark.timeout(3600)            # the suite's 600 s is per test; this one runs nine modules' tests
@pytest.mark.parametrize("requirements", OTHER_TORCH)
def test_training_tests_pass_under_the_gpu_sets_torch(requirements):
    run, reason = lane_decision()
    if not run:
        pytest.skip(reason)
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
    print(f"torch {versions[0]} ({requirements}; run because {reason}): venv built in {venv.build_s} s "
          f"(0: reused); {summary}")
    assert done.returncode == 0, f"torch {versions[0]}:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert re.search(r"\d+ passed", summary) and "failed" not in summary
