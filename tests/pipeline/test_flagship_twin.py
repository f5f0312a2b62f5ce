"""The flagship workflow on its CPU twin, through the CLI a user runs: `launcher.py tokenize`,
`train`, `eval` with the `flagship-twin` profile (rtx6000-x8's drafter and loss policies on a tiny
random Qwen3.5/3.6-architecture target), then the checkpoint reloaded onto the target, and a
second training run continued from it (`drafter.init = "drafter"`).

The shipped profile computes the drafter in float32 where rtx6000-x8 gathers it in bf16 (a CPU without
bf16 instructions takes three times the CPU time in bf16: profiles/flagship-twin.toml); bf16 compute
on real ranks is tested on the tiny Qwen3 target (tests/train/test_torchrun.py).
Only the run directory and the sliding window differ from the shipped profile: the test's
variant extends a copy of flagship-twin (and of rtx6000-x8, which it extends), sets paths.run_dir
and shrinks rtx6000-x8's 2048-position window (SpecForge's Qwen3.6-27B recipe: four sliding layers,
then a full one) to 8, shorter than the twin's sequences, so that the window matters here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
WINDOW = 8
LAUNCHER = Path(__file__).resolve().parents[2] / "launcher.py"


def completions(count: int = 16) -> list[dict]:
    """Thinking-style conversations with a learnable answer (counting)."""
    return [{"id": f"count-{i}", "finish_reason": "stop", "messages": [
        {"role": "user", "content": f"Count from {i} to {i + 12}."},
        {"role": "assistant", "reasoning_content": f"The user wants the numbers {i} through {i + 12}, in order.",
         "content": " ".join(str(n) for n in range(i, i + 13))}]} for i in range(count)]


def launcher(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True, text=True, env=env,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def twin_run(tmp_path_factory):
    """tokenize -> train (2 gloo ranks, 4 steps, checkpoints at 2 and 4) -> eval, each a CLI process."""
    root = tmp_path_factory.mktemp("flagship-twin")
    profiles, run_dir = root / "profiles", root / "run"
    profiles.mkdir()
    run_dir.mkdir()
    for name in ("rtx6000-x8", "flagship-twin"):
        shutil.copy(PROFILES / f"{name}.toml", profiles / f"{name}.toml")
    profile = profiles / "twin-run.toml"
    profile.write_text(f'extends = "flagship-twin"\n[paths]\nrun_dir = "{run_dir}"\n[drafter]\nsliding_window = {WINDOW}\n',
                       encoding="utf-8")
    (run_dir / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in completions()), encoding="utf-8")
    steps = {}
    for stage, args in (("tokenize", ["--no-progress"]), ("train", []), ("eval", [])):
        steps[stage] = launcher(stage, "--profile", str(profile), *args)
        if steps[stage].returncode != 0:
            return run_dir, profile, steps
    continued = profiles / "twin-continued.toml"
    continued.write_text(f'extends = "twin-run"\n[paths]\nrun_dir = "{root / "continued"}"\ndataset = "{run_dir / "dataset"}"\n'
                         f'[drafter]\ninit = "drafter"\ninit_from = "{run_dir / "train" / "checkpoints"}"\n'
                         f'[train]\nmax_steps = 2\nsave_every_steps = 2\n', encoding="utf-8")
    steps["continue"] = launcher("train", "--profile", str(continued))
    return run_dir, profile, steps


def _ok(step: subprocess.CompletedProcess) -> None:
    assert step.returncode == 0, f"exit {step.returncode}\n{step.stdout[-4000:]}\n{step.stderr[-6000:]}"


def test_tokenize_writes_the_dataset_with_the_twins_tokenizer(twin_run):
    run_dir, _, steps = twin_run
    _ok(steps["tokenize"])
    assert "tokenized 16 records -> 16 samples" in steps["tokenize"].stdout
    assert (run_dir / "dataset").is_dir()


def test_train_runs_the_flagship_drafter_on_the_hybrid_target(twin_run):
    run_dir, _, steps = twin_run
    _ok(steps["train"])
    checkpoints = run_dir / "train" / "checkpoints"
    assert {p.name for p in checkpoints.glob("step-*")} == {"step-2", "step-4"}
    metrics = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4]


def test_eval_is_lossless_on_the_hybrid_target(twin_run):
    """The held-out prompts and the profile's benchmarks (flagship-twin: HumanEval and MT-Bench, 2 samples
    each, rendered with thinking on as rtx6000-x8's five are), every turn lossless."""
    run_dir, _, steps = twin_run
    _ok(steps["eval"])
    report = json.loads((run_dir / "eval" / "report.json").read_text(encoding="utf-8"))
    assert report["block_size"] == 16
    for method in ("dflash", "prompt_lookup"):
        assert report["methods"][method]["identical_to_target"] is True, method
    benchmarks = {b["benchmark"]: b for b in report["also_sets"] if "benchmark" in b}
    assert {name: b["num_prompts"] for name, b in benchmarks.items()} == {"humaneval": 2, "mt-bench": 4}
    for name, brief in benchmarks.items():
        for method in ("dflash", "prompt_lookup"):
            assert brief["methods"][method]["identical_to_target"] is True, (name, method)


def test_the_checkpoint_reloads_with_the_flagship_policies(twin_run):
    """The checkpoint is what the flagship would write: block 16, mask 248070, the default taps
    over the target's layers; reloaded onto the twin it drafts the block it was saved with."""
    import torch
    from safetensors.torch import load_file

    from dflash.drafter.checkpoint_files import WEIGHTS, latest_checkpoint, load_drafter
    from dflash.target_model import load_target, resolve_model_path
    from launcher_core.profile import load_profile

    run_dir, profile_path, steps = twin_run
    _ok(steps["train"])
    profile = load_profile(str(profile_path))
    target = load_target(resolve_model_path(profile.model.target))
    checkpoint = latest_checkpoint(run_dir)
    drafter = load_drafter(str(checkpoint), target)
    assert drafter.block_size == 16 and drafter.mask_token_id == 248070
    assert drafter.target_layer_ids == [1, 2, 3, 4, 5] and len(drafter.layers) == 5
    assert [(r.window, r.causal) for r in drafter.layer_rules] == [(WINDOW, True)] * 4 + [(None, False)]
    saved = load_file(str(checkpoint / WEIGHTS))
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, saved[name].to(value.dtype), rtol=0, atol=0)
    features = torch.randn(1, 7, len(drafter.target_layer_ids) * target.config.hidden_size)
    logits = drafter.draft_logits(features, anchor_id=785, anchor_pos=7)
    assert logits.shape == (16, target.config.vocab_size) and torch.isfinite(logits).all()


def test_the_flagship_checkpoint_loads_strictly_into_the_reference_with_the_same_logits(twin_run, tmp_path):
    """The flagship's drafter format (its own 32 x 128 / 8 KV attention on the twin's hidden size,
    block 16, mask 248070, five taps of a hybrid target) as the reference `DFlashDraftModel` reads it."""
    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.target_model import load_target, resolve_model_path
    from launcher_core.profile import load_profile
    from tests.train.reference_venv import compare_with_reference

    run_dir, profile_path, steps = twin_run
    _ok(steps["train"])
    target = load_target(resolve_model_path(load_profile(str(profile_path)).model.target))
    result = compare_with_reference(latest_checkpoint(run_dir), target, tmp_path, context=20, first_token=785)
    assert result.drafter.layer_rules[0].window == WINDOW < 20


def test_training_continues_from_the_twins_checkpoint(twin_run):
    """`drafter.init = "drafter"` from the first run's checkpoints: the second run trains on."""
    run_dir, _, steps = twin_run
    _ok(steps["continue"])
    continued = run_dir.parent / "continued"
    metrics = [json.loads(line) for line in (continued / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert (continued / "train" / "checkpoints" / "step-2" / "model.safetensors").exists()
