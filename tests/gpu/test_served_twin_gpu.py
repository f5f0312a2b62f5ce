"""The served check on the flagship's architecture (not yet run on a GPU): a drafter trained a few steps on the
flagship twin (`builtin:flagship-twin`, Gated DeltaNet + gated attention, on CPU ranks), then `eval --engine
sglang` with the target and drafter in bfloat16 on the GPU, through the parity gate (dflash/eval/parity.py): SGLang
is sent the in-process eval's token ids and its acceptance is held against the in-process decoding of the same
ids. The gate's near-tie margins are measured in float32 only, so in bfloat16 its verdict must be undecided (exit 6,
naming the dtype) with the lossless rule holding and no rule failing; tests/gpu/test_engine_eval_gpu.py holds the
gate to a pass in float32 on a tiny Qwen3 with either engine.
Skipped, saying why, without CUDA or without SGLang (requirements-cu130.txt pins 0.5.19)."""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_sglang_serves_the_twins_drafter_in_bf16_and_the_gate_says_it_cannot_decide_there(record, tmp_path, flagship_twin_target,
                                                                         tiny_dataset):
    import dataclasses
    import json
    from pathlib import Path

    import torch

    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.eval.eval_run import run_eval
    from dflash.eval.options import EvalOptions
    from dflash.train.supervisor.launch import run_training
    from launcher_core.errors import ParityFailed
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: SGLang serves on GPUs only")
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed in this environment (requirements-cu130.txt pins sglang 0.5.19)")
    profile = load_profile(str(write_profile(tmp_path / "p.toml", flagship_twin_target, tiny_dataset, tmp_path / "run",
                                             machine={"nproc_per_node": 1}, max_steps=4)))
    assert run_training(profile, run_dir=tmp_path / "run") == 0
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device="cuda"),
                                  model=dataclasses.replace(profile.model, dtype="bfloat16"))
    with pytest.raises(ParityFailed) as undecided:                  # bfloat16: the margins are measured in float32
        run_eval(profile, run_dir=tmp_path / "run",
                 options=EvalOptions(checkpoint=str(latest_checkpoint(tmp_path / "run")), num_prompts=4,
                                     max_new_tokens=32, engine="sglang"))
    assert undecided.value.rules == ("undecided",), str(undecided.value)
    gate = json.loads(Path(undecided.value.report).read_text(encoding="utf-8"))["parity"]["dflash"]
    record.figure(served_tau=gate["served_tau"], inprocess_tau=gate["inprocess_tau"],
                  prompts_same_acceptance=gate["prompts_same_acceptance"])
    assert gate["verdict"] == "undecided" and gate["failures"] == [] and gate["served_identical_to_target"] is True
    assert gate["undecided"][0].startswith("both sides decoded in bfloat16"), gate["undecided"]
