"""`eval --engine vllm` against the real engine: vLLM's CPU build (`launcher.py engine setup vllm`)
serving the demo target (SmolLM2-135M) with a drafter trained here for a few steps, `--enforce-eager`.

One eval run for the module (three engine starts: target, DFlash, prompt lookup; then the
in-process decoding of the same token ids). Skipped, with the reason, only where the engine's venv
cannot be built (no local CPU torch wheel, no package index)."""
from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest

from dflash.eval.records import read_report
from launcher_core.profile import load_profile
from tests.generate.gen_helpers import free_port
from tests.train.conftest import write_profile

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(3600)]   # training, in-process eval, 3 engine starts: ~5 min idle, 30 min on a loaded machine
NUM_PROMPTS = 6
MAX_NEW_TOKENS = 32
TRAIN_STEPS = 16


def target_greedy_rows(smollm2_dir: Path, count: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The target's own greedy answers to the eval prompts, as (tokens, loss mask) rows: a drafter trained on
    them for a few steps accepts some drafts (a drafter that accepts none would test little)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.eval.evaluate import encode_prompts
    from dflash.eval.options import eval_prompts_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    rows = []
    for prompt in encode_prompts(tokenizer, eval_prompts_path(load_profile("cpu-demo"), None), count, False):
        ids = torch.tensor([prompt.token_ids])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
        rows.append((out, [0] * len(prompt.token_ids) + [1] * (len(out) - len(prompt.token_ids))))
    return rows


@pytest.fixture(scope="module")
def smollm2_drafter(tmp_path_factory, smollm2_dir) -> Path:
    """The demo's drafter shape (3 layers from the target's layers 27-29, block 8, tap [26]) after a few steps."""
    from dflash.data.dataset_io import save_token_rows
    from dflash.drafter.checkpoint import latest_checkpoint
    from dflash.train.launch import run_training

    root = tmp_path_factory.mktemp("smollm2-drafter")
    data = save_token_rows(root / "data", target_greedy_rows(smollm2_dir, NUM_PROMPTS, MAX_NEW_TOKENS))
    profile = write_profile(root / "p.toml", smollm2_dir, data, root / "run",
                            machine={"nproc_per_node": 1}, max_steps=TRAIN_STEPS, save_every_steps=TRAIN_STEPS,
                            global_batch=2, num_anchors=16, lr=3e-3, decay_gamma=1.5,
                            drafter={"num_layers": 3, "block_size": 8, "mask_token_id": 16,
                                     "target_layer_ids": [26], "init": "target"})
    assert run_training(load_profile(str(profile)), run_dir=root / "run") == 0
    checkpoint = latest_checkpoint(root / "run")
    assert checkpoint is not None
    return checkpoint


@pytest.fixture(scope="module")
def engine_eval(vllm_python, smollm2_drafter, tmp_path_factory):
    from dflash.eval.engines import evaluate_with_engine
    from dflash.eval.evaluate import EvalOptions

    base = load_profile("cpu-demo")
    profile = dataclasses.replace(base, eval=dataclasses.replace(base.eval, engine_port=free_port(),
                                                                  num_prompts=NUM_PROMPTS, max_new_tokens=MAX_NEW_TOKENS),
                                  generate=dataclasses.replace(base.generate, vllm_enforce_eager=True))
    run_dir = tmp_path_factory.mktemp("engine-run")
    summary = evaluate_with_engine(profile, run_dir, smollm2_drafter, EvalOptions(), "vllm")
    return profile, run_dir, summary.report


def test_the_served_drafter_is_lossless_and_its_tau_equals_the_in_process_tau(engine_eval):
    from dflash.eval.parity import POSITION_TOLERANCE, TAU_TOLERANCE

    profile, run_dir, report = engine_eval
    dflash = report.parity["dflash"]
    assert report.num_prompts == NUM_PROMPTS
    assert report.methods["dflash"].identical_to_target is True
    assert dflash.served_identical_to_target is True and dflash.inprocess_identical_to_target is True
    assert dflash.served_tau is not None and dflash.inprocess_tau is not None
    assert abs(dflash.served_tau - dflash.inprocess_tau) <= TAU_TOLERANCE, dflash
    served, ours = dflash.served_position_acceptance or [], dflash.inprocess_position_acceptance or []
    # the engine drafts eval.draft_tokens (cpu-demo: 3) and reports those positions; in-process reports the
    # block's 7 slots, nothing accepted past the drafted ones
    drafted = profile.eval.draft_tokens or 7
    assert len(served) == drafted and len(ours) == 7 and not any(ours[drafted:]), (served, ours)
    assert all(abs(a - b) <= POSITION_TOLERANCE for a, b in zip(served, ours)), (served, ours)
    assert dflash.within_tolerance is True
    assert read_report(run_dir / "eval" / "engine-vllm.json") == report


def test_the_engine_decodes_the_same_tokens_as_the_in_process_target(engine_eval):
    _, _, report = engine_eval
    target = report.parity["target"]
    assert (report.methods["target"].new_tokens or 0) > NUM_PROMPTS * 4
    assert target.same_tokens_as_inprocess is True, target.first_divergence


def test_prompt_lookup_is_served_too(engine_eval):
    _, _, report = engine_eval
    lookup = report.methods["prompt_lookup"]
    assert lookup.mean_tau is not None and lookup.mean_tau >= 1.0
    assert lookup.identical_to_target is True
    assert '"method": "ngram"' in " ".join(lookup.argv or [])


def test_the_servers_bound_to_loopback_and_were_stopped(engine_eval):
    profile, run_dir, report = engine_eval
    port = profile.eval.engine_port
    for name, method in report.methods.items():
        argv = method.argv or []
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
        log = (run_dir / "eval" / "logs" / f"vllm-{name}.log").read_text()
        assert f"http://127.0.0.1:{port}" in log
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and f"--port\0{port}\0".encode() in _cmdline(pid)]


def test_the_served_drafter_is_the_vllm_export(engine_eval):
    _, run_dir, report = engine_eval
    exported = run_dir / "eval" / "engine-vllm-drafter"
    assert report.context.served_drafter == str(exported) and (exported / "config.json").exists()
    assert str(exported) in " ".join(report.methods["dflash"].argv or [])
    assert "Served vs in-process" in (run_dir / "eval" / "engine-vllm.md").read_text()


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
