"""`eval`'s entry point: the drafter evaluated in-process (dflash.eval.evaluate) or served by an
engine (dflash.eval.served, which also decodes in-process for the parity gate), with the run
manifest's eval entry saying running / done / failed as it goes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from dflash.eval.evaluate import manifest_figures, resolve_checkpoint
from dflash.eval.options import EvalOptions, EvalSummary
from launcher_core.profile import expand_path
from launcher_core.schema import Profile


def run_eval(profile: Profile, *, run_dir: Optional[str | Path] = None,
             options: EvalOptions = EvalOptions()) -> EvalSummary:
    """Evaluate the drafter; the manifest's eval entry says running/done/failed as it goes."""
    from launcher_core.manifest import read_manifest, update_stage

    run_dir = Path(run_dir) if run_dir is not None else expand_path(profile, profile.paths.run_dir)
    checkpoint = resolve_checkpoint(run_dir, options.checkpoint)
    read_manifest(run_dir)                              # a damaged manifest is named first (InputError)
    check_inputs(profile, checkpoint, options)
    update_stage(run_dir, "eval", "running", checkpoint=str(checkpoint))
    engine = options.engine or profile.eval.engine
    try:
        if engine == "transformers":
            from dflash.eval.evaluate import evaluate_in_process

            summary = evaluate_in_process(profile, run_dir, checkpoint, options)
        else:
            from dflash.eval.served import evaluate_with_engine

            summary = evaluate_with_engine(profile, run_dir, checkpoint, options, engine)
    except BaseException as error:
        update_stage(run_dir, "eval", "failed", error=str(error) or type(error).__name__)
        raise
    update_stage(run_dir, "eval", "done", **manifest_figures(summary.report))
    return summary


def check_inputs(profile: Profile, checkpoint: Path, options: EvalOptions) -> None:
    """Before any model loads or any set decodes (torch-free): the drafter directory holds a DFlash drafter
    config and weights, and every prompts file of the eval reads (not empty, valid JSONL); InputError naming it."""
    from dflash.drafter.checkpoint_files import init_source_problem
    from dflash.eval.options import also_prompt_paths, eval_prompts_path
    from dflash.generate.prompt_files import load_prompts
    from launcher_core.errors import InputError

    problem = init_source_problem(checkpoint)
    if problem:
        raise InputError(f"--draft {options.checkpoint}: not a drafter checkpoint: {problem}" if options.checkpoint
                         else problem)
    for path in [eval_prompts_path(profile, options.prompts_path), *also_prompt_paths(profile, options.prompts_path)]:
        load_prompts(path)
