"""Served decoding on CPU: the methods of `eval --engine vllm` served by vLLM's CPU build as the served
eval serves them (the launcher's command and environment, the cpu-demo target, its eval prompts as
token ids, one request in flight, a fresh engine per method).

Prints per method and setting: the decoding's wall time (requests only), completion tokens/s, the
engine's tau, and the CPU seconds (user + sys) of the server's processes, its start included (what
this process reaped from it). `--env NAME=VALUE` (repeatable) changes the launcher's environment,
e.g. NUMBA_NUM_THREADS=2 (numba's own default on 2 cores, before vllm_server.CPU_NUMBA_THREADS);
`--hogs N` runs N busy-loop processes beside the engine (a machine doing other work, as the test
suite's other workers do); `--repeat N` runs each setting N times, alternating.

    .venv/bin/python benchmarks/bench_served_cpu.py [--methods prompt_lookup,target] [--drafter CHECKPOINT]
        [--prompts 6] [--max-new-tokens 32] [--env NAME=VALUE ...] [--hogs 0] [--repeat 1]
    .venv/bin/python benchmarks/bench_served_cpu.py --smoke      (prompt lookup, 1 prompt x 4 tokens)
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from launcher_core.processes import free_port  # noqa: E402

HOG = "while True: pass"


@dataclasses.dataclass(frozen=True)
class ServedFigures:
    method: str
    setting: str
    wall_s: float
    tokens: int
    tau: Optional[float]
    server_cpu_s: float

    def line(self) -> str:
        tau = f"{self.tau:.3f}" if self.tau is not None else "-"
        return (f"{self.method:<14} {self.setting:<28} decode {self.wall_s:6.1f} s, {self.tokens} tokens, "
                f"{self.tokens / self.wall_s:6.1f} tokens/s, tau {tau}, server CPU {self.server_cpu_s:6.1f} s")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def prompt_token_ids(profile, count: int) -> list[list[int]]:
    """The first `count` eval prompts of the profile, rendered with the target's chat template."""
    from transformers import AutoTokenizer

    from dflash.eval.evaluate import encode_prompts
    from dflash.eval.options import eval_prompts_path
    from dflash.target_model import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(profile.model.target), local_files_only=True)
    return [p.token_ids for p in encode_prompts(tokenizer, eval_prompts_path(profile, None), count, False)]


def serve_once(profile, method: str, drafter: Path, block_size: int, prompts: list[list[int]], max_new_tokens: int,
               overrides: dict[str, str], hogs: int, log_dir: Path) -> ServedFigures:
    """One fresh engine for `method` (drafts of a block of `block_size`, as the served eval's) with the
    launcher's environment changed by `overrides`, `hogs` busy loops beside it."""
    from dflash.eval.engines import engine_command, serve_method
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.served import engine_settings
    from dflash.target_model import resolve_model_path

    settings = dataclasses.replace(engine_settings(profile, EvalOptions()), max_new_tokens=max_new_tokens,
                                   block_size=block_size)
    command = engine_command("vllm", profile, resolve_model_path(profile.model.target), method, drafter, block_size,
                             free_port())
    command = dataclasses.replace(command, env={**command.env, **overrides})
    busy = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        before = children_cpu_s()
        run = serve_method("vllm", command, prompts, settings, log_dir / f"{method}.log",
                           profile.generate.server_startup_timeout_s)
        server_cpu_s = children_cpu_s() - before
    finally:
        for process in busy:
            process.kill()
            process.wait()
    setting = ",".join(f"{k}={v}" for k, v in overrides.items()) or "the launcher's env"
    return ServedFigures(method, setting + (f", {hogs} hogs" if hogs else ""), run.wall_s, run.completion_tokens,
                         run.engine_tau, server_cpu_s)


def parse_env(pairs: list[str]) -> list[dict[str, str]]:
    """Each --env NAME=VALUE is one setting beside the launcher's own (an empty change)."""
    settings: list[dict[str, str]] = [{}]
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env {pair!r}: expected NAME=VALUE")
        settings.append({name: value})
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="prompt_lookup,target", help="comma-separated: target, prompt_lookup, dflash")
    parser.add_argument("--drafter", type=Path, default=None, help="a checkpoint (dflash: exported for vLLM first)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE: a setting beside the launcher's env")
    parser.add_argument("--hogs", type=int, default=0, help="busy-loop processes beside the engine")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="prompt lookup, 1 prompt x 4 tokens, once")
    args = parser.parse_args()
    if args.smoke:
        args.methods, args.prompts, args.max_new_tokens, args.repeat = "prompt_lookup", 1, 4, 1
    methods = args.methods.split(",")
    if "dflash" in methods and args.drafter is None:
        raise SystemExit("--methods dflash needs --drafter CHECKPOINT")

    from dflash.generate.engine_env import setup_engine_env
    from launcher_core.profile import load_profile

    setup_engine_env("vllm", echo=lambda line: print(line, file=sys.stderr))
    base = load_profile("cpu-demo")
    profile = dataclasses.replace(base, generate=dataclasses.replace(base.generate, vllm_enforce_eager=True))
    prompts = prompt_token_ids(profile, args.prompts)
    print(f"vLLM on CPU, {profile.model.target}, {len(prompts)} prompts x {args.max_new_tokens} tokens, one in flight, "
          f"--enforce-eager, eval.cpu_threads {profile.eval.cpu_threads}")
    with tempfile.TemporaryDirectory(prefix="bench-served-") as scratch:
        drafter, block_size = Path(scratch), profile.drafter.block_size      # the served eval's block: the drafter's
        if args.drafter is not None:
            from dflash.drafter.checkpoint_files import read_drafter_config
            from dflash.eval.served import export_for_engine
            from dflash.target_model import resolve_model_path

            drafter = export_for_engine("vllm", args.drafter, resolve_model_path(profile.model.target), Path(scratch), None)
            block_size = int(read_drafter_config(args.drafter).block_size)
        for _ in range(args.repeat):
            for overrides in parse_env(args.env):
                for method in methods:
                    figures = serve_once(profile, method, drafter, block_size, prompts, args.max_new_tokens, overrides,
                                         args.hogs, Path(scratch))
                    print(figures.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
