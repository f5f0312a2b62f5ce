"""DFlash 2 on a GPU (unproven until a GPU machine runs it): a few steps of training through flex_attention
in bf16 with the selector's figures, then the same checkpoint served by vLLM (its V2 model runner, which
the launcher asks for: VLLM_USE_V2_MODEL_RUNNER=1) and by SGLang (>= 0.5.19), engine tau beside the
in-process tau of the selector's path, lossless greedy. vLLM's CPU build cannot serve DFlash 2
(tests/eval/test_engine_vllm_dflash2.py shows both refusals); this is the path that can."""
from __future__ import annotations

import importlib.util
import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
DFLASH2 = {"num_layers": 2, "target_layer_ids": [1, 2], "kind": "dflash2", "conv_group_size": 16,
           "selector_rank": 16, "selector_top_k": 8}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    import json

    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.train.supervisor.launch import run_training
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    root = tmp_path_factory.mktemp("dflash2-gpu")
    profile = load_profile(str(write_profile(root / "p.toml", tiny_qwen3_target, tiny_dataset, root / "run",
                                             machine={"nproc_per_node": 1, "device": "cuda", "backend": "nccl",
                                                      "gpu_count": 1},
                                             max_steps=8, save_every_steps=8, drafter=DFLASH2)))
    assert run_training(profile, run_dir=root / "run") == 0
    lines = [json.loads(line) for line in (root / "run" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(line["loss"]) and "selector" in line for line in lines)
    return profile, root / "run", latest_checkpoint(root / "run")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_engine_serves_the_selector_path_losslessly(engine, trained):
    import dataclasses

    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions

    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed in this environment")
    profile, run_dir, checkpoint = trained
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device="cuda"))
    options = dict(checkpoint=str(checkpoint), num_prompts=4, max_new_tokens=32)
    in_process = run_eval(profile, run_dir=run_dir, options=EvalOptions(**options, engine="transformers"))
    served = run_eval(profile, run_dir=run_dir, options=EvalOptions(**options, engine=engine))
    tau = served.report.methods["dflash"].mean_tau
    assert tau is not None and 1.0 <= tau <= profile.drafter.block_size
    assert in_process.report.methods["dflash"].identical_to_target and served.report.methods["dflash"].identical_to_target
    print(f"{engine}: engine tau {tau:.2f}, in-process selector tau {in_process.report.methods['dflash'].mean_tau or 0:.2f}, "
          f"unary {in_process.report.methods['dflash_unary'].mean_tau or 0:.2f}")
