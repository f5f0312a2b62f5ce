"""`eval --engine sglang|vllm`: the drafter served by the engine that will serve it in production.

For each method (target alone, the DFlash drafter, prompt lookup) a fresh engine starts on
127.0.0.1 with the target (`engine_command`), the eval prompts go through its OpenAI API one at a
time, and the acceptance the ENGINE reports is read back:

* SGLang: `--speculative-algorithm DFLASH --speculative-draft-model-path CKPT
  --speculative-num-draft-tokens B` (prompt lookup: `NGRAM`), `--decode-log-interval 1` so the
  scheduler folds every step into `avg_spec_accept_length` of `GET /server_info` (accepted drafts
  + 1 per verify step: tau). Hybrid targets (linear-attention layers) add
  `--mamba-scheduler-strategy extra_buffer`. DFLASH exists from SGLang 0.5.11.
* vLLM: `--speculative-config {"method": "dflash", "model": CKPT, "num_speculative_tokens": B-1}`
  (prompt lookup: method `ngram`); tau = 1 + accepted / drafts from the Prometheus counters of
  `GET /metrics`, read before and after.

Tokens/s = completion tokens over the wall time of the requests (one in flight, as the in-process
eval); speedup over the same engine's target-only run.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from dflash.compat import version_tuple
from dflash.generate.servers import ServerCommand, ServerSupervisor, client_host, is_hybrid_target, sglang_attention_backend
from launcher_core.errors import ConfigError
from launcher_core.schema import Profile

ENGINES = ("sglang", "vllm")
METHODS = ("target", "dflash", "prompt_lookup")
MIN_VERSIONS = {"sglang": (0, 5, 11), "vllm": (0, 0, 0)}
LAUNCH_MODULES = {"sglang": ["-m", "sglang.launch_server"], "vllm": ["-m", "vllm.entrypoints.openai.api_server"]}


@dataclass(frozen=True)
class EngineRun:
    """One method served by the engine: what it produced and the acceptance it reported."""

    method: str
    texts: list[str]
    completion_tokens: int
    wall_s: float
    engine_tau: Optional[float]
    argv: list[str] = field(default_factory=list)


def engine_command(engine: str, profile: Profile, target: Path, method: str, checkpoint: Path, block_size: int,
                   port: int, launch: Optional[Sequence[str]] = None) -> ServerCommand:
    """The server for one method; `launch` replaces `python -m <engine module>` (tests: a stand-in)."""
    prefix = list(launch) if launch else [engine_python(profile), *LAUNCH_MODULES[engine]]
    builder = _sglang_args if engine == "sglang" else _vllm_args
    argv = prefix + builder(profile, target, method, checkpoint, block_size, port)
    return ServerCommand(argv, {}, f"http://{client_host('127.0.0.1')}:{port}", engine)


def engine_python(profile: Profile) -> str:
    return profile.eval.engine_python or sys.executable


def _sglang_args(profile: Profile, target: Path, method: str, checkpoint: Path, block: int, port: int) -> list[str]:
    args = ["--model-path", str(target), "--host", "127.0.0.1", "--port", str(port),
            "--tp-size", str(profile.generate.tp_size), "--dtype", profile.model.dtype,
            "--mem-fraction-static", str(profile.generate.mem_fraction_static),
            "--attention-backend", sglang_attention_backend(profile.audit.attention_backend),
            "--decode-log-interval", "1"]
    if profile.generate.context_length > 0:
        args += ["--context-length", str(profile.generate.context_length)]
    if is_hybrid_target(target):
        args += ["--mamba-scheduler-strategy", "extra_buffer"]
    if method == "dflash":
        args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(checkpoint),
                 "--speculative-num-draft-tokens", str(block)]
    elif method == "prompt_lookup":
        args += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(block)]
    return args


def _vllm_args(profile: Profile, target: Path, method: str, checkpoint: Path, block: int, port: int) -> list[str]:
    args = ["--model", str(target), "--host", "127.0.0.1", "--port", str(port), "--dtype", profile.model.dtype,
            "--tensor-parallel-size", str(profile.generate.tp_size),
            "--gpu-memory-utilization", str(profile.generate.mem_fraction_static)]
    if profile.generate.context_length > 0:
        args += ["--max-model-len", str(profile.generate.context_length)]
    speculative = {"dflash": {"method": "dflash", "model": str(checkpoint), "num_speculative_tokens": block - 1},
                   "prompt_lookup": {"method": "ngram", "num_speculative_tokens": block - 1,
                                     "prompt_lookup_max": profile.eval.prompt_lookup_max_ngram,
                                     "prompt_lookup_min": 1}}.get(method)
    if speculative:
        args += ["--speculative-config", json.dumps(speculative)]
    return args


def check_engine_installed(engine: str, profile: Profile) -> str:
    """The engine's version in eval.engine_python's environment; ConfigError if absent or too old."""
    python = engine_python(profile)
    probe = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({engine!r}))"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise ConfigError(f"--engine {engine}: {engine} is not installed for {python} (eval.engine_python); "
                          f"install it there or point eval.engine_python at an environment that has it")
    version = probe.stdout.strip()
    if version_tuple(version) < MIN_VERSIONS[engine]:
        wanted = ".".join(map(str, MIN_VERSIONS[engine]))
        raise ConfigError(f"--engine {engine}: {engine} {version} at {python} has no DFLASH speculative algorithm "
                          f"(needs {wanted} or later, as requirements-cu130.txt pins); set eval.engine_python")
    return version


def chat(base_url: str, messages: Sequence[dict], max_tokens: int, temperature: float, seed: int,
         thinking: bool, timeout_s: float) -> tuple[str, int]:
    """One OpenAI chat completion -> (text, completion tokens)."""
    body = {"model": "default", "messages": list(messages), "max_tokens": max_tokens, "temperature": temperature,
            "seed": seed, "chat_template_kwargs": {"enable_thinking": thinking}}
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (loopback URL we built)
        answer = json.loads(response.read())
    return answer["choices"][0]["message"].get("content") or "", int(answer["usage"]["completion_tokens"])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 (loopback URL we built)
        return response.read()


def sglang_tau(base_url: str) -> Optional[float]:
    """avg_spec_accept_length of the server's lifetime (None: no speculative steps)."""
    info = json.loads(_get(f"{base_url}/server_info"))
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length")
    return float(value) if value is not None else None


def vllm_counters(base_url: str) -> dict[str, float]:
    """vllm:spec_decode_num_drafts / _num_accepted_tokens (Prometheus counters, summed over labels)."""
    totals = {"drafts": 0.0, "accepted": 0.0}
    for line in _get(f"{base_url}/metrics").decode().splitlines():
        for key, name in (("drafts", "vllm:spec_decode_num_drafts"), ("accepted", "vllm:spec_decode_num_accepted_tokens")):
            if line.startswith(name + "_total") or line.startswith(name + "{") or line.startswith(name + " "):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def serve_method(engine: str, command: ServerCommand, prompts: Sequence[Any], settings: "EngineSettings",
                 log_path: Path, startup_timeout_s: float) -> EngineRun:
    """Start the engine, send every prompt, read its acceptance, stop it."""
    supervisor = ServerSupervisor(command, log_path, startup_timeout_s=startup_timeout_s, max_restarts=0)
    supervisor.start()
    try:
        before = vllm_counters(command.base_url) if engine == "vllm" else None
        texts, tokens, started = [], 0, time.perf_counter()
        for prompt in prompts:
            text, count = chat(command.base_url, prompt.messages, settings.max_new_tokens, settings.temperature,
                               settings.seed, settings.thinking, settings.request_timeout_s)
            texts.append(text)
            tokens += count
        wall_s = time.perf_counter() - started
        tau = sglang_tau(command.base_url) if engine == "sglang" else _vllm_tau(before, vllm_counters(command.base_url))
    finally:
        supervisor.stop()
    return EngineRun(command.name, texts, tokens, wall_s, tau, list(command.argv))


def _vllm_tau(before: dict[str, float], after: dict[str, float]) -> Optional[float]:
    drafts = after["drafts"] - before["drafts"]
    return 1.0 + (after["accepted"] - before["accepted"]) / drafts if drafts > 0 else None


@dataclass(frozen=True)
class EngineSettings:
    max_new_tokens: int
    temperature: float
    seed: int
    thinking: bool
    request_timeout_s: float


def run_engines(engine: str, profile: Profile, target: Path, checkpoint: Path, block_size: int,
                prompts: Sequence[Any], settings: EngineSettings, log_dir: Path,
                launch: Optional[Sequence[str]] = None) -> dict[str, EngineRun]:
    """Every method in turn, each on a fresh engine (its lifetime figures are that run's)."""
    runs = {}
    for method in METHODS:
        command = engine_command(engine, profile, target, method, checkpoint, block_size, profile.eval.engine_port, launch)
        command = ServerCommand(command.argv, command.env, command.base_url, method)
        runs[method] = serve_method(engine, command, prompts, settings, log_dir / f"{engine}-{method}.log",
                                    profile.generate.server_startup_timeout_s)
    return runs


def engine_report(engine: str, runs: dict[str, EngineRun], *, block_size: int, temperature: float,
                  context: dict[str, Any]) -> dict[str, Any]:
    """The report in the in-process report's layout; tau is what the engine reported."""
    target = runs["target"]
    target_rate = target.completion_tokens / target.wall_s if target.wall_s > 0 else 0.0
    methods = {}
    for name, run in runs.items():
        rate = run.completion_tokens / run.wall_s if run.wall_s > 0 else 0.0
        methods[name] = {
            "mean_tau": run.engine_tau if name != "target" else 1.0, "tau_source": f"{engine} (engine-reported)",
            "new_tokens": run.completion_tokens, "wall_s": run.wall_s, "tokens_per_s": rate,
            "speedup": rate / target_rate if target_rate else None,
            "identical_to_target": (run.texts == target.texts) if temperature <= 0 and name != "target" else None,
            "argv": run.argv,
        }
    return {**context, "engine": engine, "block_size": block_size, "temperature": temperature,
            "num_prompts": len(target.texts), "methods": methods}


def render_engine_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Engine eval ({report['engine']}): {report.get('profile', '')}", "",
             f"Target `{report.get('target', '')}`, drafter `{report.get('checkpoint', '')}`, block size "
             f"{report['block_size']}, temperature {report['temperature']}, {report['num_prompts']} prompts; "
             "tau as the engine reports it.", "",
             "| method | engine tau | new tokens | tokens/s | speedup | same text as target |", "|---|---|---|---|---|---|"]
    for name, m in report["methods"].items():
        tau = "-" if m["mean_tau"] is None else f"{m['mean_tau']:.2f}"
        same = "-" if m["identical_to_target"] is None else ("yes" if m["identical_to_target"] else "NO")
        speedup = "-" if m["speedup"] is None else f"{m['speedup']:.2f}"
        lines.append(f"| {name} | {tau} | {m['new_tokens']} | {m['tokens_per_s']:.1f} | {speedup} | {same} |")
    return "\n".join(lines) + "\n"


def evaluate_with_engine(profile: Profile, run_dir: Path, checkpoint: Path, options: Any, engine: str,
                         launch: Optional[Sequence[str]] = None) -> Any:
    """The `eval --engine` flow: the three methods on the engine -> `eval/engine-<engine>.{json,md}`."""
    from dflash.drafter.checkpoint import read_drafter_config
    from dflash.eval.options import EvalSummary, eval_prompts_path, prompt_set_label
    from dflash.generate.prompts import load_prompts
    from dflash.models import resolve_model_path
    from launcher_core.fileio import write_json_atomic, write_text_atomic

    if launch is None:
        check_engine_installed(engine, profile)
    target = resolve_model_path(profile.model.target)
    block_size = int(read_drafter_config(checkpoint).block_size)
    prompts_path = eval_prompts_path(profile, options.prompts_path)
    prompts = load_prompts(prompts_path)[: options.num_prompts or profile.eval.num_prompts]
    temperature = profile.eval.temperature if options.temperature is None else options.temperature
    settings = EngineSettings(max_new_tokens=options.max_new_tokens or profile.eval.max_new_tokens,
                              temperature=temperature, seed=profile.eval.seed if options.seed is None else options.seed,
                              thinking=profile.generate.thinking, request_timeout_s=profile.generate.request_timeout_s)
    eval_dir = run_dir / "eval"
    runs = run_engines(engine, profile, target, checkpoint, block_size, prompts, settings, eval_dir / "logs", launch)
    context = {"profile": profile.name, "target": str(target), "checkpoint": str(checkpoint),
               "prompts_file": str(prompts_path), "prompt_set": prompt_set_label(prompts_path),
               "max_new_tokens": settings.max_new_tokens, "seed": settings.seed}
    report = engine_report(engine, runs, block_size=block_size, temperature=temperature, context=context)
    files = [write_json_atomic(eval_dir / f"engine-{engine}.json", report),
             write_text_atomic(eval_dir / f"engine-{engine}.md", render_engine_markdown(report))]
    return EvalSummary(report=report, files=files)
