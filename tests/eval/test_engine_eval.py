"""`eval --engine sglang|vllm` without a real engine: SGLang's argv against the pinned SGLang's own
option list, its `/generate` requests and answers against the shapes its code declares (both from
its wheel, tests/fixtures/engines/), its flow against a stand-in that decodes with our decoder
behind that API (tests/eval/engine_standin.py; SGLang needs CUDA, so the SGLang gate is unproven
until tests/gpu/test_engine_eval_gpu.py runs it on a GPU); vLLM's argv builders (the real vLLM CPU
engine runs in tests/eval/test_engine_vllm.py), the install check and the parity gate's rules."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dflash.eval.engines import engine_command
from dflash.eval.parity import (
    PromptAcceptance,
    SideFigures,
    check_parity,
    histogram_of_positions,
    histogram_of_taus,
    method_parity,
    parity_summary,
)
from dflash.generate.servers import is_hybrid_target, sglang_server_command
from launcher_core.errors import EXIT_PARITY, ParityFailed
from launcher_core.profile import load_profile
from tests.generate.gen_helpers import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
STANDIN = Path(__file__).resolve().parent / "engine_standin.py"
PINNED_SGLANG = "0.5.19"


def sglang_options(version: str) -> tuple[set[str], str]:
    lines = (FIXTURES / f"sglang-{version}-flags.txt").read_text().splitlines()
    return {line for line in lines if line.startswith("--")}, "\n".join(line for line in lines if line.startswith("#"))


def hybrid_target(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}))
    return tmp_path


@pytest.mark.parametrize("method", ["target", "dflash", "prompt_lookup"])
def test_sglang_engine_argv_uses_only_options_of_the_pinned_sglang(method, tmp_path):
    profile = load_profile("rtx6000-x8")
    command = engine_command("sglang", profile, hybrid_target(tmp_path), method, Path("/ckpt"), 16, 30100)
    options, header = sglang_options(PINNED_SGLANG)
    flags = [arg for arg in command.argv if arg.startswith("--")]
    assert set(flags) <= options, set(flags) - options
    argv = command.argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer" and '"extra_buffer"' in header
    assert argv[argv.index("--context-length") + 1] == "32768"
    if method == "dflash":
        assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH" and '"DFLASH"' in header
        assert argv[argv.index("--speculative-draft-model-path") + 1] == "/ckpt"
        assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "16"
    elif method == "prompt_lookup":
        assert argv[argv.index("--speculative-algorithm") + 1] == "NGRAM"
    else:
        assert "--speculative-algorithm" not in argv


def test_the_cu130_set_pins_an_sglang_that_runs_our_layers_and_the_cu128_set_cannot():
    _, header = sglang_options("0.5.10.post1")
    assert '"DFLASH"' not in header
    cu128, cu130 = Path("requirements-cu128.txt").read_text(), Path("requirements-cu130.txt").read_text()
    assert "sglang==0.5.10.post1" in cu128 and f"sglang=={PINNED_SGLANG}" in cu130
    assert load_profile("rtx6000-x8").eval.engine == "sglang"


@pytest.mark.parametrize("version", ["0.5.10.post1", PINNED_SGLANG])
def test_generate_passes_context_length_and_the_hybrid_strategy_to_both_pinned_sglangs(version, tmp_path):
    options, _ = sglang_options(version)
    profile = load_profile("rtx6000-x8")
    argv = sglang_server_command(profile, hybrid_target(tmp_path)).argv
    assert {a for a in argv if a.startswith("--")} <= options
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    assert argv[argv.index("--context-length") + 1] == "32768"
    assert is_hybrid_target(tmp_path) and not is_hybrid_target(tmp_path / "missing")


def test_vllm_argv_carries_the_dflash_speculative_config():
    profile = load_profile("rtx6000-x8")
    command = engine_command("vllm", profile, Path("/t"), "dflash", Path("/ckpt"), 16, 30100)
    argv = command.argv
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "dflash", "model": "/ckpt", "num_speculative_tokens": 15}
    assert argv[argv.index("--served-model-name") + 1] == "default"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85" and "VLLM_CPU_KVCACHE_SPACE" not in command.env


@pytest.mark.parametrize("layer_types, v2", [(["sliding_attention"] * 4 + ["full_attention"], True),
                                             (["sliding_attention"] * 2, False), (["full_attention"] * 2, False)])
def test_vllm_gets_its_v2_model_runner_for_a_drafter_mixing_sliding_and_full_layers(layer_types, v2, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"layer_types": layer_types}))
    profile = load_profile("cpu-demo")
    command = engine_command("vllm", profile, Path("/t"), "dflash", tmp_path, 8, 30100)
    assert (command.env.get("VLLM_USE_V2_MODEL_RUNNER") == "1") is v2
    assert "VLLM_USE_V2_MODEL_RUNNER" not in engine_command("vllm", profile, Path("/t"), "target", tmp_path, 8, 1).env


def test_vllm_on_cpu_sizes_the_kv_cache_in_gib_instead_of_a_gpu_memory_share():
    profile = load_profile("cpu-demo")
    command = engine_command("vllm", profile, Path("/t"), "target", Path("/ckpt"), 8, 30100)
    assert "--gpu-memory-utilization" not in command.argv
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == str(profile.generate.vllm_cpu_kvcache_gib) == "2"
    assert command.argv[command.argv.index("--max-model-len") + 1] == "1024"
    assert "--enforce-eager" in command.argv and command.argv[command.argv.index("--host") + 1] == "127.0.0.1"
    assert profile.eval.serve_engine == "vllm"


def test_vllm_on_cpu_runs_the_model_in_its_engine_process_on_evals_threads():
    """No worker process beside a spinning engine process (vllm_server.CPU_ONE_PROCESS); the served
    side decodes on eval.cpu_threads, as the in-process side does, and prompt lookup's numba pool has no
    idle thread (vllm_server.CPU_NUMBA_THREADS). A GPU profile keeps vLLM's layout."""
    profile = load_profile("cpu-demo")
    command = engine_command("vllm", profile, Path("/t"), "dflash", Path("/ckpt"), 8, 30100)
    assert command.argv[command.argv.index("--distributed-executor-backend") + 1] == "uni"
    assert command.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert command.env["OMP_NUM_THREADS"] == str(profile.eval.cpu_threads) == "1"
    assert engine_command("vllm", profile, Path("/t"), "prompt_lookup", Path("/ckpt"), 8, 30100).env["NUMBA_NUM_THREADS"] == "1"
    on_gpu = load_profile("h200-x1")
    command = engine_command("vllm", on_gpu, Path("/t"), "dflash", Path("/ckpt"), 8, 30100)
    assert "--distributed-executor-backend" not in command.argv
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in command.env and "OMP_NUM_THREADS" not in command.env
    assert "NUMBA_NUM_THREADS" not in command.env


@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu"])
def test_the_install_check_accepts_either_vllm_distribution_name(distribution, tmp_path):
    from dflash.eval.engines import check_engine_installed

    site = tmp_path / "site"
    (site / f"{distribution.replace('-', '_')}-0.32.0.dist-info").mkdir(parents=True)
    (site / f"{distribution.replace('-', '_')}-0.32.0.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.32.0\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_python=str(python)))
    assert check_engine_installed("vllm", profile) == "0.32.0"


def test_the_install_check_names_the_setup_command_when_vllm_is_absent(tmp_path):
    from dflash.eval.engines import check_engine_installed
    from launcher_core.errors import ConfigError

    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_python=sys.executable))
    with pytest.raises(ConfigError, match="vllm / vllm-cpu is not installed.*engine setup vllm"):
        check_engine_installed("vllm", profile)


def test_an_sglang_release_that_would_run_the_layers_otherwise_is_refused_before_anything_is_decoded(tmp_path):
    from dflash.eval.engines import check_engine_serves
    from launcher_core.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 5, "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048}))
    profile = load_profile("rtx6000-x8")
    with pytest.raises(ConfigError, match=r"SGLang 0\.5\.11 would not serve this drafter as it was trained: layer 0 "
                                          r"\(sliding_attention\): trained causal, window 2048, served bidirectional"):
        check_engine_serves("sglang", "0.5.11", profile, tmp_path)
    check_engine_serves("sglang", PINNED_SGLANG, profile, tmp_path)


def test_a_dflash2_drafter_is_refused_on_an_sglang_before_0_5_19(tmp_path):
    from dflash.eval.engines import check_engine_serves
    from launcher_core.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"], "num_hidden_layers": 2}))
    profile = load_profile("rtx6000-x8")
    with pytest.raises(ConfigError, match=r"SGLang 0\.5\.18 would not serve this drafter as it was trained: a DFlash 2 "
                                          r"drafter \(DFlash2DraftModel\), which SGLang serves from 0\.5\.19 on"):
        check_engine_serves("sglang", "0.5.18", profile, tmp_path)
    check_engine_serves("sglang", PINNED_SGLANG, profile, tmp_path)
    check_engine_serves("sglang", None, profile, tmp_path)         # a stand-in: no release to hold it against


# -- the parity gate's rules -----------------------------------------------------------------------

def side(per_prompt: list[tuple], histogram: list[int], lossless: bool = True) -> SideFigures:
    """Per prompt (tokens, steps, accepted[, near-tie steps measured in-process])."""
    return SideFigures([PromptAcceptance(*entry) for entry in per_prompt], histogram, [0.1] * 3, lossless)


WEAK = side([([1, 2, 3, 4, 5, 6], 20, 2), ([7, 8, 9], 20, 1)], [37, 3])          # tau 1.075: a weak trained drafter
BLOCK = 4                                                                          # the drafter's B in these rows
DEAD = side([([1, 2, 3, 4, 5, 6], 20, 0), ([7, 8, 9, 10], 20, 0)], [40])         # accepts nothing, other tokens


def test_a_served_drafter_that_accepts_nothing_fails_the_gate_where_a_fixed_tau_tolerance_passed_it():
    row = method_parity("dflash", DEAD, WEAK, ["a", "b"], block_size=BLOCK)
    assert abs((row.served_tau or 0) - (row.inprocess_tau or 0)) < 0.10        # the old gate's 0.10: a pass
    assert row.within_tolerance is False
    assert any("served gain (tau - 1) 0.000 is below 0.9 x the in-process gain 0.075" in f for f in row.failures or [])
    with pytest.raises(ParityFailed, match="the served drafter is not the trained one: dflash: served gain") as failed:
        check_parity({"dflash": row}, "report.json")
    assert failed.value.exit_code == EXIT_PARITY == 6


def test_a_served_drafter_within_the_gain_tolerance_passes_and_the_tolerance_grows_with_its_standard_error():
    ours = side([([1, 2, 3], 10, 12), ([4, 5], 10, 8)], [6, 8, 6])                   # tau 2.0
    close = side([([1, 2, 3], 10, 12), ([4, 5, 6], 10, 7)], [6, 9, 5])               # tau 1.95, prompt 2 diverged
    row = method_parity("dflash", close, ours, ["a", "b"], block_size=BLOCK)
    assert row.within_tolerance is True and row.failures == [] and row.conclusive is True, row.failures
    assert row.tolerance == pytest.approx(3 * (row.standard_error or 0)) and row.tolerance > 0.10 * 1.0
    assert (row.prompts_same_tokens, row.prompts_same_acceptance) == (1, 1)
    check_parity({"dflash": row}, "report.json")
    lower = side([([1, 2, 9], 10, 6), ([4, 5, 6], 10, 6)], [10, 8, 2])               # tau 1.6: inside 3 SE,
    assert [f[:46] for f in method_parity("dflash", lower, ours, ["a", "b"], block_size=BLOCK).failures or []] == [  # 60%
        "served gain (tau - 1) 0.600 is below 0.9 x the"]
    higher = side([([1, 2, 9], 10, 22), ([4, 5, 6], 10, 22)], [0, 2, 14, 4])         # tau 3.2: more than trained
    assert [f[:52] for f in method_parity("dflash", higher, ours, ["a", "b"], block_size=BLOCK).failures or []] == [
        "served tau 3.200 vs in-process 2.000: they differ by"]


def test_a_served_stream_that_is_not_lossless_fails_naming_where_it_left_the_target():
    served = dataclasses.replace(WEAK, lossless=False)
    row = method_parity("dflash", served, WEAK, ["a", "b"], served_target=[[1, 2, 3, 4, 5, 6], [7, 8, 0]],
                        block_size=BLOCK)
    assert row.within_tolerance is False
    assert row.failures == ["the served output is not lossless: with the drafter the engine's output differs from its "
                            "target-only output (first difference: prompt 2 (b), new token 2: with the drafter 9, "
                            "target alone 0)"]


THREE = side([([1, 2, 3, 4, 5, 6], 20, 2), ([7, 8, 9], 20, 1), ([4, 4], 10, 3)], [47, 3])     # in-process, 3 prompts


def with_near_ties(figures: SideFigures, *ties: int) -> SideFigures:
    """The in-process side with these near-tie steps measured on its prompts, in order."""
    return dataclasses.replace(figures, prompts=[dataclasses.replace(p, near_ties=n) for p, n in zip(figures.prompts, ties)])


def identical_token_failures(row) -> list[str]:
    return [f for f in row.failures or [] if "prompts with identical tokens accepted differently" in f]


def test_a_prompt_with_identical_tokens_may_differ_by_one_step_only_where_a_near_tie_was_measured():
    near_tie = side([([1, 2, 3, 4, 5, 6], 20, 2), ([7, 8, 9], 21, 0), ([4, 4], 10, 3)], [48, 2])   # prompt b: one step
    row = method_parity("dflash", near_tie, with_near_ties(THREE, 0, 1, 0), ["a", "b", "c"], block_size=BLOCK)
    assert (row.prompts_same_tokens, row.prompts_same_acceptance, row.prompts_near_tie) == (3, 2, 1)
    assert identical_token_failures(row) == [], row.failures
    assert "2 of 3 prompts with identical tokens accepted the same drafts; 1 differed within their measured drafter " \
        "near-ties" in "\n".join(parity_summary({"dflash": row}))
    # the negative control: the same served figures, no near-tie measured on prompt b (nor on the others)
    strict = method_parity("dflash", near_tie, THREE, ["a", "b", "c"], block_size=BLOCK)
    assert identical_token_failures(strict) == [
        "1 of 3 prompts with identical tokens accepted differently beyond what the in-process drafter's near-ties "
        "explain (a prompt may differ by one step per near-tie step, drafts decided by less than 0.25 logits): prompt "
        "2 (b): served 0 accepted drafts over 21 steps vs in-process 1 over 20, 0 near-tie step(s)"]
    with pytest.raises(ParityFailed, match=r"1 of 3 prompts with identical tokens accepted differently"):
        check_parity({"dflash": strict}, "report.json")


def test_two_differing_prompts_pass_when_each_had_a_near_tie_and_fail_naming_the_one_without():
    two = side([([1, 2, 3, 4, 5, 6], 19, 3), ([7, 8, 9], 21, 0), ([4, 4], 10, 3)], [47, 3])     # each one step
    assert identical_token_failures(method_parity("dflash", two, with_near_ties(THREE, 1, 1, 0), ["a", "b", "c"],
                                                  block_size=BLOCK)) == []
    row = method_parity("dflash", two, with_near_ties(THREE, 0, 2, 0), ["a", "b", "c"], block_size=BLOCK)
    assert row.within_tolerance is False and (row.prompts_same_acceptance, row.prompts_near_tie) == (1, 1)
    assert identical_token_failures(row)[0].startswith(
        "1 of 3 prompts with identical tokens accepted differently beyond what the in-process drafter's near-ties "
        "explain") and "prompt 1 (a): served 3 accepted drafts over 19 steps vs in-process 2 over 20, 0 near-tie" \
        in identical_token_failures(row)[0]


@pytest.mark.parametrize("ties, passes", [(1, False), (2, True)])
def test_a_prompt_may_differ_by_one_step_per_near_tie_step(ties, passes):
    far = side([([1, 2, 3, 4, 5, 6], 20, 2), ([7, 8, 9], 22, 0), ([4, 4], 10, 3)], [49, 3])     # prompt b: two steps
    row = method_parity("dflash", far, with_near_ties(THREE, 0, ties, 0), ["a", "b", "c"], block_size=BLOCK)
    assert (identical_token_failures(row) == []) is passes, row.failures
    if not passes:
        assert "prompt 2 (b): served 0 accepted drafts over 22 steps vs in-process 1 over 20, 1 near-tie step(s)" \
            in identical_token_failures(row)[0]


@pytest.mark.parametrize("block_size, passes", [(BLOCK, True), (2, False)])
def test_one_near_tie_step_may_accept_at_most_one_blocks_drafts_more_or_fewer(block_size, passes):
    """One step more, 3 drafts fewer: within one block of B = 4 (B - 1 = 3 drafts), beyond one of B = 2."""
    ours = side([([1, 2, 3, 4, 5, 6], 20, 2), ([7, 8, 9], 20, 3, 1), ([4, 4], 10, 3)], [45, 5])
    served = side([([1, 2, 3, 4, 5, 6], 20, 2), ([7, 8, 9], 21, 0), ([4, 4], 10, 3)], [48, 2])
    row = method_parity("dflash", served, ours, ["a", "b", "c"], block_size=block_size)
    assert (identical_token_failures(row) == []) is passes, row.failures
    if not passes:
        assert "prompt 2 (b)" in identical_token_failures(row)[0]


def test_a_near_tie_step_is_a_draft_decided_by_less_than_the_margin():
    import torch

    from dflash.eval.specdec import NEAR_TIE_LOGITS, Proposal, near_tie_step

    clear = torch.tensor([[5.0, 1.0, 0.0, 0.0], [0.0, 4.0, 1.0, 0.0], [0.0, 0.0, 3.0, 1.0]])   # drafts 0, 1, 2
    proposal = Proposal(tokens=[0, 1, 2], logits=clear)
    assert near_tie_step(proposal, 3, 3) is False                      # all accepted, each led by 1+ logits
    assert near_tie_step(proposal, 1, 3) is False                      # slot 2 rejected for token 3: 4 logits behind
    close = clear.clone()
    close[0, 1] = 5.0 - NEAR_TIE_LOGITS / 2                            # the accepted first draft led by less
    assert near_tie_step(Proposal(tokens=[0, 1, 2], logits=close), 1, 3) is True
    assert near_tie_step(Proposal(tokens=[0, 1, 2], logits=close), 0, 2) is False      # rejected at once: slot 1 unread
    behind = clear.clone()
    behind[1, 3] = 4.0 - NEAR_TIE_LOGITS / 2                           # the target's token just behind the rejected draft
    assert near_tie_step(Proposal(tokens=[0, 1, 2], logits=behind), 1, 3) is True
    # a draft vocabulary: rows are target ids 10, 11, 12, 13; a target token outside it cannot be drafted
    assert near_tie_step(Proposal(tokens=[10, 11, 12], logits=behind, vocab=torch.tensor([10, 11, 12, 13])), 1, 13) is True
    assert near_tie_step(Proposal(tokens=[10, 11, 12], logits=behind, vocab=torch.tensor([10, 11, 12, 13])), 1, 99) is False
    assert near_tie_step(Proposal(tokens=[0, 1, 2]), 1, 3) is False     # no scores (prompt lookup): none measured


def test_a_drafter_whose_gain_is_noise_is_marked_inconclusive_and_prompt_lookup_is_shown_not_gated():
    row = method_parity("dflash", WEAK, WEAK, ["a", "b"], block_size=BLOCK)
    assert row.within_tolerance is True and row.conclusive is False          # 0.075 < 3 standard errors of it
    lookup = method_parity("prompt_lookup", DEAD, WEAK, ["a", "b"], block_size=BLOCK)
    assert lookup.within_tolerance is None and lookup.failures is None


def test_vllm_counters_become_the_per_step_histogram():
    assert histogram_of_positions(10, [6.0, 3.0, 1.0]) == [4, 3, 2, 1]           # 10 steps, accepted >= 1, 2, 3
    assert histogram_of_positions(0, []) == [0]


# -- SGLang's /generate, as its code shapes it -----------------------------------------------------

def test_an_sglang_answer_becomes_the_prompt_the_gate_reads():
    from dflash.eval.engines import sglang_served_prompt

    shapes = json.loads((FIXTURES / f"sglang-{PINNED_SGLANG}-generate.json").read_text())
    meta = {"spec_verify_ct": 4, "spec_num_correct_drafts": 5, "spec_correct_drafts_histogram": [1, 1, 1, 1],
            "spec_accept_length": 2.5, "completion_tokens": 10}
    assert {"spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram"} <= set(shapes["meta_info_spec_keys"])
    prompt = sglang_served_prompt({"text": "x", "output_ids": [5, 6, 7], "meta_info": meta})
    assert (prompt.token_ids, prompt.steps, prompt.accepted, prompt.histogram) == ([5, 6, 7], 4, 5, [1, 1, 1, 1])
    assert sglang_served_prompt({"text": "", "output_ids": [1], "meta_info": {}}).steps == 0   # nothing drafted


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory, tiny_qwen3_target) -> Path:
    """A drafter of the tiny target (random weights: its in-process tau is near 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.drafter.checkpoint import save_checkpoint
    from dflash.drafter.model import DFlashDrafter, drafter_config

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()
    torch.manual_seed(0)
    config = drafter_config(target.config, num_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=151669)
    return save_checkpoint(tmp_path_factory.mktemp("tiny-drafter"), DFlashDrafter(config).attach_target(target), 1, {})


def standin_eval(mode: str, tiny_qwen3_target: Path, checkpoint: Path, tmp_path: Path, draft_tokens: int = 0):
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.served import evaluate_with_engine

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"say {i} " * 5}]})
                                 for i in range(3)) + "\n")
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, model=dataclasses.replace(profile.model, target=str(tiny_qwen3_target)),
                                  eval=dataclasses.replace(profile.eval, engine_port=free_port(), max_new_tokens=12,
                                                           draft_tokens=draft_tokens))
    return evaluate_with_engine(profile, tmp_path / "run", checkpoint, EvalOptions(prompts_path=str(prompts)), "sglang",
                                launch=[sys.executable, str(STANDIN), "sglang", "--mode", mode])


@pytest.mark.slow
def test_the_sglang_gate_sends_token_ids_and_passes_a_drafter_served_as_decoded(tiny_qwen3_target, tiny_drafter, tmp_path):
    from dflash.eval.records import read_report

    summary = standin_eval("honest", tiny_qwen3_target, tiny_drafter, tmp_path)
    report, parity = summary.report, summary.report.parity
    assert parity["target"].same_tokens_as_inprocess and parity["dflash"].same_tokens_as_inprocess
    assert parity["dflash"].within_tolerance is True and parity["dflash"].failures == []
    assert parity["dflash"].prompts_same_acceptance == parity["dflash"].prompts_same_tokens == 3
    assert report.methods["dflash"].mean_tau == parity["dflash"].inprocess_tau and report.methods["dflash"].identical_to_target
    assert read_report(tmp_path / "run" / "eval" / "engine-sglang.json") == report
    served = tmp_path / "run" / "eval" / "engine-sglang-drafter"
    assert report.context.served_drafter == str(served) and (served / "config.json").exists()
    assert str(served) in (tmp_path / "run" / "eval" / "logs" / "sglang-dflash.log").read_text()


@pytest.mark.slow
def test_the_sglang_gate_with_fewer_draft_tokens_than_the_block_pads_the_slots_it_does_not_draft(
        tiny_qwen3_target, tiny_drafter, tmp_path):
    """eval.draft_tokens 2 of B - 1 = 3: SGLang gets a block of 3, its histogram stops at 2 accepted
    drafts; slot 3 counts as 0 accepted on both sides and the honest drafter passes."""
    summary = standin_eval("honest", tiny_qwen3_target, tiny_drafter, tmp_path, draft_tokens=2)
    argv = summary.report.methods["dflash"].argv or []
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "3"
    row = summary.report.parity["dflash"]
    assert row.within_tolerance is True and row.failures == [] and row.same_tokens_as_inprocess, row.failures
    assert row.prompts_same_acceptance == row.prompts_same_tokens == 3
    assert len(row.served_position_acceptance or []) == len(row.inprocess_position_acceptance or []) == 3
    assert (row.served_position_acceptance or [])[2] == (row.inprocess_position_acceptance or [])[2] == 0.0


@pytest.mark.slow
def test_the_sglang_gate_fails_a_served_drafter_that_accepts_differently(tiny_qwen3_target, tiny_drafter, tmp_path):
    with pytest.raises(ParityFailed, match="3 of 3 prompts with identical tokens accepted differently"):
        standin_eval("extra-accept", tiny_qwen3_target, tiny_drafter, tmp_path)
    assert (tmp_path / "run" / "eval" / "engine-sglang.json").exists()       # the report is written first


def test_the_pipeline_prints_the_served_speedup_beside_the_served_tau_and_the_in_process_figures():
    from dflash.eval.records import EvalReport, MethodFigures
    from dflash.pipeline import served_line

    def report(tau: float, speedup: float, **extra) -> EvalReport:
        methods = {"target": MethodFigures(1.0, 10.0, 1.0, None),
                   "dflash": MethodFigures(tau, 10.0 * speedup, speedup, True)}
        return EvalReport(block_size=8, temperature=0.0, num_prompts=6, methods=methods, **extra)

    served = report(2.41, 1.73, engine="vllm", inprocess=report(2.40, 0.92))
    assert served_line("vllm", served) == ("served by vllm: dflash tau 2.41 speedup 1.73x vs in-process tau 2.40 "
                                           "speedup 0.92x on the same 6 prompts, lossless")


def test_eval_draft_tokens_sets_what_each_engine_drafts_and_prompt_lookup_keeps_the_block():
    """eval.draft_tokens k: vLLM's DFlash gets num_speculative_tokens k (its block: the bonus token +
    k masks, as the in-process drafter drafts), SGLang's a block of k + 1; prompt lookup keeps B - 1."""
    base = load_profile("rtx6000-x8")
    profile = dataclasses.replace(base, eval=dataclasses.replace(base.eval, draft_tokens=3))

    def speculative(method: str, engine: str = "vllm") -> object:
        argv = engine_command(engine, profile, Path("/t"), method, Path("/ckpt"), 16, 30100).argv
        if engine == "sglang":
            return argv[argv.index("--speculative-num-draft-tokens") + 1]
        return json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"]

    assert speculative("dflash") == 3 and speculative("prompt_lookup") == 15
    assert speculative("dflash", "sglang") == "4" and speculative("prompt_lookup", "sglang") == "16"
    assert engine_command("vllm", base, Path("/t"), "dflash", Path("/ckpt"), 16, 30100).argv[-1].endswith("15}")  # control
    longer = dataclasses.replace(base, eval=dataclasses.replace(base.eval, draft_tokens=40))
    argv = engine_command("vllm", longer, Path("/t"), "dflash", Path("/ckpt"), 16, 30100).argv
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 15   # at most B - 1
    argv = engine_command("sglang", longer, Path("/t"), "dflash", Path("/ckpt"), 16, 30100).argv
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "16"                           # at most B


def test_a_slot_the_engine_does_not_draft_counts_as_nothing_accepted():
    """eval.draft_tokens 3 on a block of 8: vLLM's counters list the 3 drafted positions, the in-process
    report all 7 slots; the served side's slots 4..7 are 0 accepted and the two sides match. The
    controls: an in-process side that accepted a 4th draft on 4 steps fails the gate either way round,
    and the summary shows a list one side left short as 0 there."""
    from dflash.eval.engines import engine_run, vllm_served_prompt
    from dflash.eval.report import position_acceptance
    from dflash.eval.served import served_side

    taus = [2, 1, 1, 4, 1, 2, 1, 1, 3, 1]                          # per step: at most 3 drafts accepted
    before = {"drafts": 5.0, "accepted": 2.0, "pos0": 1.0, "pos1": 1.0, "pos2": 0.0}
    after = {"drafts": 15.0, "accepted": 9.0, "pos0": 5.0, "pos1": 3.0, "pos2": 1.0}
    prompt = vllm_served_prompt("", [1, 2, 3], before, after)
    assert (prompt.steps, prompt.accepted, prompt.histogram) == (10, 7, [6, 2, 1, 1])
    run = engine_run("dflash", [prompt], 1.0, [], block_size=8)
    assert run.position_acceptance == pytest.approx([0.4, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])
    assert run.position_acceptance == pytest.approx(position_acceptance(taus, 8))
    served = served_side(run, None)
    ours = SideFigures([PromptAcceptance([1, 2, 3], 10, 7)], histogram_of_taus(taus), position_acceptance(taus, 8), True)
    row = method_parity("dflash", served, ours, ["a"], block_size=8)
    assert row.within_tolerance is True and row.served_position_acceptance == pytest.approx(row.inprocess_position_acceptance)
    beyond = [5, 5, 5, 5, 1, 2, 1, 1, 3, 1]                        # 4 steps accepted slot 4 (and 4 drafts)
    accepted_beyond = SideFigures([PromptAcceptance([1, 2, 3], 10, 19)], histogram_of_taus(beyond),
                                  position_acceptance(beyond, 8), True)
    assert method_parity("dflash", served, accepted_beyond, ["a"], block_size=8).within_tolerance is False
    assert method_parity("dflash", accepted_beyond, served, ["a"], block_size=8).within_tolerance is False
    short = dataclasses.replace(method_parity("dflash", served, accepted_beyond, ["a"], block_size=8),
                                served_position_acceptance=[0.4, 0.2, 0.1])   # as vLLM lists them
    assert "per position 0.40/0.60 0.20/0.50 0.10/0.40 0.00/0.40 0.00/0.00 0.00/0.00 0.00/0.00 " in \
        parity_summary({"dflash": short})[1]
