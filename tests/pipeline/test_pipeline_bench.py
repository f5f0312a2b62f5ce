"""The pipeline's benchmark rows (`eval.benchmarks`): the real eval stage decodes each benchmark beside
the held-out sets, `eval.bench_samples` of each, and the pipeline's closing figures show one row per
benchmark and method (tau, speedup, lossless, acceptance per block position), DFlash beside prompt
lookup; the shipped profiles name them (cpu-demo: the two offline ones; the flagships: all five, thinking on)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dflash.eval.options import EvalOptions, bench_sample_count
from launcher_core.profile import load_profile
from tests.eval.engine_vllm_common import answers, demo_drafter  # noqa: F401  (fixtures: the demo drafter)

ALL_FIVE = ("humaneval", "mt-bench", "gsm8k", "math500", "mbpp")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def with_eval(profile, **changes):
    return dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, **changes))


@pytest.mark.parametrize("bench_samples, num_prompts, option, expected", [
    (0, 16, None, 16),        # eval.num_prompts
    (8, 16, None, 8),         # eval.bench_samples
    (8, 16, 2, 2),            # --num-prompts caps every set, the benchmarks' too
])
def test_samples_per_benchmark(bench_samples, num_prompts, option, expected):
    profile = with_eval(load_profile("cpu-demo"), bench_samples=bench_samples, num_prompts=num_prompts)
    assert bench_sample_count(profile, EvalOptions(num_prompts=option)) == expected


def test_the_shipped_profiles_name_their_benchmarks():
    demo = load_profile("cpu-demo")
    assert demo.eval.benchmarks == ("humaneval", "mt-bench") and demo.eval.bench_samples >= 1
    assert demo.eval.serve_benchmarks is False          # the served check keeps to the held-out set (its cost)
    for name in ("rtx6000-x8", "b200-x8", "h200-x1"):
        flagship = load_profile(name)
        assert flagship.eval.benchmarks == ALL_FIVE and flagship.generate.thinking is True, name
        assert flagship.eval.serve_benchmarks is True, name
    twin = load_profile("flagship-twin")                  # offline: the two benchmarks that ship with the packages
    assert twin.eval.benchmarks == ("humaneval", "mt-bench") and twin.generate.thinking is True


@pytest.mark.parametrize("serve_benchmarks, expected", [(False, ()), (True, None)])
def test_the_served_check_decodes_the_benchmarks_only_where_the_profile_says(monkeypatch, tmp_path, serve_benchmarks,
                                                                            expected):
    """eval.serve_benchmarks off: the served check is asked for no benchmark (each would start every engine
    again); on: eval.benchmarks as the profile names them (None = the profile's own)."""
    import dflash.eval.eval_run
    import dflash.stages
    from dflash.stages import PipelineContext, _served

    asked: list[EvalOptions] = []

    def served_eval(profile, run_dir, options):
        asked.append(options)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dflash.stages, "_engine_ready", lambda *args, **kwargs: None)
    monkeypatch.setattr(dflash.eval.eval_run, "run_eval", served_eval)
    profile = with_eval(load_profile("cpu-demo"), serve_benchmarks=serve_benchmarks)
    with pytest.raises(RuntimeError, match="stop here"):
        _served(PipelineContext(profile, tmp_path), "vllm", "step-1")
    assert [(o.engine, o.checkpoint, o.benchmarks) for o in asked] == [("vllm", "step-1", expected)]


@pytest.mark.parametrize("profile_name, served", [("rtx6000-x8", "sglang"), ("cpu-demo", "vllm"), ("flagship-twin", "")])
def test_the_eval_stage_decodes_in_process_first_on_every_profile_then_serves_with_its_engine(
        monkeypatch, tmp_path, profile_name, served):
    """A GPU profile names its engine as eval.engine (rtx6000-x8: sglang): the pipeline's eval still writes the
    in-process report first, then runs the served check with that engine, and a failed gate keeps the in-process
    report (its last line says so); a profile without an engine decodes in-process only."""
    import dflash.eval.eval_run
    import dflash.stages
    from dflash.eval.options import EvalSummary
    from dflash.eval.report_schema import EvalReport, MethodFigures
    from dflash.stages import PipelineContext, _eval, served_engine
    from launcher_core.errors import ParityFailed

    asked: list[EvalOptions] = []

    def run_eval(profile, run_dir, options):
        asked.append(options)
        if options.engine != "transformers":
            raise ParityFailed("gate", ("deterministic prefix",), str(run_dir / "eval" / f"engine-{options.engine}.json"))
        return EvalSummary(EvalReport(8, 0.0, 2, {"target": MethodFigures(1.0, 10.0, 1.0, None),
                                                  "dflash": MethodFigures(1.5, 12.0, 1.2, True)}))

    monkeypatch.setattr(dflash.stages, "_engine_ready", lambda *args, **kwargs: None)
    monkeypatch.setattr(dflash.stages, "eval_checkpoint", lambda run_dir: ("step-1", "the last step"))
    monkeypatch.setattr(dflash.eval.eval_run, "run_eval", run_eval)
    profile = load_profile(profile_name)
    assert served_engine(profile) == served
    if not served:
        _eval(PipelineContext(profile, tmp_path))
        assert [o.engine for o in asked] == ["transformers"]
        return
    with pytest.raises(ParityFailed) as failed:
        _eval(PipelineContext(profile, tmp_path))
    assert [o.engine for o in asked] == ["transformers", served]
    assert str(failed.value).splitlines()[-1].startswith(
        f"pipeline: the in-process eval is done and kept ({tmp_path / 'eval' / 'report.md'}); the served check failed")


def link_checkpoint(run_dir: Path, checkpoint: Path) -> None:
    """The trained drafter as the run's latest checkpoint (what the train stage leaves)."""
    from dflash.drafter.checkpoint_files import LATEST, checkpoints_dir

    folder = checkpoints_dir(run_dir)
    folder.mkdir(parents=True)
    (folder / checkpoint.name).symlink_to(checkpoint.resolve(), target_is_directory=True)
    (folder / LATEST).write_text(f"{checkpoint.name}\n", encoding="utf-8")


@pytest.mark.slow
def test_the_pipelines_eval_stage_shows_a_lossless_row_per_benchmark_for_the_demo_drafter(demo_drafter, tmp_path,  # noqa: F811
                                                                                         capsys):
    """cpu-demo as shipped (its benchmarks, its drafter settings), a few samples: the real eval stage decodes two
    HumanEval and two MT-Bench samples (both turns) with the demo drafter beside the held-out sets, every turn
    lossless, and the pipeline's closing figures show each benchmark's row for DFlash and for prompt lookup."""
    from dflash.commands.pipeline import final_figures
    from dflash.stages import default_stages, run_pipeline
    from launcher_core.manifest import read_manifest

    run_dir = tmp_path / "run"
    link_checkpoint(run_dir, demo_drafter)
    profile = with_eval(load_profile("cpu-demo"), num_prompts=1, bench_samples=2, max_new_tokens=12, serve_engine="")
    [stage] = [stage for stage in default_stages() if stage.name == "eval"]
    [outcome] = run_pipeline(profile, run_dir=run_dir, stages=[stage])
    assert outcome.action == "ran" and "on 2 prompts, benchmark humaneval; also" in outcome.detail
    report = json.loads((run_dir / "eval" / "report.json").read_text(encoding="utf-8"))
    benchmarks = {b["benchmark"]: b for b in report["also_sets"] if "benchmark" in b}
    assert {name: b["num_prompts"] for name, b in benchmarks.items()} == {"humaneval": 2, "mt-bench": 4}
    for brief in benchmarks.values():
        for method in ("dflash", "prompt_lookup"):
            assert brief["methods"][method]["identical_to_target"] is True, (brief["benchmark"], method)
    entry = read_manifest(run_dir)["stages"]["eval"]
    assert entry["state"] == "done" and entry["bench_mt-bench_dflash_lossless"] is True

    lines = final_figures(profile, str(run_dir)).splitlines()
    start = lines.index("benchmarks (z-lab's prompts; in-process: every turn, served: first turns):")
    assert lines[start + 1].split()[:3] == ["benchmark", "decoded", "turns"]
    rows = [line.split() for line in lines[start + 2:start + 6]]
    for row, (name, turns, method) in zip(rows, [("humaneval", "2", "DFlash"), ("humaneval", "2", "prompt"),
                                                 ("mt-bench", "4", "DFlash"), ("mt-bench", "4", "prompt")]):
        assert row[:4] == [name, "in-process", turns, method]
        figures = benchmarks[name]["methods"]["dflash" if method == "DFlash" else "prompt_lookup"]
        tau = row[4] if method == "DFlash" else row[5]          # "prompt lookup" takes two words
        assert float(tau) == pytest.approx(figures["mean_tau"], abs=5e-4)
        assert "yes" in row and len(row) - row.index("yes") - 1 == 7     # acceptance at positions 1..7
    assert not any(line.startswith("tau on") and "benchmark" in line for line in lines)   # not twice
