"""`eval --engine sglang|vllm`: the drafter served by the engine that will serve it in production,
held against the same drafter decoded in-process by the parity gate (dflash/eval/parity.py).

In order:

1. the prompts are decoded in-process (target alone, DFlash, prompt lookup; exactly `eval`'s
   in-process decoding), which gives their token ids (our chat template), each method's tokens
   and every step's acceptance;
2. the drafter is exported for the engine (`launcher.py export --for ENGINE`) into
   `{run_dir}/eval/engine-<engine>-drafter/`; for SGLang the export refuses a drafter whose layers
   the installed release would run with other attention than trained, naming the release;
3. the engine serves each method on those token ids, one request in flight (dflash.eval.engines);
4. the parity gate compares the two sides per method; `eval/engine-<engine>.json` and `.md` are
   written, then ParityFailed (exit 6) names each divergence if the served drafter is not the
   trained one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from dflash.eval.engines import METHODS, EngineRun, EngineSettings, check_engine_installed, check_engine_serves, run_engines
from dflash.eval.parity import PromptAcceptance, SideFigures, histogram_of_taus, method_parity
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.eval.mode import RenderMode
    from dflash.eval.options import EvalOptions, EvalSummary
    from dflash.eval.report_schema import EvalReport, ParityRow, ReportContext


@dataclass(frozen=True)
class InProcessDecode:
    """The in-process eval of the engine's prompts: its report and, per method and prompt, the new
    tokens and each step's tau; the prompts' token ids (what the engine is sent) and names."""

    report: EvalReport
    tokens: dict[str, list[list[int]]]      # method -> new tokens of each prompt
    taus: dict[str, list[list[int]]]        # method -> each prompt's step taus
    prompt_ids: list[list[int]]
    prompt_names: list[str]
    stop_token_ids: tuple[int, ...]
    margins: dict[str, list[tuple[list[Optional[float]], list[Optional[float]]]]]   # method -> each prompt's
    #                                        per-step (drafter, target) margins (specdec.draft_margin / target_margin)
    drafts: dict[str, list[list[list[int]]]]    # method -> each prompt's per-step proposed draft tokens

    def side(self, method: str) -> SideFigures:
        """The method as the parity gate reads it."""
        figures = self.report.methods[method]
        prompts = [PromptAcceptance(tokens, len(taus), sum(taus) - len(taus), [tau - 1 for tau in taus], *margins,
                                    drafts=drafts)
                   for tokens, taus, margins, drafts in zip(self.tokens[method], self.taus[method],
                                                            self.margins[method], self.drafts[method])]
        return SideFigures(prompts, histogram_of_taus([t for taus in self.taus[method] for t in taus]),
                           figures.position_acceptance, figures.identical_to_target)


@dataclass(frozen=True)
class EngineEval:
    """What `eval --engine` measured: the report (with its parity rows), the served runs, the in-process side."""

    report: EvalReport
    runs: dict[str, EngineRun]
    inprocess: InProcessDecode
    served_drafter: Path


def evaluate_with_engine(profile: Profile, run_dir: Path, checkpoint: Path, options: EvalOptions, engine: str,
                         launch: Optional[Sequence[str]] = None) -> EvalSummary:
    """`eval --engine`: `eval/engine-<engine>.{json,md}` written, then ParityFailed if the gate fails."""
    from dflash.eval.mode import render_mode_for
    from dflash.eval.options import EvalSummary
    from dflash.eval.parity import check_parity_sets
    from dflash.eval.report_schema import SetBrief

    benchmarks = served_benchmarks(profile, options, run_dir / "eval")   # before any model loads or server starts
    mode = render_mode_for(profile, checkpoint, options)                 # so is a mode other than the data's
    options = replace(options, thinking=mode.thinking)
    briefs, written = [], []
    for name, (prompts_path, count) in benchmarks.items():
        bench = engine_eval(profile, run_dir, checkpoint, options, engine, launch, prompts=(prompts_path, count),
                            label=f"benchmark {name} ({count} samples, first turns: {prompts_path.name})")
        bench = replace(bench, report=with_mode(bench.report, mode))
        bench_files = write_engine_reports(bench.report, prompts_path.parent)
        briefs.append(SetBrief.of(bench.report, bench_files[0], benchmark=name))
        written.append((bench.report, bench_files))
    result = engine_eval(profile, run_dir, checkpoint, options, engine, launch)
    report = replace(with_mode(result.report, mode), also_sets=briefs)
    files = write_engine_reports(report, run_dir / "eval")
    check_parity_sets([(f"benchmark {brief.benchmark}", bench_report.parity, str(bench_files[0]))
                       for brief, (bench_report, bench_files) in zip(briefs, written)]
                      + [(report.context.prompt_set or "", report.parity, str(files[0]))])
    return EvalSummary(report=report, files=files + [path for _, paths in written for path in paths])


def with_mode(report: EvalReport, mode: RenderMode) -> EvalReport:
    """The report with the prompts' mode, and the mismatch it was asked to measure, if any."""
    return replace(report, context=replace(report.context, rendering=mode.describe(), mode_mismatch=mode.mismatch))


def served_benchmarks(profile: Profile, options: EvalOptions, eval_dir: Path) -> dict[str, tuple[Path, int]]:
    """`--bench` / `eval.benchmarks` for the served check: each benchmark's first turns (z-lab's OpenAI-server
    benchmark sends the first turn only) as `eval/bench/<name>/prompts.jsonl`, and how many."""
    from dflash.eval.options import bench_dir, bench_sample_count, benchmark_names, benchmark_prompts_file
    from dflash.prompts.benchmarks import load_benchmark

    count = bench_sample_count(profile, options)
    found = {}
    for name in benchmark_names(profile, options):
        samples = load_benchmark(name, bench_dir(profile, options), count)
        found[name] = (benchmark_prompts_file(eval_dir, name, samples), len(samples))
    return found


def write_engine_reports(report: EvalReport, eval_dir: Path) -> list[Path]:
    """`engine-<engine>.json` (the report) and `.md` (its tables), each written atomically."""
    from launcher_core.fileio import write_text_atomic

    return [report.write_json(eval_dir / f"engine-{report.engine}.json"),
            write_text_atomic(eval_dir / f"engine-{report.engine}.md", render_engine_markdown(report))]


def engine_eval(profile: Profile, run_dir: Path, checkpoint: Path, options: EvalOptions, engine: str,
                launch: Optional[Sequence[str]] = None, prompts: Optional[tuple[Path, int]] = None,
                label: Optional[str] = None) -> EngineEval:
    """Steps 1-4 of the module doc, nothing written but the export and the engine logs; `prompts`:
    (prompts file, count) instead of the eval's own set (a benchmark's), `label` naming them."""
    from dflash.drafter.checkpoint_files import resolve_checkpoint_dir
    from dflash.eval.engine_deviations import engine_deviations
    from dflash.eval.options import eval_prompts_path, prompt_set_label
    from dflash.eval.report_schema import ReportContext
    from dflash.target_model import resolve_model_path

    version = check_engine_installed(engine, profile) if launch is None else None
    check_engine_serves(engine, version, profile, resolve_checkpoint_dir(checkpoint))
    deviations = engine_deviations(engine, profile) if launch is None else []     # a stand-in computes as we do
    target = resolve_model_path(profile.model.target)
    prompts_path, count = prompts or (eval_prompts_path(profile, options.prompts_path),
                                      options.num_prompts or profile.eval.num_prompts)
    settings = engine_settings(profile, options)
    inprocess = inprocess_decode(profile, checkpoint, prompts_path, count, settings,
                                 next((d.context_k_norm_layer for d in deviations), None))
    settings = replace(settings, stop_token_ids=inprocess.stop_token_ids, block_size=inprocess.report.block_size)
    eval_dir = run_dir / "eval"
    drafter = export_for_engine(engine, checkpoint, target, eval_dir, version)
    runs = run_engines(engine, profile, target, drafter, settings.block_size, inprocess.prompt_ids, settings,
                       eval_dir / "logs", launch)
    context = ReportContext(profile=profile.name, target=str(target), checkpoint=str(checkpoint),
                            prompts_file=str(prompts_path), prompt_set=label or prompt_set_label(prompts_path),
                            max_new_tokens=settings.max_new_tokens, seed=settings.seed, served_drafter=str(drafter),
                            baseline=served_baseline(engine, profile),
                            engine_deviation="; ".join(d.description for d in deviations) or None)
    report = engine_report(engine, runs, block_size=settings.block_size, temperature=settings.temperature,
                           context=context)
    report = replace(report, parity=parity_rows(runs, inprocess, profile.model.dtype),
                     inprocess=inprocess.report.without_prompts())
    return EngineEval(report, runs, inprocess, drafter)


def parity_rows(runs: dict[str, EngineRun], inprocess: InProcessDecode, dtype: str) -> dict[str, ParityRow]:
    """The parity gate's row of every served method (the drafter's gated); `dtype`: what both sides decoded in."""
    target = runs.get("target")
    served_target = [p.token_ids for p in target.prompts] if target else None
    return {name: method_parity(name, served_side(run, target), inprocess.side(name), inprocess.prompt_names,
                                served_target, dtype=dtype) for name, run in runs.items()}


def served_side(run: EngineRun, target: Optional[EngineRun]) -> SideFigures:
    """A served method as the parity gate reads it; lossless against the engine's own target-only run."""
    prompts = [PromptAcceptance(p.token_ids, p.steps, p.accepted, p.per_step) for p in run.prompts]
    lossless = None if target is None or run is target else _same_output(run, target)
    return SideFigures(prompts, run.histogram, run.position_acceptance, lossless)


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
                          thinking=profile.generate.thinking if options.thinking is None else options.thinking,
                          request_timeout_s=profile.generate.request_timeout_s)


def export_for_engine(engine: str, checkpoint: Path, target: Path, eval_dir: Path, version: Optional[str]) -> Path:
    """The drafter in the engine's format (`launcher.py export --for ENGINE`), in the eval's own folder
    (replacing this eval's earlier export of it: an export is all the output rules let it replace).
    SGLang: refused, naming `version`, when that release would run a layer with other attention."""
    from dflash.drafter.export import export_drafter

    return export_drafter(checkpoint, engine, eval_dir / f"engine-{engine}-drafter", target=target, force=True,
                          sglang_version=version if engine == "sglang" else None).directory


def engine_report(engine: str, runs: dict[str, EngineRun], *, block_size: int, temperature: float,
                  context: ReportContext) -> EvalReport:
    """The report of the served methods; tau is what the engine counted."""
    from dflash.eval.report_schema import EvalReport, MethodFigures

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
            position_acceptance=run.position_acceptance, argv=run.argv, steps=sum(p.steps for p in run.prompts))
    return EvalReport(block_size=block_size, temperature=temperature, num_prompts=len(target.texts), methods=methods,
                      context=context, engine=engine)


def render_engine_markdown(report: EvalReport) -> str:
    from dflash.eval.report_writer import mode_lines, row_name

    context = report.context
    lines = [f"# Engine eval ({report.engine}): {context.profile or ''}", "",
             f"Target `{context.target or ''}`, drafter `{context.checkpoint or ''}` (served: "
             f"`{context.served_drafter or ''}`), block size {report.block_size}, temperature {report.temperature}, "
             f"{report.num_prompts} prompts, one request in flight; tau as the engine counts it.", "",
             *([f"Engine deviation: {context.engine_deviation}.", ""] if context.engine_deviation else []),
             *mode_lines(context),
             "| method | engine tau | new tokens | tokens/s | speedup | same tokens as target |", "|---|---|---|---|---|---|"]
    for name, m in report.methods.items():
        tau = "-" if m.mean_tau is None else f"{m.mean_tau:.2f}"
        same = "-" if m.identical_to_target is None else ("yes" if m.identical_to_target else "NO")
        speedup = "-" if m.speedup is None else f"{m.speedup:.2f}"
        lines.append(f"| {row_name(name, context)} | {tau} | {m.new_tokens} | {m.tokens_per_s:.1f} | {speedup} | {same} |")
    if report.also_sets:
        from dflash.eval.report_writer import acceptance_cell

        lines += ["", "## Benchmarks (served, first turns)", "",
                  "| benchmark | prompts | method | engine tau | acceptance at positions 1..B-1 | speedup | "
                  "same tokens as target | report |", "|---|---|---|---|---|---|---|---|"]
        for extra in report.also_sets:
            for name, m in extra.methods.items():
                if name != "target":
                    lines.append(f"| {extra.label if not extra.benchmark else extra.benchmark} | {extra.num_prompts} "
                                 f"| {name} | {_cell(m.mean_tau)} | {acceptance_cell(m.position_acceptance) or '-'} "
                                 f"| {_cell(m.speedup)} | {_flag(m.identical_to_target)} | {extra.report} |")
    if report.parity:
        from dflash.eval.parity import GateConstants, parity_lines, prompt_parity_lines

        lines += ["", f"## Served vs in-process (the same token-id prompts; the gate on dflash: "
                      f"{GateConstants().describe()})", "", *parity_lines(report.parity),
                  *prompt_parity_lines(report.parity)]
    return "\n".join(lines) + "\n"


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _flag(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _same_output(run: EngineRun, target: EngineRun) -> bool:
    return [p.token_ids for p in run.prompts] == [p.token_ids for p in target.prompts]


def inprocess_decode(profile: Profile, checkpoint: Path, prompts_path: Path, count: int,
                     settings: EngineSettings, context_k_norm_layer: Optional[int] = None,
                     methods: Sequence[str] = METHODS) -> InProcessDecode:
    """The in-process eval of these prompts, decoded as `eval` does; `context_k_norm_layer`: the drafter's context
    keys normed as the engine norms them (dflash.eval.engine_deviations); `methods`: those decoded (the target
    alone always is: it is every method's baseline)."""
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
    from dflash.eval.report_writer import build_report
    from dflash.eval.specdec import DecodeSettings

    model, tokenizer, _ = load_target(profile)
    draft = replace(load_draft(str(checkpoint), model, profile.eval.draft_tokens),
                    context_k_norm_layer=context_k_norm_layer)
    prepare_cpu_decoding(profile, model, draft)
    stops = stop_token_ids(tokenizer, model)
    decode = DecodeSettings(block_size=draft.block_size, temperature=settings.temperature,
                            max_new_tokens=settings.max_new_tokens, eos_ids=stops)
    prompts = encode_prompts(tokenizer, prompts_path, count, settings.thinking)
    lookup = PromptLookupDrafter(max_ngram=profile.eval.prompt_lookup_max_ngram)
    drafters = [drafter for drafter in (draft, lookup) if drafter.name in methods]
    with cpu_threads(model, profile.eval.cpu_threads):
        results = decode_prompts(model, drafters, prompts, decode, settings.seed, draft.layer_ids)
    report = build_report(results, block_size=draft.block_size, temperature=settings.temperature)
    decoded = list(results[0].runs)
    tokens = {name: [entry.runs[name].tokens for entry in results] for name in decoded}
    taus = {name: [entry.runs[name].taus for entry in results] for name in decoded}
    margins = {name: [(entry.runs[name].draft_margins, entry.runs[name].target_margins) for entry in results]
               for name in decoded}
    drafts = {name: [entry.runs[name].drafts for entry in results] for name in decoded}
    return InProcessDecode(report, tokens, taus, [p.token_ids for p in prompts], [p.prompt_id for p in prompts],
                           tuple(stops), margins, drafts)
