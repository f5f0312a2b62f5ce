"""Generation backends on CPU: `transformers serve` (continuous batching) against vLLM's CPU build.

For each backend, one real `generate` run of the cpu-demo profile (its prompts, sampling,
concurrency and max_tokens; only `generate.backend` differs) into a scratch run dir. Prints per
backend: setup (server start until /health answers), generation wall time, requests/s, completion
tokens/s (both over the generation time), the end-to-end time (setup + generation) and the peak
RSS of the server's process tree (sampled every 0.5 s), the CPU seconds (user + sys) of the server's
tree and of this process (the client), and the load average before and after (the machine may be
shared: CPU seconds are the steadier figure). vLLM runs from the venv of `launcher.py engine setup
vllm` (built first if needed; its build time is printed apart). With both backends' completions
(this run's, or with `--keep DIR` one backend run now and the other kept there from before) it
compares them prompt by prompt: how many are the same text, and where the others part.

    .venv/bin/python benchmarks/bench_gen_backends.py [--prompts 64] [--backends transformers,vllm] [--max-tokens N]
                                                      [--keep DIR]   (keep each backend's run dir under DIR)
    .venv/bin/python benchmarks/bench_gen_backends.py --smoke [--backends vllm]   (1 prompt x 8 tokens; transformers
                                                                                  unless --backends says otherwise)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from launcher_core.processes import free_port  # noqa: E402


@dataclasses.dataclass
class BackendFigures:
    backend: str
    prompts: int
    setup_s: float
    generate_s: float
    completion_tokens: int
    peak_rss_mib: float
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)     # 1-minute load average before, after

    def line(self) -> str:
        return (f"{self.backend:<13} {self.prompts} prompts: setup {self.setup_s:6.1f} s, generation "
                f"{self.generate_s:6.1f} s, {self.prompts / self.generate_s:5.2f} requests/s, "
                f"{self.completion_tokens / self.generate_s:6.1f} tokens/s, end to end {self.setup_s + self.generate_s:6.1f} s, "
                f"peak RSS {self.peak_rss_mib:,.0f} MiB, CPU server {self.server_cpu_s:,.0f} s client "
                f"{self.client_cpu_s:,.0f} s, load {self.load[0]:.1f} -> {self.load[1]:.1f}")


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class TreeRssSampler:
    """Peak RSS of every process whose command line names the port (the server and its workers),
    and their CPU seconds (user + sys, the last sample of each process: up to 0.5 s short each)."""

    def __init__(self, port: int) -> None:
        self.port, self.peak_bytes, self._stop = str(port), 0, threading.Event()
        self.cpu_s: dict[int, float] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "TreeRssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            servers = [p for p in psutil.process_iter(["cmdline"]) if self.port in (p.info["cmdline"] or [])]
            total = 0
            for process in servers:
                for member in [process, *process.children(recursive=True)]:
                    try:
                        total += member.memory_info().rss
                        times = member.cpu_times()
                        self.cpu_s[member.pid] = times.user + times.system
                    except psutil.Error:
                        pass
            self.peak_bytes = max(self.peak_bytes, total)


def run_backend(backend: str, prompts: int, max_tokens: int, workdir: Path) -> BackendFigures:
    from dflash.generate.generation_run import generate_from_profile
    from launcher_core.profile import load_profile

    base = load_profile("cpu-demo")
    port = free_port()
    profile = dataclasses.replace(base, generate=dataclasses.replace(base.generate, backend=backend, port=port,
                                                                     max_prompts=prompts,
                                                                     max_tokens=max_tokens or base.generate.max_tokens))
    run_dir = workdir / backend
    load_before = os.getloadavg()[0]
    own = _cpu_seconds(resource.RUSAGE_SELF)
    with TreeRssSampler(port) as sampler:
        started = time.monotonic()
        summary = generate_from_profile(profile, run_dir=run_dir, progress=False)
        total_s = time.monotonic() - started
    return BackendFigures(backend, summary.selected, total_s - summary.wall_s, summary.wall_s, summary.output_tokens,
                          sampler.peak_bytes / 2**20, sum(sampler.cpu_s.values()),
                          _cpu_seconds(resource.RUSAGE_SELF) - own, (load_before, os.getloadavg()[0]))


def read_answers(run_dir: Path) -> dict[str, str]:
    """prompt id -> the assistant's text (content, reasoning and tool calls) of a generate run."""
    answers = {}
    for line in (run_dir / "completions.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            message = record["messages"][-1]
            answers[record["id"]] = json.dumps([message.get("reasoning_content"), message.get("content"),
                                                message.get("tool_calls")], ensure_ascii=False)
    return answers


def compare_answers(first: dict[str, str], second: dict[str, str]) -> list[str]:
    """How many prompts got the same text from both backends; where the others part (characters in)."""
    common = sorted(set(first) & set(second))
    differing = [(pid, _common_prefix(first[pid], second[pid]), len(first[pid])) for pid in common if first[pid] != second[pid]]
    lines = [f"same text: {len(common) - len(differing)} of {len(common)} prompts"]
    if differing:
        shares = sorted(prefix / max(1, length) for _, prefix, length in differing)
        lines.append(f"differing: {len(differing)}; they agree on the first {shares[len(shares) // 2]:.0%} of the text "
                     f"(median; min {shares[0]:.0%})")
        lines += [f"  {pid}: same for {prefix} of {length} characters" for pid, prefix, length in differing[:8]]
    return lines


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=526, help="the first N of the demo's 526 training prompts")
    parser.add_argument("--backends", default=None, help="comma-separated (default: transformers,vllm; --smoke: transformers)")
    parser.add_argument("--max-tokens", type=int, default=0, help="completion tokens per prompt (0: generate.max_tokens)")
    parser.add_argument("--keep", type=Path, default=None, help="keep each backend's run dir (its completions) under "
                        "this directory (default: a scratch directory, removed)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 1 prompt x 8 tokens, transformers "
                        "serve unless --backends is given")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.max_tokens = 1, 8
    args.backends = args.backends or ("transformers" if args.smoke else "transformers,vllm")
    backends = args.backends.split(",")
    if "vllm" in backends:
        from dflash.generate.engine_env import setup_engine_env

        env = setup_engine_env("vllm", echo=lambda line: print(line, file=sys.stderr))
        print(f"engine setup vllm: {'built in %.0f s' % env.build_s if env.built else 'already built (0 s)'}")
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as scratch:
        workdir = args.keep or Path(scratch)
        for backend in backends:
            print(run_backend(backend, args.prompts, args.max_tokens, workdir).line(), flush=True)
        present = [b for b in ("transformers", "vllm") if (workdir / b / "completions.jsonl").exists()]
        if len(present) == 2:      # this run's two backends, or with --keep one run now and one kept from before
            print(f"{present[0]} vs {present[1]}, prompts both answered:")
            print("\n".join(compare_answers(*(read_answers(workdir / backend) for backend in present))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
