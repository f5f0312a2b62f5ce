"""The pipeline's stages, audit -> generate -> tokenize -> train -> eval, in one run dir (the
subcommand that runs them: dflash.commands.pipeline).

Rerunning resumes: a stage is skipped when the manifest says it is done, its outputs exist and
none of its inputs changed after them (the rule `make` uses, on modification times). `generate`
resumes by itself (it sends only prompts without a completion, and starts no server when there
are none); `train` continues from its latest checkpoint when it was interrupted and starts over
when its dataset changed after the last checkpoint; the audit always runs (it is about the
machine now, and takes seconds).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from launcher_core.errors import ConfigError, ParityFailed
from launcher_core.manifest import STAGES
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.eval.report_schema import EvalReport


@dataclass(frozen=True)
class PipelineContext:
    profile: Profile                 # paths.run_dir already points at the run directory
    run_dir: Path
    force_audit: bool = False        # go on when the audit FAILs
    redo: frozenset[str] = frozenset()

    def path(self, template: str) -> Path:
        from launcher_core.profile import expand_path

        return expand_path(self.profile, template)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[PipelineContext], str]                       # does the work; returns a summary line
    outputs: Callable[[PipelineContext], list[Path]] = lambda ctx: []
    inputs: Callable[[PipelineContext], list[Path]] = lambda ctx: []
    always_run: bool = False                                    # resumes by itself, or is about now


@dataclass(frozen=True)
class StageOutcome:
    name: str
    action: str          # "ran" or "skipped"
    wall_s: float
    detail: str


def with_run_dir(profile: Profile, run_dir: Optional[str | Path]) -> Profile:
    """The profile with paths.run_dir set, so every stage's `{run_dir}` paths agree."""
    if run_dir is None:
        return profile
    return replace(profile, paths=replace(profile.paths, run_dir=str(Path(run_dir).resolve())))


def newest_mtime(paths: Sequence[Path]) -> float:
    return max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)


def skip_reason(stage: Stage, ctx: PipelineContext, manifest: dict[str, Any]) -> Optional[str]:
    """Why `stage` need not run now, or None when it must run."""
    if stage.always_run or stage.name in ctx.redo:
        return None
    if manifest["stages"].get(stage.name, {}).get("state") != "done":
        return None
    outputs = stage.outputs(ctx)
    if not outputs or not all(p.exists() for p in outputs):
        return None
    if newest_mtime(stage.inputs(ctx)) > min(p.stat().st_mtime for p in outputs):
        return None
    return "already done, inputs unchanged"


def run_stages(stages: Sequence[Stage], ctx: PipelineContext,
               report: Callable[[str], None] = print) -> list[StageOutcome]:
    """Run or skip each stage in order; a stage that raises stops the pipeline (the error propagates)."""
    from launcher_core.manifest import read_manifest, update_stage

    outcomes = []
    for stage in stages:
        reason = skip_reason(stage, ctx, read_manifest(ctx.run_dir))
        if reason is not None:
            outcomes.append(StageOutcome(stage.name, "skipped", 0.0, reason))
            report(f"== {stage.name}: skipped ({reason})")
            continue
        report(f"== {stage.name}")
        started = time.perf_counter()
        detail = stage.run(ctx)
        wall_s = time.perf_counter() - started
        update_stage(ctx.run_dir, stage.name, None, pipeline_wall_s=round(wall_s, 1))
        outcomes.append(StageOutcome(stage.name, "ran", wall_s, detail))
        report(f"== {stage.name}: {detail} ({wall_s:.0f} s)")
    return outcomes


# --- the real stages ---------------------------------------------------------------------------

def _audit(ctx: PipelineContext) -> str:
    from envcheck.preflight import run_preflight

    findings = run_preflight(ctx.profile, force=ctx.force_audit, run_dir=ctx.run_dir)
    counts = {status: sum(f.status == status for f in findings) for status in ("PASS", "WARN", "FAIL", "SKIP")}
    return ", ".join(f"{count} {status}" for status, count in counts.items())


def _generate(ctx: PipelineContext) -> str:
    from dflash.generate import generate_from_profile
    from dflash.generate.generation_run import NothingSent

    _engine_ready(ctx.profile, ctx.profile.generate.backend)
    try:
        summary = generate_from_profile(ctx.profile, run_dir=ctx.run_dir)
    except NothingSent as outstanding:    # the pipeline goes on with the completions it has, as the first run did
        if not outstanding.done:
            raise
        return (f"nothing sent: {outstanding.done} prompts have completions, {outstanding.failed_before} failed "
                f"earlier (`launcher.py generate --retry-failed` sends them again)")
    if summary.selected == 0:
        return f"all {summary.total} prompts already have completions"
    return f"{summary.selected} prompts sent, {summary.already_done} done before"


def _tokenize(ctx: PipelineContext) -> str:
    from dflash.data import tokenize_completions
    from launcher_core.manifest import read_manifest

    # Its own dataset (the manifest names it) or --redo tokenize: replaced, the old one kept as a backup.
    written_before = read_manifest(ctx.run_dir)["stages"].get("tokenize", {}).get("dataset")
    own = written_before == str(ctx.path(ctx.profile.paths.dataset)) or "tokenize" in ctx.redo
    summary = tokenize_completions(ctx.profile, run_dir=ctx.run_dir, force=own)
    figures = summary.manifest_figures()
    return ", ".join(f"{key} {figures[key]}" for key in ("samples", "tokens", "loss_tokens", "degenerate_share") if key in figures) \
        or "dataset written"


def _train(ctx: PipelineContext) -> str:
    from dflash.drafter.checkpoint_files import checkpoints_dir
    from dflash.train.supervisor.launch import run_training
    from dflash.train.supervisor.resume import step_directories
    from launcher_core.manifest import read_manifest

    state = read_manifest(ctx.run_dir)["stages"].get("train", {}).get("state")
    has_checkpoint = bool(step_directories(checkpoints_dir(ctx.run_dir)))   # whole or not: train --resume verifies
    resume, start_over = train_mode(state, has_checkpoint, "train" in ctx.redo)
    run_training(ctx.profile, run_dir=ctx.run_dir, resume=resume, start_over=start_over)    # the disk and RAM checks run
    entry = read_manifest(ctx.run_dir)["stages"].get("train", {})
    if entry.get("state") != "done":
        raise ConfigError(f"training stopped before the end (step {entry.get('stopped_at_step', '?')}); "
                          "rerun the pipeline to continue from the last checkpoint")
    return f"{'resumed, ' if resume else ''}{entry.get('steps')} steps, last loss {entry.get('last_loss')}"


def train_mode(state: Optional[str], has_checkpoint: bool, redo: bool) -> tuple[bool, bool]:
    """(resume, start_over) for run_training: continue an unfinished run from its checkpoint; start
    over (the old train/ moved aside) when a finished run is stale or `--redo` asks for it."""
    resume = has_checkpoint and state != "done" and not redo
    return resume, has_checkpoint and not resume


def _eval(ctx: PipelineContext) -> str:
    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions, drafted_figures

    checkpoint, which = eval_checkpoint(ctx.run_dir)
    print(f"evaluating {which}", flush=True)
    engine = served_engine(ctx.profile)
    if engine:
        _engine_ready(ctx.profile, engine, serves_drafter=True)     # before the in-process eval spends its time
    # in-process first, whatever the profile serves with: eval/report.md is kept when the served check fails
    report = run_eval(ctx.profile, run_dir=ctx.run_dir,
                      options=EvalOptions(checkpoint=checkpoint, engine="transformers")).report
    sets = [(report.methods, report.num_prompts, report.context.prompt_set or report.context.prompts_file),
            *((extra.methods, extra.num_prompts, f"benchmark {extra.benchmark}" if extra.benchmark else extra.label)
              for extra in report.also_sets)]
    line = "; also ".join(f"{drafted_figures(methods)} on {count} prompts, {label}" for methods, count, label in sets)
    line = f"{which}: {line}"
    if not engine:
        return line
    print(f"in-process: {line}", flush=True)
    try:
        return f"{line}; {_served(ctx, engine, checkpoint)}"
    except ParityFailed as failed:
        raise served_check_failed(ctx.run_dir, failed) from None


def served_engine(profile: Profile) -> str:
    """The engine of the pipeline's served check: eval.serve_engine, else eval.engine where it names one
    (a GPU profile that evaluates with SGLang); "" for none."""
    return profile.eval.serve_engine or ("" if profile.eval.engine == "transformers" else profile.eval.engine)


def served_check_failed(run_dir: Path, failed: ParityFailed) -> ParityFailed:
    """The gate's failure (or its undecided verdict, which is not a pass) with a last line for the pipeline: the
    in-process eval is kept, which rules broke, and the report to read."""
    outcome = "could not be decided by" if failed.rules == ("undecided",) else "failed"
    return ParityFailed(f"{failed}\npipeline: the in-process eval is done and kept ({run_dir / 'eval' / 'report.md'}); "
                        f"the served check {outcome} the parity gate ({', '.join(failed.rules)}): read "
                        f"{Path(failed.report).with_suffix('.md')} for each prompt", failed.rules, failed.report)


def eval_checkpoint(run_dir: Path) -> tuple[Optional[str], str]:
    """The checkpoint the pipeline evaluates (None: the run's latest) and why: the best step by
    held-out tau when training measured one and kept its checkpoint (dflash.train.rank.validation),
    else the last step."""
    from dflash.drafter.checkpoint_files import has_weights
    from launcher_core.manifest import read_manifest

    entry = read_manifest(run_dir)["stages"].get("train", {})
    best_step, best = entry.get("validation_best_step"), entry.get("validation_best_checkpoint")
    if best_step is None:
        return None, "the last step (no held-out rows: train.validation_share is 0)"
    last = f"step {entry.get('validation_last_step')}, held-out tau {entry.get('validation_last_tau')}"
    if not best or not has_weights(Path(best)):
        return None, (f"the last step ({last}): the best held-out step {best_step} has no checkpoint "
                      f"(train.validation_every_steps off the train.save_every_steps grid)")
    if best_step == entry.get("validation_last_step"):
        return best, f"step {best_step}, the last and best by held-out tau ({entry.get('validation_best_tau')})"
    return best, f"step {best_step}, the best by held-out tau ({entry.get('validation_best_tau')}; {last})"


def _served(ctx: PipelineContext, engine: str, checkpoint: Optional[str] = None) -> str:
    """The drafter served by `engine` (`served_engine`), its tau next to the in-process one (parity gate);
    eval.benchmarks' first turns too unless eval.serve_benchmarks is off (each benchmark starts every engine again)."""
    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions

    benchmarks = None if ctx.profile.eval.serve_benchmarks else ()
    options = EvalOptions(engine=engine, checkpoint=checkpoint, benchmarks=benchmarks)
    return served_line(engine, run_eval(ctx.profile, run_dir=ctx.run_dir, options=options).report)


def served_line(engine: str, report: EvalReport) -> str:
    """`served by vllm: dflash tau T speedup S vs in-process tau T' speedup S' on the same N prompts, lossless`:
    each speedup over the same decoder without a drafter (the engine alone; in-process, target-only)."""
    dflash = report.methods["dflash"]
    inprocess = report.inprocess.methods.get("dflash") if report.inprocess else None
    beside = (f" vs in-process {_tau_speedup(inprocess.mean_tau, inprocess.speedup)} on the same "
              f"{report.num_prompts} prompts" if inprocess else "")
    lossless = {True: ", lossless", False: ", OUTPUT DIFFERS FROM TARGET", None: ""}[dflash.identical_to_target]
    return f"served by {engine}: dflash {_tau_speedup(dflash.mean_tau, dflash.speedup)}{beside}{lossless}"


def _tau_speedup(tau: Optional[float], speedup: Optional[float]) -> str:
    """`tau 1.42 speedup 1.18x`: the speedup over the same decoder alone, one request in flight."""
    return f"tau {'-' if tau is None else f'{tau:.2f}'} speedup {'-' if speedup is None else f'{speedup:.2f}x'}"


def _engine_ready(profile: Profile, engine: str, serves_drafter: bool = False) -> None:
    """An engine's own venv, where the profile names no eval.engine_python: `launcher.py engine setup ENGINE`
    builds it the first time and does nothing once it is built. vLLM (generate.backend or the drafter served)
    always runs from it; SGLang serving the drafter does where this environment's SGLang cannot serve it as
    trained (the cu128 set's 0.5.10.post1 has no DFLASH: the venv holds 0.5.19, about 6.5 GB downloaded)."""
    if profile.eval.engine_python:
        return
    if engine == "vllm" or (serves_drafter and engine == "sglang" and not sglang_here_serves(profile)):
        from dflash.generate.engine_env import setup_engine_env

        setup_engine_env(engine)


def sglang_here_serves(profile: Profile) -> bool:
    """Whether this environment's SGLang (read from its metadata, not imported) serves the profile's drafter as trained."""
    import importlib.metadata

    from envcheck.engine_releases import sglang_drafter_problems

    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return not sglang_drafter_problems(version, profile.drafter)


def _latest_pointer(ctx: PipelineContext) -> Path:
    from dflash.drafter.checkpoint_files import LATEST, checkpoints_dir

    return checkpoints_dir(ctx.run_dir) / LATEST


def default_stages() -> list[Stage]:
    completions = lambda ctx: [ctx.path(ctx.profile.paths.completions)]  # noqa: E731
    dataset = lambda ctx: [ctx.path(ctx.profile.paths.dataset)]          # noqa: E731
    checkpoint = lambda ctx: [_latest_pointer(ctx)]                      # noqa: E731
    return [
        Stage("audit", _audit, always_run=True),
        Stage("generate", _generate, outputs=completions, always_run=True),
        Stage("tokenize", _tokenize, outputs=dataset, inputs=completions),
        Stage("train", _train, outputs=checkpoint, inputs=dataset),
        Stage("eval", _eval, outputs=lambda ctx: [ctx.run_dir / "eval" / "report.json"], inputs=checkpoint),
    ]


def select_stages(stages: Sequence[Stage], stop_after: Optional[str]) -> list[Stage]:
    names = [stage.name for stage in stages]
    if stop_after is None:
        return list(stages)
    if stop_after not in names:
        raise ConfigError(f"--stop-after {stop_after!r}: valid stages are {', '.join(names)}")
    return list(stages[: names.index(stop_after) + 1])


def redo_from(stage: Optional[str]) -> frozenset[str]:
    """`--redo STAGE`: that stage and every later one run again."""
    if stage is None:
        return frozenset()
    if stage not in STAGES:
        raise ConfigError(f"--redo {stage!r}: valid stages are {', '.join(STAGES)}")
    return frozenset(STAGES[STAGES.index(stage):])


def run_pipeline(profile: Profile, *, run_dir: Optional[str | Path] = None, force_audit: bool = False,
                 redo: Optional[str] = None, stop_after: Optional[str] = None,
                 stages: Optional[Sequence[Stage]] = None) -> list[StageOutcome]:
    from launcher_core.profile import expand_path

    profile = with_run_dir(profile, run_dir)
    ctx = PipelineContext(profile, expand_path(profile, profile.paths.run_dir), force_audit, redo_from(redo))
    chosen = select_stages(stages if stages is not None else default_stages(), stop_after)
    if any(stage.name == "eval" for stage in chosen):
        from dflash.eval.evaluate import load_benchmarks
        from dflash.eval.options import EvalOptions, also_prompt_paths

        also_prompt_paths(profile, None)   # a missing eval.also_prompts file fails now, not after training
        load_benchmarks(profile, EvalOptions())   # and eval.benchmarks' missing data
    return run_stages(chosen, ctx)
