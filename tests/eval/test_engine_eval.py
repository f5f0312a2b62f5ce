"""`eval --engine sglang|vllm` without starting an engine: SGLang's argv against the pinned SGLang's
own option list (from its server_args.py, tests/fixtures/engines/) and its flow against a stand-in
that speaks its API (tests/eval/engine_standin.py; SGLang needs CUDA); vLLM's argv builders (the real
vLLM CPU engine runs in tests/eval/test_engine_vllm.py), the install check and the parity gate."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dflash.eval.engines import engine_command
from dflash.generate.servers import is_hybrid_target, sglang_server_command
from launcher_core.profile import load_profile
from tests.generate.gen_helpers import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
STANDIN = Path(__file__).resolve().parent / "engine_standin.py"


def sglang_options(version: str) -> tuple[set[str], str]:
    lines = (FIXTURES / f"sglang-{version}-flags.txt").read_text().splitlines()
    return {line for line in lines if line.startswith("--")}, "\n".join(line for line in lines if line.startswith("#"))


def hybrid_target(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}))
    return tmp_path


@pytest.mark.parametrize("method", ["target", "dflash", "prompt_lookup"])
def test_sglang_engine_argv_uses_only_options_of_sglang_0_5_11(method, tmp_path):
    profile = load_profile("rtx6000-x8")
    command = engine_command("sglang", profile, hybrid_target(tmp_path), method, Path("/ckpt"), 16, 30100)
    options, header = sglang_options("0.5.11")
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


def test_pinned_cu128_sglang_has_no_dflash_so_the_profile_names_the_engine():
    _, header = sglang_options("0.5.10.post1")
    assert '"DFLASH"' not in header
    cu128 = Path("requirements-cu128.txt").read_text()
    assert "sglang==0.5.10.post1" in cu128 and "sglang==0.5.11" in Path("requirements-cu130.txt").read_text()
    assert load_profile("rtx6000-x8").eval.engine == "sglang"


def test_generate_passes_context_length_and_the_hybrid_strategy_to_the_pinned_sglang(tmp_path):
    options, _ = sglang_options("0.5.10.post1")
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


def test_vllm_on_cpu_sizes_the_kv_cache_in_gib_instead_of_a_gpu_memory_share():
    profile = load_profile("cpu-demo")
    command = engine_command("vllm", profile, Path("/t"), "target", Path("/ckpt"), 8, 30100)
    assert "--gpu-memory-utilization" not in command.argv
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == str(profile.generate.vllm_cpu_kvcache_gib) == "2"
    assert command.argv[command.argv.index("--max-model-len") + 1] == "1024"
    assert "--enforce-eager" in command.argv and command.argv[command.argv.index("--host") + 1] == "127.0.0.1"
    assert profile.eval.serve_engine == "vllm"


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


def test_the_parity_gate_fails_beyond_the_tolerance_and_names_the_first_divergence():
    from dflash.eval.parity import check_parity, method_parity
    from dflash.eval.records import MethodFigures
    from launcher_core.errors import EXIT_PARITY, ParityFailed

    served = MethodFigures(mean_tau=1.60, tokens_per_s=5.0, speedup=1.2, identical_to_target=True, position_acceptance=[0.4, 0.1])
    ours = MethodFigures(mean_tau=1.40, tokens_per_s=4.0, speedup=1.1, identical_to_target=True, position_acceptance=[0.3, 0.1])
    row = method_parity("dflash", served, ours, ["a", "b"], [[1, 2, 3], [4, 5, 9]], [[1, 2, 3], [4, 5, 6]])
    assert row.within_tolerance is False and not row.same_tokens_as_inprocess
    with pytest.raises(ParityFailed, match=r"prompt 2 \(b\), new token 2: served 9, in-process 6") as failed:
        check_parity({"dflash": row}, "report.json")
    assert failed.value.exit_code == EXIT_PARITY == 6
    close = method_parity("dflash", dataclasses.replace(served, mean_tau=1.45, position_acceptance=[0.35, 0.1]), ours,
                          ["a"], [[1]], [[1]])
    assert close.within_tolerance is True and close.first_divergence is None
    check_parity({"dflash": close}, "report.json")
    lookup = method_parity("prompt_lookup", served, ours, ["a"], [[1]], [[1]])
    assert lookup.within_tolerance is None        # shown, not gated


def test_the_parity_gate_counts_a_slot_one_side_does_not_list_as_nothing_accepted():
    from dflash.eval.parity import method_parity
    from dflash.eval.records import MethodFigures

    # eval.draft_tokens 3: vLLM lists its 3 drafted slots, the in-process report all 7 of block 8
    served = MethodFigures(mean_tau=1.351, tokens_per_s=5.0, speedup=1.1, identical_to_target=True, position_acceptance=[0.29, 0.05, 0.01])
    ours = MethodFigures(mean_tau=1.353, tokens_per_s=4.0, speedup=0.9, identical_to_target=True,
                         position_acceptance=[0.30, 0.05, 0.01, 0.0, 0.0, 0.0, 0.0])
    assert method_parity("dflash", served, ours, ["a"], [[1]], [[1]]).within_tolerance is True
    accepted_beyond = dataclasses.replace(ours, position_acceptance=[0.30, 0.05, 0.01, 0.2, 0.0, 0.0, 0.0])
    assert method_parity("dflash", served, accepted_beyond, ["a"], [[1]], [[1]]).within_tolerance is False
    assert method_parity("dflash", accepted_beyond, served, ["a"], [[1]], [[1]]).within_tolerance is False


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sglang"])
def test_engine_eval_flow_reports_engine_tau_next_to_target_and_prompt_lookup(engine, tmp_path, tiny_qwen3_target):
    from dflash.eval.engines import evaluate_with_engine
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.records import read_report

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "block_size": 4, "hidden_size": 64, "num_attention_heads": 4,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1]}}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"say {i} " * 5}]})
                                 for i in range(3)) + "\n")
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, model=dataclasses.replace(profile.model, target=str(tiny_qwen3_target)),
                                  eval=dataclasses.replace(profile.eval, engine_port=free_port()))
    summary = evaluate_with_engine(profile, tmp_path / "run", checkpoint, EvalOptions(prompts_path=str(prompts)),
                                   engine, launch=[sys.executable, str(STANDIN), engine])
    methods = summary.report.methods
    assert (methods["target"].mean_tau, methods["dflash"].mean_tau, methods["prompt_lookup"].mean_tau) == (1.0, 3.5, 1.5)
    assert methods["dflash"].new_tokens == 30 and methods["dflash"].identical_to_target is True
    assert methods["target"].speedup == pytest.approx(1.0)
    assert read_report(tmp_path / "run" / "eval" / f"engine-{engine}.json") == summary.report
    assert (tmp_path / "run" / "eval" / f"engine-{engine}.md").read_text().count("|") > 10
    log = (tmp_path / "run" / "eval" / "logs" / f"{engine}-dflash.log").read_text()
    assert str(checkpoint) in log


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
