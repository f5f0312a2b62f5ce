"""On a GPU machine with SGLang (>= 0.5.11) or vLLM installed: the engine eval of a drafter trained
like the CPU twin's (tiny Qwen3 target, a few steps), engine-reported tau next to the in-process
tau of the same checkpoint. Skipped, saying why, without CUDA or without the engine."""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _require(engine: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the serving engines run on GPUs only")
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed in this environment (requirements-cu130.txt pins sglang 0.5.11)")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_reports_tau_for_the_cpu_twins_checkpoint(engine, tmp_path, tiny_qwen3_target, tiny_dataset):
    import dataclasses

    from dflash.drafter.checkpoint import latest_checkpoint
    from dflash.eval.options import EvalOptions
    from dflash.eval.run import run_eval
    from dflash.train.launch import run_training
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    _require(engine)
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "run",
                                             machine={"nproc_per_node": 1}, max_steps=8)))
    assert run_training(profile, run_dir=tmp_path / "run") == 0
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device="cuda"))
    checkpoint = str(latest_checkpoint(tmp_path / "run"))
    options = dict(checkpoint=checkpoint, num_prompts=4, max_new_tokens=32)
    in_process = run_eval(profile, run_dir=tmp_path / "run", options=EvalOptions(**options, engine="transformers"))
    served = run_eval(profile, run_dir=tmp_path / "run", options=EvalOptions(**options, engine=engine))
    tau = served.report.methods["dflash"].mean_tau
    assert tau is not None and 1.0 <= tau <= profile.drafter.block_size
    print(f"{engine}: engine tau {tau:.2f}, in-process tau {in_process.report.methods['dflash'].mean_tau or 0:.2f}")
