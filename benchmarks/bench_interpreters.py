#!/usr/bin/env python3
"""The same work under two builds of Python 3.11: what scripts/setup.sh's choice of interpreter is worth.

For each interpreter (the same minor version as the project's venv), a scratch venv without pip whose
site-packages point at the project venv's (a .pth file: the same wheels, the same bytecode), then, in a
fresh process each time, two workloads: what a training rank imports before its first step (torch,
torch.distributed's FSDP and checkpoint, transformers' model code, the trainer: dflash.train.supervisor.agent's
RANK_IMPORTS), and eager forward + backward steps of a tiny random Qwen3 (hidden 64, 2 layers, 16 tokens:
per-op Python and dispatch overhead, as most of the test suite's in-process work is). Prints each
interpreter's median CPU (user + sys of the child) per workload and its ratio to the first interpreter.

    .venv/bin/python benchmarks/bench_interpreters.py [--pythons A,B] [--repeat 5] [--steps 200]
    .venv/bin/python benchmarks/bench_interpreters.py --smoke    (this venv's interpreter, one run, 3 steps)

Without --pythons: this venv's base interpreter, then the distribution's /usr/bin/python3.11 and
python3.11 on PATH where they differ from it.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

IMPORTS = """
import importlib, sys
sys.path.insert(0, {repo!r})
from dflash.train.supervisor.agent import RANK_IMPORTS
for name in (*RANK_IMPORTS, "dflash.train.rank.worker", "transformers.models.qwen3.modeling_qwen3"):
    importlib.import_module(name)
"""
STEPS = """
import time
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
model = Qwen3ForCausalLM(config)
ids = torch.randint(0, 512, (1, 16))
model(input_ids=ids, labels=ids).loss.backward()
started = time.process_time()
for _ in range({steps}):
    model(input_ids=ids, labels=ids).loss.backward()
print(time.process_time() - started)
"""


@dataclass(frozen=True)
class Interpreter:
    """One Python build: its resolved executable and its version."""

    executable: str
    version: str


def describe(python: str) -> Interpreter | None:
    """The interpreter at `python`, None where it is missing or does not run."""
    found = shutil.which(python)
    if found is None:
        return None
    done = subprocess.run([found, "-c", "import sys; print(sys.version.split()[0]); print(sys.executable)"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None
    version, executable = done.stdout.split()
    return Interpreter(os.path.realpath(executable), version)


def default_pythons() -> list[str]:
    """This venv's base interpreter, then the distribution's and PATH's python3.11 where they differ."""
    base = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return [base, "/usr/bin/python3.11", "python3.11"]


def chosen(pythons: list[str]) -> list[Interpreter]:
    """The distinct interpreters among `pythons` with this venv's minor version (its wheels must fit)."""
    minor = f"{sys.version_info.major}.{sys.version_info.minor}."
    seen, result = set(), []
    for python in pythons:
        interpreter = describe(python)
        if interpreter is None or not interpreter.version.startswith(minor) or interpreter.executable in seen:
            continue
        seen.add(interpreter.executable)
        result.append(interpreter)
    return result


def scratch_venv(interpreter: Interpreter, folder: Path) -> Path:
    """A venv of `interpreter` without pip that sees the project venv's site-packages; its python."""
    subprocess.run([interpreter.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (folder / "lib" / minor / "site-packages" / "project.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return folder / "bin" / "python"


CHILD_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}      # one thread: the suite's setting


def child_cpu_s(python: Path, code: str) -> float:
    """CPU seconds (user + sys) of one fresh `python -c code`, start to exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([str(python), "-c", code], check=True, env={**os.environ, **CHILD_ENV})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def loop_cpu_s(python: Path, steps: int) -> float:
    """CPU seconds of `steps` eager steps, as the child measured them (after one warm-up step)."""
    done = subprocess.run([str(python), "-c", STEPS.format(steps=steps)], check=True, capture_output=True, text=True,
                          env={**os.environ, **CHILD_ENV})
    return float(done.stdout.split()[-1])


def measure(python: Path, repeat: int, steps: int) -> tuple[float, float]:
    """Median CPU of the rank's imports (a whole process) and of the eager steps (in the process)."""
    imports = [child_cpu_s(python, IMPORTS.format(repo=str(REPO))) for _ in range(repeat)]
    stepped = [loop_cpu_s(python, steps) for _ in range(repeat)]
    return statistics.median(imports), statistics.median(stepped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pythons", default="", help="comma-separated interpreters (default: see above)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        pythons, args.repeat, args.steps = [sys.executable], 1, 3
    else:
        pythons = [p for p in args.pythons.split(",") if p] or default_pythons()
    interpreters = chosen(pythons)
    if not interpreters:
        print(f"none of {pythons} is a Python {sys.version_info.major}.{sys.version_info.minor}", file=sys.stderr)
        return 1
    first: tuple[float, float] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-interpreters-") as scratch:
        for number, interpreter in enumerate(interpreters):
            python = scratch_venv(interpreter, Path(scratch) / f"venv-{number}")
            imports, steps = measure(python, args.repeat, args.steps)
            first = first or (imports, steps)
            print(f"{interpreter.executable} ({interpreter.version}): rank imports CPU {imports:.2f} s "
                  f"({imports / first[0]:.2f}x), {args.steps} eager steps CPU {steps:.2f} s "
                  f"({steps / first[1] if first[1] > 0 else float('nan'):.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
