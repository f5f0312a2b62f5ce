"""Lossless speculative decoding on a GPU: the tiny target in float32 (TF32 off); each of four held-out
prompts (chat template, no thinking) decoded greedily, 64 new tokens, block 16, by the target
alone and then by a randomly initialised DFlash drafter (2 layers, tap features), prompt lookup,
and an oracle proposing the target's own continuation with every fifth token wrong (tau > 1,
rejected drafts, KV-cache rollback). Every method's output must equal target-only greedy decoding
token for token; tau, tokens/s and speedup per method are reported (OUT/eval_report.json, the
`launcher.py eval` report format). The same run in bf16 is informational: a block's verify
forward and single-token forwards round differently in bf16, so near-ties in a random model's
logits can flip. (The CPU counterpart is tests/eval/test_specdec.py.)"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest

pytestmark = pytest.mark.gpu

EVAL_BLOCK, EVAL_PROMPTS, EVAL_TOKENS = 16, 4, 64
ORACLE_WRONG_EVERY = 5
REPO_ROOT = Path(__file__).resolve().parents[2]


def eval_prompts(tokenizer_dir: Path, count: int) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    from dflash.generate.prompt_files import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    records = load_prompts(REPO_ROOT / "dflash" / "prompts" / "everyday_prompts.jsonl")[:count]
    encoded = []
    for record in records:
        text = tokenizer.apply_chat_template(list(record.messages), add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
        encoded.append((record.id, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return encoded


def random_dflash_draft(model: Any, device: Any) -> Any:
    import torch
    from gpu_helpers import MASK_ID

    from dflash.drafter.network import DFlashDrafter, drafter_config
    from dflash.drafter.taps import default_target_layer_ids
    from dflash.eval.dflash_drafter import DFlashDraft

    layers = model.config.num_hidden_layers
    config = drafter_config(model.config, num_layers=2, block_size=EVAL_BLOCK,
                            target_layer_ids=default_target_layer_ids(layers, 2), mask_token_id=MASK_ID)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).attach_target(model).to(device=device, dtype=model.dtype).eval()
    return DFlashDraft(model=drafter)


def decode_all(model: Any, draft: Any, prompts: list[tuple[str, list[int]]], settings: Any) -> list[Any]:
    """Per prompt: target-only greedy first, then each drafter on the same verifier."""
    from dflash.eval.oracle import OracleDrafter
    from dflash.eval.prompt_lookup import PromptLookupDrafter
    from dflash.eval.report_writer import MethodRun, PromptRuns
    from dflash.eval.specdec import NoDrafter, TargetVerifier, speculative_decode

    verifier = TargetVerifier(model, draft.layer_ids)
    speculative_decode(verifier, draft, prompts[0][1], settings)            # warm-up: one-off costs
    results = []
    for prompt_id, ids in prompts:
        entry = PromptRuns(prompt_id, len(ids))
        reference = speculative_decode(verifier, NoDrafter(), ids, settings)
        entry.runs["target"] = MethodRun(reference.tokens, reference.taus, reference.wall_s)
        oracle = OracleDrafter(reference.tokens, len(ids), model.config.vocab_size, wrong_every=ORACLE_WRONG_EVERY,
                               name="oracle_corrupted")
        for method in (draft, PromptLookupDrafter(), oracle):
            run = speculative_decode(verifier, method, ids, settings)
            entry.runs[method.name] = MethodRun(run.tokens, run.taus, run.wall_s)
        results.append(entry)
    return results


def greedy_report(target: Path, tokenizer_dir: Path, dtype: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.eval.report_schema import ReportContext
    from dflash.eval.report_writer import build_report
    from dflash.eval.specdec import DecodeSettings

    device = torch.device("cuda", 0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True).to(device).eval()
    model.requires_grad_(False)
    settings = DecodeSettings(block_size=EVAL_BLOCK, max_new_tokens=EVAL_TOKENS, temperature=0.0, eos_ids=())
    runs = decode_all(model, random_dflash_draft(model, device), eval_prompts(tokenizer_dir, EVAL_PROMPTS), settings)
    report = build_report(runs, block_size=EVAL_BLOCK, temperature=0.0,
                          context=ReportContext(target=target.name, max_new_tokens=EVAL_TOKENS))
    # the report's JSON (what eval writes), with this run's device, dtype and drafter beside it
    return {**report.to_json(), "device": str(device), "dtype": str(dtype), "drafter": "random-weight DFlash"}


def method_figures(report: dict[str, Any]) -> dict[str, Any]:
    return {name: {"mean_tau": round(m["mean_tau"], 3), "tokens_per_s": round(m["tokens_per_s"], 1),
                   "speedup": None if m["speedup"] is None else round(m["speedup"], 3),
                   "identical_to_target": m["identical_to_target"]} for name, m in report["methods"].items()}


def identical_per_prompt(report: dict[str, Any], method: str) -> list[Optional[bool]]:
    return [p["methods"][method]["identical_to_target"] for p in report["prompts"]]


@pytest.fixture(scope="module")
def float32_report(tiny_target, tokenizer_dir, gpu_out, record) -> dict[str, Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report = greedy_report(tiny_target, tokenizer_dir, torch.float32)
    (gpu_out / "eval_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    record.figure(float32=method_figures(report), device="cuda")
    return report


def test_float32_speculative_decoding_equals_target_greedy(float32_report, record):
    figures = method_figures(float32_report)
    assert set(figures) == {"target", "dflash", "prompt_lookup", "oracle_corrupted"}
    results = [record.check(f"float32 {name}: output == target-only greedy", bool(method["identical_to_target"]),
                            f"mean tau {method['mean_tau']}, per prompt {identical_per_prompt(float32_report, name)}")
               for name, method in figures.items() if name != "target"]
    taus = ", ".join(f"{name} {m['mean_tau']:.2f}" for name, m in figures.items() if name != "target")
    record.set_summary(f"float32 on cuda: {'all methods == target greedy' if all(results) else 'MISMATCH'}; tau {taus}")
    assert all(results)


def test_the_corrupted_oracle_is_accepted_and_rolled_back(float32_report):
    assert float32_report["methods"]["oracle_corrupted"]["mean_tau"] > 1.5
    assert float32_report["methods"]["target"]["new_tokens"] > 0


def test_bf16_equality_is_reported(tiny_target, tokenizer_dir, float32_report, record):
    import torch

    report = greedy_report(tiny_target, tokenizer_dir, torch.bfloat16)
    record.figure(bf16=method_figures(report))
    identical = all(m["identical_to_target"] for name, m in report["methods"].items() if name != "target")
    record.check("bf16: speculative == target-only greedy", identical,
                 f"per prompt (dflash): {identical_per_prompt(report, 'dflash')}", required=False)
