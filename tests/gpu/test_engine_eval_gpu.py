"""On a GPU machine with SGLang (requirements-cu130.txt: 0.5.19) or vLLM installed: `eval --engine` of a
drafter trained like the CPU twin's (tiny Qwen3 target, a few steps), through the parity gate
(dflash/eval/parity.py): the engine is sent the in-process eval's token ids (SGLang: `input_ids` to
`/generate`), its per-request acceptance is held against the in-process decoding of the same ids,
and the gate must pass. The SGLang gate is proven only here: on CPU it runs against a stand-in
(tests/eval/test_engine_eval.py) and against SGLang's code shapes, not SGLang itself. A drafter
with the flagship's layer pattern (4 sliding-window layers + 1 full) is served too: SGLang runs
its sliding layers causally with their window from 0.5.14, vLLM mixes them on its V2 model runner.
SGLang also serves from its own venv (`launcher.py engine setup sglang`, with eval.engine_python unset,
as rtx6000-x8 ships), which these tests do not build unless DFLASH_GPU_SGLANG_SETUP=1 (it needs
pypi.nvidia.com and flashinfer.ai besides PyPI). Skipped, saying why, without CUDA or without the engine."""
from __future__ import annotations

import importlib.util
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
SLIDING = {"layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 16, "num_layers": 5}


def _require(engine: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the serving engines run on GPUs only")
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed in this environment (requirements-cu130.txt pins sglang 0.5.19)")


@pytest.mark.parametrize("layers", [{}, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_served_drafter_passes_the_parity_gate(engine, layers, tmp_path, tiny_qwen3_target, tiny_dataset):
    import dataclasses

    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions
    from dflash.train.supervisor.launch import run_training
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    _require(engine)
    drafter = {"num_layers": layers.get("num_layers", 1), **{k: v for k, v in layers.items() if k != "num_layers"}}
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "run",
                                             machine={"nproc_per_node": 1}, max_steps=8, drafter=drafter)))
    assert run_training(profile, run_dir=tmp_path / "run") == 0
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device="cuda"))
    checkpoint = str(latest_checkpoint(tmp_path / "run"))
    served = run_eval(profile, run_dir=tmp_path / "run",            # ParityFailed (exit 6) if the gate fails
                      options=EvalOptions(checkpoint=checkpoint, num_prompts=4, max_new_tokens=32, engine=engine))
    gate = served.report.parity["dflash"]
    assert gate.within_tolerance is True and gate.failures == [], gate
    assert gate.served_identical_to_target is True and gate.prompts_same_tokens is not None
    print(f"{engine} ({'sliding' if layers else 'full'}): served tau {gate.served_tau}, in-process "
          f"{gate.inprocess_tau}, steps {gate.served_steps}/{gate.inprocess_steps}, prompts with equal acceptance "
          f"{gate.prompts_same_acceptance} of {gate.prompts_same_tokens}, {gate.steps_before_near_tie} steps compared "
          f"one by one before a near-tie")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_each_verify_step_s_acceptance_is_read_from_the_engine(engine, tmp_path, tiny_qwen3_target):
    """SGLang: from its stream (one chunk per verify step, running spec counters); vLLM: from its per-request
    metrics. The per-step figures must add up to the request's totals. Unproven until run on a GPU."""
    import dataclasses
    import json

    from dflash.eval.engines import EngineSettings, run_engines
    from launcher_core.profile import load_profile

    _require(engine)
    base = load_profile("cpu-demo")
    profile = dataclasses.replace(base, machine=dataclasses.replace(base.machine, device="cuda"),
                                  model=dataclasses.replace(base.model, target=str(tiny_qwen3_target)),
                                  eval=dataclasses.replace(base.eval, engine_python=sys.executable))
    settings = EngineSettings(max_new_tokens=24, temperature=0.0, seed=0, thinking=False, request_timeout_s=300,
                              block_size=4)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
    run = run_engines(engine, profile, tiny_qwen3_target, tiny_qwen3_target, 4, prompts, settings, tmp_path / "logs",
                      methods=("prompt_lookup",))["prompt_lookup"]
    for prompt in run.prompts:
        print(engine, json.dumps({"steps": prompt.steps, "accepted": prompt.accepted, "per_step": prompt.per_step}))
        assert prompt.per_step is not None and len(prompt.per_step) == prompt.steps
        assert sum(prompt.per_step) == prompt.accepted


def _sglang_venv_python():
    """The python of SGLang's own venv (`launcher.py engine setup sglang`): built here with DFLASH_GPU_SGLANG_SETUP=1,
    else the one already built, else the test is skipped saying how to build it."""
    import os

    from dflash.generate.engine_env import setup_engine_env
    from envcheck.engine_venvs import built_engine_python

    if os.environ.get("DFLASH_GPU_SGLANG_SETUP") == "1":
        return setup_engine_env("sglang", echo=print).python
    python = built_engine_python("sglang")
    if python is None:
        pytest.skip("SGLang's own venv is not built: run `launcher.py engine setup sglang` first (about 6.5 GB from "
                    "PyPI, pypi.nvidia.com and flashinfer.ai), or set DFLASH_GPU_SGLANG_SETUP=1")
    return python


def test_sglang_serves_the_drafter_from_its_own_venv(tmp_path, tiny_qwen3_target, tiny_dataset):
    """`launcher.py engine setup sglang`, then `eval --engine sglang` with eval.engine_python unset, as rtx6000-x8
    ships: the server starts from that venv (SGLang 0.5.19 on the CUDA 13.0 torch; the driver must run CUDA 13.0),
    serves a drafter with the flagship's layer pattern, and the parity gate passes. UNPROVEN until run on a GPU node."""
    import dataclasses

    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.eval.engines import check_engine_installed
    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions
    from dflash.generate.vllm_server import engine_python
    from dflash.train.supervisor.launch import run_training
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    python = _sglang_venv_python()
    drafter = dict(SLIDING)
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "run",
                                             machine={"nproc_per_node": 1}, max_steps=8, drafter=drafter)))
    assert run_training(profile, run_dir=tmp_path / "run") == 0
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device="cuda"),
                                  eval=dataclasses.replace(profile.eval, engine_python=""))
    assert engine_python(profile, "sglang") == str(python) and check_engine_installed("sglang", profile) == "0.5.19"
    served = run_eval(profile, run_dir=tmp_path / "run",            # ParityFailed (exit 6) if the gate fails
                      options=EvalOptions(checkpoint=str(latest_checkpoint(tmp_path / "run")), num_prompts=4,
                                          max_new_tokens=32, engine="sglang"))
    gate = served.report.parity["dflash"]
    assert gate.within_tolerance is True and gate.failures == [], gate
    print(f"sglang from {python}: served tau {gate.served_tau}, in-process {gate.inprocess_tau}")
