"""Pipeline stage skipping and resume, on tiny stand-in stages that write real files and manifests.

The real stages are the other commands' entry points (tested in their own suites); what is under
test here is the order, the skip rule (done + outputs exist + inputs not newer), resume after a
failure, --redo / --stop-after, and the run-dir override reaching every stage's paths.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash.stages import (
    PipelineContext,
    Stage,
    default_stages,
    redo_from,
    run_pipeline,
    run_stages,
    select_stages,
    train_mode,
    with_run_dir,
)
from launcher_core.errors import ConfigError
from launcher_core.manifest import read_manifest, update_stage
from launcher_core.profile import expand_path, load_profile


class Recorder:
    """Stand-in stages: each writes its output file (content derived from its input) and marks done."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.calls: list[str] = []
        self.fail: set[str] = set()
        self.clock = 1_000_000.0

    def file(self, name: str) -> Path:
        return self.run_dir / name

    def make(self, name: str, output: str | None, source: str | None, always: bool = False) -> Stage:
        def run(ctx: PipelineContext) -> str:
            self.calls.append(name)
            if name in self.fail:
                update_stage(ctx.run_dir, name, "failed")
                raise RuntimeError(f"{name} broke")
            if output and not (always and self.file(output).exists()):   # generate resumes: nothing new
                text = self.file(source).read_text() + f"+{name}" if source else name
                self.file(output).write_text(text)
                self.clock += 10
                os.utime(self.file(output), (self.clock, self.clock))
            update_stage(ctx.run_dir, name, "done")
            return f"{name} ok"

        outputs = (lambda ctx: [self.file(output)]) if output else (lambda ctx: [])
        inputs = (lambda ctx: [self.file(source)]) if source else (lambda ctx: [])
        return Stage(name, run, outputs=outputs, inputs=inputs, always_run=always)

    def stages(self) -> list[Stage]:
        return [self.make("audit", None, None, always=True), self.make("generate", "completions", None, always=True),
                self.make("tokenize", "dataset", "completions"), self.make("train", "latest", "dataset"),
                self.make("eval", "report", "latest")]


@pytest.fixture
def recorder(tmp_path) -> Recorder:
    tmp_path.mkdir(exist_ok=True)
    return Recorder(tmp_path)


def context(run_dir: Path, redo: frozenset = frozenset()) -> PipelineContext:
    return PipelineContext(load_profile("cpu-demo"), run_dir, redo=redo)


def test_first_run_runs_everything_in_order_and_records_wall_time(recorder):
    outcomes = run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    assert recorder.calls == ["audit", "generate", "tokenize", "train", "eval"]
    assert [o.action for o in outcomes] == ["ran"] * 5
    assert recorder.file("report").read_text() == "generate+tokenize+train+eval"
    stages = read_manifest(recorder.run_dir)["stages"]
    assert all(stages[name]["state"] == "done" and "pipeline_wall_s" in stages[name] for name in stages)


def test_rerun_skips_finished_stages(recorder):
    run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    recorder.calls.clear()
    outcomes = run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    assert recorder.calls == ["audit", "generate"]          # these resume by themselves, always called
    assert [o.action for o in outcomes] == ["ran", "ran", "skipped", "skipped", "skipped"]


def test_changed_input_reruns_that_stage_and_everything_after(recorder):
    run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    recorder.calls.clear()
    later = recorder.clock + 5                                # new completions, newer than the dataset
    recorder.file("completions").write_text("more")
    os.utime(recorder.file("completions"), (later, later))
    stages = [s for s in recorder.stages() if s.name not in ("audit", "generate")]
    run_stages(stages, context(recorder.run_dir), report=lambda line: None)
    assert recorder.calls == ["tokenize", "train", "eval"]
    assert recorder.file("report").read_text() == "more+tokenize+train+eval"


def test_failed_stage_stops_the_pipeline_and_the_rerun_resumes_there(recorder):
    recorder.fail = {"train"}
    with pytest.raises(RuntimeError, match="train broke"):
        run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    assert recorder.calls == ["audit", "generate", "tokenize", "train"]
    assert not recorder.file("report").exists()
    recorder.fail, recorder.calls = set(), []
    run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    assert recorder.calls == ["audit", "generate", "train", "eval"]


def test_missing_output_reruns_a_done_stage(recorder):
    run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    recorder.calls.clear()
    recorder.file("report").unlink()
    run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    assert recorder.calls == ["audit", "generate", "eval"]


def test_redo_reruns_from_that_stage(recorder):
    run_stages(recorder.stages(), context(recorder.run_dir), report=lambda line: None)
    recorder.calls.clear()
    run_stages(recorder.stages(), context(recorder.run_dir, redo=redo_from("train")), report=lambda line: None)
    assert recorder.calls == ["audit", "generate", "train", "eval"]


def test_stop_after_and_bad_stage_names():
    names = [s.name for s in select_stages(default_stages(), "tokenize")]
    assert names == ["audit", "generate", "tokenize"]
    with pytest.raises(ConfigError, match="valid stages are audit, generate"):
        select_stages(default_stages(), "merge")
    with pytest.raises(ConfigError, match="--redo 'bogus'"):
        redo_from("bogus")
    assert redo_from("tokenize") == {"tokenize", "train", "eval"}


def test_the_stage_list_is_the_manifests_everywhere():
    """One stage list (launcher_core.manifest.STAGES): the pipeline runs it in that order, and
    `pipeline --redo/--stop-after` offer exactly those names."""
    import argparse

    from dflash.commands.pipeline import add_arguments
    from launcher_core.manifest import STAGES

    assert [stage.name for stage in default_stages()] == list(STAGES)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    choices = {action.dest: action.choices for action in parser._actions if action.choices}
    assert choices == {"redo": STAGES, "stop_after": STAGES}


@pytest.mark.parametrize("state,has_checkpoint,redo,expected", [
    (None, False, False, (False, False)),        # fresh run
    ("running", True, False, (True, False)),     # interrupted: continue from the checkpoint
    ("pending", True, False, (True, False)),     # stopped by SIGTERM
    ("done", True, False, (False, True)),        # finished but its dataset changed: start over
    ("running", True, True, (False, True)),      # --redo train
])
def test_train_mode(state, has_checkpoint, redo, expected):
    assert train_mode(state, has_checkpoint, redo) == expected


def test_run_dir_override_reaches_every_stage_path(tmp_path):
    profile = with_run_dir(load_profile("cpu-demo"), tmp_path / "elsewhere")
    root = (tmp_path / "elsewhere").resolve()
    assert expand_path(profile, profile.paths.run_dir) == root
    assert expand_path(profile, profile.paths.completions) == root / "completions.jsonl"
    assert expand_path(profile, profile.paths.dataset) == root / "dataset"


def test_run_pipeline_uses_the_given_stages_and_run_dir(recorder):
    outcomes = run_pipeline(load_profile("cpu-demo"), run_dir=recorder.run_dir, stop_after="tokenize",
                            stages=recorder.stages())
    assert [o.name for o in outcomes] == ["audit", "generate", "tokenize"]
    assert set(read_manifest(recorder.run_dir)["stages"]) == {"audit", "generate", "tokenize"}


def test_a_missing_also_prompts_file_stops_the_pipeline_before_the_first_stage(recorder):
    import dataclasses

    from launcher_core.errors import InputError

    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, also_prompts=("no/such/set.jsonl",)))
    with pytest.raises(InputError, match=r"eval.also_prompts: no such prompts file: .*no/such/set.jsonl"):
        run_pipeline(profile, run_dir=recorder.run_dir, stages=recorder.stages())
    assert recorder.calls == []
    assert [o.name for o in run_pipeline(profile, run_dir=recorder.run_dir, stop_after="train",
                                         stages=recorder.stages())] == ["audit", "generate", "tokenize", "train"]


@pytest.mark.parametrize("backend, engine_python, builds", [
    ("vllm", "", True),                    # cpu-demo as shipped: the engine's venv is built before generating
    ("transformers", "", False),           # transformers serve runs from .venv: nothing to build
    ("vllm", "/opt/my-vllm/bin/python", False),   # the user's own vLLM python (eval.engine_python)
])
def test_the_generate_stage_builds_vllms_venv_first_where_it_generates_with_vllm(tmp_path, monkeypatch, backend,
                                                                                  engine_python, builds):
    import dataclasses

    import dflash.generate
    import dflash.generate.engine_env
    from dflash.generate.generation_run import GenerateSummary
    from dflash.stages import _generate

    calls: list[str] = []
    monkeypatch.setattr(dflash.generate.engine_env, "setup_engine_env", lambda engine: calls.append(f"setup {engine}"))
    monkeypatch.setattr(dflash.generate, "generate_from_profile",
                        lambda profile, run_dir: calls.append(f"generate {profile.generate.backend}")
                        or GenerateSummary(total=2, selected=2, already_done=0))
    base = load_profile("cpu-demo")
    assert base.generate.backend == "vllm"
    profile = dataclasses.replace(base, generate=dataclasses.replace(base.generate, backend=backend),
                                  eval=dataclasses.replace(base.eval, engine_python=engine_python))
    assert _generate(PipelineContext(profile, tmp_path)) == "2 prompts sent, 0 done before"
    assert calls == ([f"setup {backend}"] if builds else []) + [f"generate {backend}"]


@pytest.mark.parametrize("engine, serves_drafter, engine_python, here_serves, builds", [
    ("sglang", True, "", False, True),       # rtx6000-x8 as shipped: the cu128 set's SGLang has no DFLASH: its own venv
    ("sglang", True, "", True, False),       # b200-x8: this environment's SGLang 0.5.19 serves the drafter
    ("sglang", True, "/envs/cu130/bin/python", False, False),    # the user's own (eval.engine_python)
    ("sglang", False, "", False, False),     # generation: any SGLang generates, from this environment
    ("vllm", True, "", True, True),          # vLLM always runs from its own venv
    ("transformers", True, "", False, False)])
def test_serving_the_drafter_builds_the_engines_own_venv_where_this_environment_cannot(monkeypatch, engine, serves_drafter,
                                                                                        engine_python, here_serves, builds):
    import dataclasses

    import dflash.generate.engine_env
    import dflash.stages

    calls: list[str] = []
    monkeypatch.setattr(dflash.generate.engine_env, "setup_engine_env", lambda engine: calls.append(engine))
    monkeypatch.setattr(dflash.stages, "sglang_here_serves", lambda profile: here_serves)
    base = load_profile("rtx6000-x8")
    profile = dataclasses.replace(base, eval=dataclasses.replace(base.eval, engine_python=engine_python))
    dflash.stages._engine_ready(profile, engine, serves_drafter=serves_drafter)
    assert calls == ([engine] if builds else [])


@pytest.mark.parametrize("installed, serves", [(None, False), ("0.5.10.post1", False), ("0.5.13", False), ("0.5.19", True)])
def test_this_environments_sglang_serves_the_flagship_drafter_from_0_5_14(monkeypatch, installed, serves):
    import importlib.metadata

    from dflash.stages import sglang_here_serves

    def version(name: str) -> str:
        if name != "sglang" or installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert sglang_here_serves(load_profile("rtx6000-x8")) is serves


def test_missing_benchmark_data_stops_the_pipeline_before_the_first_stage(recorder, tmp_path, monkeypatch):
    import dataclasses

    from launcher_core.errors import InputError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, benchmarks=("humaneval", "mbpp"),
                                                                    bench_dir=str(tmp_path)))
    with pytest.raises(InputError, match=r"benchmark mbpp: dataset google-research-datasets/mbpp \(sanitized\), split test"):
        run_pipeline(profile, run_dir=recorder.run_dir, stages=recorder.stages())
    assert recorder.calls == []
