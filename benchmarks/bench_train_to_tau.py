"""Held-out tau against training CPU-seconds, a curve per recipe: which recipe buys the most acceptance per unit of compute.

    .venv/bin/python benchmarks/bench_train_to_tau.py --run-dir RUN_DIR [--profile cpu-demo] [--recipes ce,dpace,distill]
        [--cpu-seconds S] [--points N] [--steps N] [--heldout N] [--bench-samples N] [--out DIR] [--save-dir DIR]
    .venv/bin/python benchmarks/bench_train_to_tau.py --smoke      (the smallest setting: the test suite's)

A recipe is the base profile (`--profile`) with a few keys changed (RECIPES: the loss, train.loss, and
what it needs). Each trains in one process (2 threads) through the trainer's own `build_state` and
`run_next_step` (bench_drafter_variants' machinery) on the same data, RUN_DIR's `dataset/` (what the
tokenize stage wrote; read only), in a scratch run directory of its own (a recipe with
train.feature_cache fills its own cache as it trains, as a run does), for the same budget of training
CPU-seconds (this process's CPU time spent in the steps, `time.process_time`; the measurements are not
counted). Every recipe keeps the profile's schedule (`--steps`, default the profile's train.epochs), so
a costlier step reaches fewer steps within the budget. At `--points` CPU-second marks spread over the
budget (and at 0) it measures, all on held-out data:

* `val`: the trainer's own held-out measurement (dflash.train.rank.validation.measure) on the dataset rows
  train.validation_share holds out of training (the same rows for every recipe);
* `everyday`, `indist`: the prompt sets `eval` uses (bench_drafter_variants' greedy walk over the target's
  greedy continuations: tau = tokens / steps, as eval counts it);
* `humaneval`, `mt-bench`: the two benchmarks that ship offline (their first turns, as z-lab's benchmark
  builds them, dflash.prompts.benchmarks), walked the same way.

Writes DIR/train_to_tau.json (every point, the command, the budget, prompt lookup's tau per set) and
DIR/train_to_tau.png (a panel per measure, a curve per recipe, prompt lookup dashed), atomically; the JSON
is also rewritten after every point (`complete: false` until the last recipe ends), so a run that dies keeps
what it measured; `--save-dir` keeps each recipe's drafter at every point (DIR/RECIPE/train/checkpoints/step-N).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_drafter_variants import (  # noqa: E402
    Heldout,
    drafter_taus,
    greedy_continuations,
    heldout_sequences,
    prompt_lookup_tau,
    prompt_sets,
    smoke_dataset,
    variant_profile,
)

if TYPE_CHECKING:
    from dflash.train.rank.setup import TrainState
    from launcher_core.schema import Profile

# Each recipe: the [drafter] / [train] settings that differ from the base profile.
RECIPES: dict[str, dict[str, Any]] = {
    "ce": {},                                                                # the profile as it is (train.loss = "ce")
    "ce-online": {"train": {"feature_cache": False}},                        # ce paying the target every step, as distill does
    "dpace": {"train": {"loss": "dpace"}},
    "distill": {"train": {"loss": "distill", "feature_cache": False}},       # the target runs to its last layer every step
}
PROMPT_SETS = ("everyday", "indist")
BENCHMARK_SETS = ("humaneval", "mt-bench")
SMOKE = {"cpu_seconds": 4.0, "points": 2, "steps": 3, "heldout": 1, "bench_samples": 1, "new_tokens": 4,
         "recipes": "ce,dpace,distill", "sets": "everyday,humaneval", "validation_share": 0.25, "global_batch": 4}


@dataclass
class Point:
    """One measurement of a recipe: after `cpu_s` training CPU-seconds (`step` steps)."""

    cpu_s: float
    step: int
    loss: float | None
    tau: dict[str, float]


@dataclass
class RecipeRun:
    name: str
    overrides: dict[str, Any]
    points: list[Point] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="a run directory with dataset/ (after tokenize); read only")
    parser.add_argument("--profile", default="cpu-demo", help="the base profile of every recipe")
    parser.add_argument("--recipes", default="ce,dpace,distill", help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--cpu-seconds", type=float, default=3600.0, help="training CPU-seconds per recipe")
    parser.add_argument("--points", type=int, default=4, help="measurements spread over the budget (and one at 0)")
    parser.add_argument("--steps", type=int, default=0, help="the schedule's steps (0: the profile's, train.epochs)")
    parser.add_argument("--heldout", type=int, default=16, help="prompts of each prompt set")
    parser.add_argument("--bench-samples", type=int, default=4, help="prompts of each benchmark (first turns)")
    parser.add_argument("--new-tokens", type=int, default=0, help="greedy tokens per prompt (0: eval.max_new_tokens)")
    parser.add_argument("--sets", default=",".join(PROMPT_SETS + BENCHMARK_SETS),
                        help="the walked sets, comma-separated, of everyday, indist, humaneval, mt-bench (or none)")
    parser.add_argument("--validation-share", type=float, default=-1.0,
                        help="dataset rows held out for `val` (default: the profile's train.validation_share)")
    parser.add_argument("--global-batch", type=int, default=0, help="sequences per step (0: the profile's)")
    parser.add_argument("--out", type=Path, default=None, help="the directory the JSON and PNG go to (--smoke: a "
                        "scratch directory unless given)")
    parser.add_argument("--save-dir", type=Path, default=None, help="keep each recipe's drafter at every point")
    parser.add_argument("--smoke", action="store_true", help=f"the smallest setting: {SMOKE}, 8 rows of 32 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    elif args.run_dir is None or args.out is None:
        parser.error("--run-dir and --out are required (or --smoke)")
    unknown = [name for name in args.recipes.split(",") if name not in RECIPES]
    if unknown:
        parser.error(f"--recipes: {', '.join(unknown)} not one of {', '.join(RECIPES)}")
    args.sets = [] if args.sets == "none" else args.sets.split(",")
    if set(args.sets) - set(PROMPT_SETS + BENCHMARK_SETS):
        parser.error(f"--sets: each of {', '.join(PROMPT_SETS + BENCHMARK_SETS)} (or none)")
    return args


def walked_sets(target: Any, tokenizer: Any, names: list[str], heldout: int, bench_samples: int,
                new_tokens: int) -> list[Heldout]:
    """Each set's prompts continued greedily by the target (done once, before any recipe trains)."""
    from dflash.eval.evaluate import encode_messages
    from dflash.prompts.benchmarks import load_benchmark

    sets, paths = [], prompt_sets()
    for name in names:
        if name in PROMPT_SETS:
            sets.append(Heldout(name, heldout_sequences(target, tokenizer, paths[name], heldout, new_tokens)))
            continue
        prompts = [encode_messages(tokenizer, p.prompt_id, [{"role": "user", "content": p.turns[0]}], thinking=False)
                   for p in load_benchmark(name, count=bench_samples)]
        sets.append(Heldout(name, greedy_continuations(target, [list(p.token_ids) for p in prompts], new_tokens)))
    return sets


def recipe_profile(base: Profile, name: str, dataset: Path, run_dir: Path, args: argparse.Namespace,
                   validation_share: float) -> Profile:
    """The recipe's profile on one process (bench_drafter_variants.variant_profile), `validation_share` held out."""
    profile = variant_profile(base, RECIPES[name], dataset, run_dir, args.steps)
    batch = args.global_batch or profile.train.global_batch
    return dataclasses.replace(profile, train=dataclasses.replace(profile.train, validation_share=validation_share,
                                                                  global_batch=batch,
                                                                  max_micro_batch=min(batch, profile.train.max_micro_batch)))


def measure_point(state: TrainState, sets: list[Heldout], cpu_s: float, loss: float | None) -> Point:
    """Every held-out figure of the drafter as it is now (not counted in the budget)."""
    from dflash.train.rank.data import TrainData
    from dflash.train.rank.validation import measure

    state.drafter.eval()
    taus = {held.name: drafter_taus(state, held, ["head"])["head"][0] for held in sets}
    data = state.data
    if isinstance(data, TrainData) and data.split.validation:
        taus["val"] = measure(state, data, list(data.split.validation)).tau
    state.drafter.train()
    return Point(cpu_s=round(cpu_s, 2), step=state.step, loss=loss, tau={k: round(v, 4) for k, v in taus.items()})


def train_to_budget(state: TrainState, budget_s: float, marks: list[float],
                    on_point: Callable[[float, float | None], None]) -> float:
    """The trainer's steps until `budget_s` CPU-seconds are spent (or the schedule ends); `on_point(spent,
    last loss)` once the spent time passes each of `marks`, and at the end. Returns the CPU-seconds spent."""
    from dflash.train.rank.step import run_next_step

    spent, loss, pending, measured = 0.0, None, sorted(marks), state.step
    while state.step < state.total_steps and spent < budget_s:
        started = time.process_time()
        stats, _ = run_next_step(state)
        spent += time.process_time() - started
        loss = None if math.isnan(stats.loss) else stats.loss
        if pending and spent >= pending[0]:
            pending = [mark for mark in pending if mark > spent]
            on_point(spent, loss)
            measured = state.step
    if measured != state.step:          # the schedule ended before the budget
        on_point(spent, loss)
    return spent


def run_recipe(name: str, profile: Profile, sets: list[Heldout], budget_s: float, points: int,
               save_dir: Path | None, measured: Callable[[RecipeRun], None] = lambda run: None) -> RecipeRun:
    """One recipe trained to the budget, measured at 0 and at each of `points` marks; `measured(run)` after
    each point (the caller writes what is measured so far, so a crash keeps it)."""
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state

    state = build_state(profile, Path(profile.paths.run_dir), WorkerEnv(0, 1, 0), resume=False)
    run = RecipeRun(name, RECIPES[name])

    def on_point(spent: float, loss: float | None) -> None:
        point = measure_point(state, sets, spent, loss)
        run.points.append(point)
        print(point_line(name, point), flush=True)
        measured(run)
        if save_dir is not None:
            from dflash.train.rank.sharded_checkpoints import save_training_checkpoint

            save_training_checkpoint(state, save_dir / name)

    on_point(0.0, None)
    train_to_budget(state, budget_s, [budget_s * i / points for i in range(1, points + 1)], on_point)
    return run


def point_line(name: str, point: Point) -> str:
    taus = "  ".join(f"{key} {value:.3f}" for key, value in point.tau.items())
    loss = "-" if point.loss is None else f"{point.loss:.4f}"
    return f"point {name:<10} cpu {point.cpu_s:>8.1f} s  step {point.step:>5}  loss {loss}  {taus}"


def write_json(out: Path, record: dict[str, Any], runs: list[RecipeRun], lookup: dict[str, float],
               complete: bool) -> Path:
    """DIR/train_to_tau.json as measured so far (`complete` False while recipes are still training), atomically."""
    from launcher_core.fileio import write_json_atomic

    out.mkdir(parents=True, exist_ok=True)
    document = {**record, "complete": complete, "prompt_lookup": lookup,
                "recipes": [dataclasses.asdict(run) for run in runs]}
    write_json_atomic(out / "train_to_tau.json", document)
    return out / "train_to_tau.json"


def write_record(out: Path, record: dict[str, Any], runs: list[RecipeRun], lookup: dict[str, float]) -> tuple[Path, Path]:
    return write_json(out, record, runs, lookup, complete=True), plot_curves(out / "train_to_tau.png", runs, lookup)


def plot_curves(path: Path, runs: list[RecipeRun], lookup: dict[str, float]) -> Path:
    """A panel per measure: tau against training CPU-seconds, a curve per recipe, prompt lookup dashed."""
    from dflash.eval.plots import _pyplot, _save

    plt = _pyplot()
    measures = list(dict.fromkeys(key for run in runs for point in run.points for key in point.tau))
    figure, axes = plt.subplots(1, max(1, len(measures)), figsize=(4.2 * max(1, len(measures)), 3.6), squeeze=False)
    for axis, measure in zip(axes[0], measures):
        for run in runs:
            series = [(p.cpu_s, p.tau[measure]) for p in run.points if measure in p.tau]
            axis.plot([x for x, _ in series], [y for _, y in series], marker="o", label=run.name)
        if measure in lookup:
            axis.axhline(lookup[measure], linestyle="--", color="grey", label="prompt lookup")
        axis.set_title(measure)
        axis.set_xlabel("training CPU-seconds")
        axis.set_ylabel("tau")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return _save(figure, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from dflash.target_model import load_target, resolve_model_path
    from launcher_core.profile import load_profile

    torch.set_num_threads(1 if args.smoke else 2)
    base = load_profile(args.profile)
    path = resolve_model_path(base.model.target)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    new_tokens = args.new_tokens or base.eval.max_new_tokens
    share = base.train.validation_share if args.validation_share < 0 else args.validation_share
    with tempfile.TemporaryDirectory(prefix="bench-train-to-tau-") as scratch:
        dataset = smoke_dataset(tokenizer, Path(scratch) / "dataset") if args.smoke else args.run_dir / "dataset"
        target = load_target(path, dtype=base.model.dtype)
        sets = walked_sets(target, tokenizer, args.sets, args.heldout, args.bench_samples, new_tokens)
        del target
        lookup = {held.name: round(prompt_lookup_tau(held, base.drafter.block_size), 4) for held in sets}
        for name, tau in lookup.items():
            print(f"prompt lookup {name:<10} tau {tau:.3f}", flush=True)
        record = {"command": " ".join(["benchmarks/bench_train_to_tau.py", *(argv if argv is not None else sys.argv[1:])]),
                  "profile": args.profile, "cpu_seconds": args.cpu_seconds, "points": args.points, "steps": args.steps,
                  "heldout": args.heldout, "bench_samples": args.bench_samples, "new_tokens": new_tokens,
                  "validation_share": share, "threads": torch.get_num_threads()}
        out = args.out or Path(scratch) / "out"
        runs: list[RecipeRun] = []

        def measured(run: RecipeRun) -> None:
            write_json(out, record, [*runs, run], lookup, complete=False)

        for name in args.recipes.split(","):
            profile = recipe_profile(base, name, dataset, Path(scratch) / f"run-{name}", args, share)
            runs.append(run_recipe(name, profile, sets, args.cpu_seconds, args.points, args.save_dir, measured))
        json_path, png_path = write_record(out, record, runs, lookup)
        print(f"wrote {json_path} and {png_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
