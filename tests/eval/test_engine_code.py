"""The attention each exported draft layer gets, from the engines' own code (tests/eval/engine_code.py),
held against our rules: the trained rule (dflash.drafter.layers.layer_attention, the reference's)
and the per-release SGLang rule (envcheck.engine_releases.sglang_rules) that `audit`, `export --for sglang`
and `eval --engine sglang` apply. SGLang's functions are executed from its wheels (downloaded once
into the project cache); vLLM's run in the engine venv (`launcher.py engine setup vllm`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash.drafter.layers import layer_attention
from envcheck.engine_releases import sglang_rules
from launcher_core.layer_attention import LayerAttention, config_draft_layers

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]
SGLANG_RELEASES = ("0.5.11", "0.5.13.post1", "0.5.14", "0.5.17", "0.5.19")   # the rule changes at each
WINDOW = 6
VARIANTS = {   # config.json edits of the export: our drafters write no is_causal; published ones may
    "ours": {}, "is_causal_true": {"is_causal": True}, "is_causal_false": {"is_causal": False},
    "all_full": {"layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False},
    "all_sliding": {"layer_types": ["sliding_attention"] * 5}}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_qwen3_target) -> dict[str, Path]:
    """A sliding-window drafter of the tiny target (4 sliding + 1 full, the flagship's pattern) exported
    for SGLang and vLLM, and the config variants of each export."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.drafter.export import export_drafter
    from dflash.drafter.network import DFlashDrafter, drafter_config

    root = tmp_path_factory.mktemp("engine-code")
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()
    torch.manual_seed(0)
    config = drafter_config(target.config, num_layers=5, block_size=4, target_layer_ids=[1], mask_token_id=151669,
                            layer_types=("sliding_attention",) * 4 + ("full_attention",), sliding_window=WINDOW)
    checkpoint = save_checkpoint(root / "ckpt", DFlashDrafter(config).attach_target(target), 1, {})
    found = {}
    for engine in ("sglang", "vllm"):
        exported = export_drafter(checkpoint, engine, root / engine).directory
        for name, edits in VARIANTS.items():
            directory = root / f"{engine}-{name}"
            shutil.copytree(exported, directory)
            document = {**json.loads((directory / "config.json").read_text()), **edits}
            (directory / "config.json").write_text(json.dumps(document))
            found[f"{engine}-{name}"] = directory
    return found


@pytest.fixture(scope="module")
def sglang_sources(tmp_path_factory) -> dict[str, Path]:
    from engine_code import download_sglang

    from launcher_core.paths import cache_dir

    sources = {version: download_sglang(version, cache_dir() / "engines" / "sglang-source") for version in SGLANG_RELEASES}
    missing = [version for version, path in sources.items() if path is None]
    if missing:
        pytest.skip(f"the SGLang wheels {missing} cannot be downloaded here")
    return {version: path for version, path in sources.items() if path is not None}


def as_rule(window_left: int, kind: str) -> LayerAttention:
    """SGLang's (window_left, attention type) as a rule: window_left = sliding_window - 1, -1 for none."""
    assert kind in ("DECODER", "ENCODER_ONLY"), kind
    return LayerAttention(window=window_left + 1 if window_left >= 0 else None, causal=kind == "DECODER")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_sglang_release_runs_each_exported_layer_as_our_rule_says(sglang_sources, exports, variant):
    from engine_code import sglang_attention
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(exports[f"sglang-{variant}"])
    ours = config_draft_layers(config)
    for version, root in sglang_sources.items():
        theirs = [as_rule(*pair) for pair in sglang_attention(root, config, config.num_hidden_layers)]
        release = tuple(int(part) for part in version.split(".")[:3])
        assert theirs == sglang_rules(release, ours), (version, variant, theirs)


def test_the_pinned_sglang_runs_our_drafter_as_trained_and_its_predecessors_did_not(sglang_sources, exports):
    from engine_code import sglang_attention
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(exports["sglang-ours"])
    trained = layer_attention(config)
    assert trained == [LayerAttention(WINDOW, True)] * 4 + [LayerAttention(None, False)]
    served = {version: [as_rule(*pair) for pair in sglang_attention(root, config, 5)] for version, root in sglang_sources.items()}
    assert served["0.5.19"] == served["0.5.14"] == trained
    assert served["0.5.11"] == served["0.5.13.post1"] == [LayerAttention(None, False)] * 5      # bidirectional, no window


def test_vllm_runs_each_exported_layer_as_trained_and_mixed_layers_only_on_its_v2_runner(vllm_python, exports):
    from engine_code import vllm_layer_attention
    from transformers import AutoConfig

    names = sorted(VARIANTS)
    results = vllm_layer_attention(vllm_python, [exports[f"vllm-{name}"] for name in names])
    for name in names:
        config = AutoConfig.from_pretrained(exports[f"vllm-{name}"])
        trained = [[rule.window, rule.causal] for rule in layer_attention(config)]
        rows = results[str(exports[f"vllm-{name}"])]
        assert rows["v2"] == trained, (name, rows)
        mixed = name not in ("all_full", "all_sliding")
        if mixed:
            assert "require the V2 model runner" in str(rows["v1"]), rows["v1"]
        else:
            assert rows["v1"] == trained


def test_vllms_ngram_proposer_uses_one_numba_thread_and_the_launchers_env_leaves_it_no_idle_one(vllm_python):
    """Prompt lookup on vLLM: its proposer runs numba on at most one thread however many cores the node
    has, so the launcher's CPU environment (vllm_server.CPU_NUMBA_THREADS) takes nothing from it and
    leaves numba's pool no idle thread (one per core otherwise); the proposer still drafts the lookup's
    continuation under it."""
    from engine_code import vllm_ngram_threads

    from dflash.generate.vllm_server import vllm_env
    from launcher_core.profile import load_profile

    result = vllm_ngram_threads(vllm_python, vllm_env(load_profile("cpu-demo")))
    assert result["cap"] == 1, result                        # min(1, 64 // 2)
    assert result["pool"] == 1, result                       # numba's default: a thread per core
    assert result["drafts"] == [[7, 8, 9], [], [], []], result


def test_vllm_answers_each_requests_per_step_acceptance_in_the_fields_we_read(vllm_python):
    """`--per-request-spec-decode-metrics detailed` is an option of the engine's vLLM and its response model
    has the fields dflash.eval.engines.vllm_answer_prompt reads (vllm/entrypoints/generate/base/protocol.py)."""
    import subprocess

    probe = subprocess.run([vllm_python, "-c",
                            "from vllm.engine.arg_utils import EngineArgs\n"
                            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                            "from vllm.entrypoints.generate.base.protocol import SpeculativeDecodingMetrics as M\n"
                            "parser = EngineArgs.add_cli_args(FlexibleArgumentParser())\n"
                            "args = parser.parse_args(['--per-request-spec-decode-metrics', 'detailed'])\n"
                            "print(args.per_request_spec_decode_metrics, ' '.join(sorted(M.model_fields)))"],
                           capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    level, fields = probe.stdout.split()[0], set(probe.stdout.split()[1:])
    assert level == "detailed"
    assert {"num_spec_steps", "num_accepted_draft_tokens", "acceptance_histogram", "per_step_accepted"} <= fields
