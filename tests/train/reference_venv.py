"""A scratch venv with the reference drafter code (PyPI `dflash`, z-lab) and the transformers it
pins, cached under the project cache keyed by the pins. Built with `python -m uv venv --seed`;
torch with pip (a pinned CPU build), transformers and safetensors, then `dflash` without its
dependencies (its model code needs only torch and transformers; the rest serves its benchmark).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REFERENCE_PINS = ("dflash==0.1.0", "transformers==5.15.0", "torch==2.13.0", "safetensors")


def reference_python() -> Path:
    """The venv's python, built on first use; pytest.skip when the package index is unreachable."""
    from launcher_core.paths import cache_build_lock, cache_dir

    key = "-".join(pin.replace("==", "-") for pin in REFERENCE_PINS)
    root = cache_dir() / "reference-venvs" / key
    python = root / "bin" / "python"
    if (root / ".complete").exists():
        return python
    with cache_build_lock(f"reference-venv-{key}"):     # test workers that need it at once build it once
        if not (root / ".complete").exists():
            _build(root, python)
    return python


def _build(root: Path, python: Path) -> None:
    """Build the venv at `root` (a partial one, left by a build that was killed, is cleared: only this
    function writes there), then mark it complete."""
    _require_index()
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    steps = [[sys.executable, "-m", "uv", "venv", "--seed", "-q", "--clear", "--python", sys.executable, str(root)],
             [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *REFERENCE_PINS[1:]],
             [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", REFERENCE_PINS[0]]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=env, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"building the reference venv failed at {' '.join(step)}:\n{done.stderr[-3000:]}")
    (root / ".complete").write_text("\n".join(REFERENCE_PINS) + "\n")


def _require_index() -> None:
    """Skip (with pip's reason) when the package index cannot be reached."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                                "-d", scratch, REFERENCE_PINS[0]], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"the package index is unreachable, cannot build the reference venv ({REFERENCE_PINS[0]}): {reason}")


@dataclass
class Comparison:
    """What a comparison ran: our drafter, its draft_logits arguments, the reference's logits [B, V]."""

    drafter: Any
    inputs: tuple
    reference: Any


def compare_with_reference(checkpoint: Path, target, work: Path, context: int = 11, first_token: int = 1000) -> Comparison:
    """Load `checkpoint` into our drafter and into the reference `DFlashDraftModel` (strictly: no
    missing, unexpected or mismatched keys), feed both the same target features and block, and
    hold the reference's config reading (RoPE, per-layer window and causality) and draft logits
    equal to ours (within 1e-4)."""
    import json
    import math

    import torch
    from safetensors.torch import load_file, save_file

    from dflash.drafter.checkpoint_files import load_drafter
    from dflash.drafter.taps import extract_taps

    python = reference_python()
    drafter = load_drafter(checkpoint, target)
    input_ids = torch.arange(first_token, first_token + context + 1)[None]
    features = extract_taps(target, input_ids, drafter.target_layer_ids)[:, :context].float()
    ours = drafter.draft_logits(features, int(input_ids[0, context]), context)
    block = drafter.block_input_ids(input_ids[:, context])
    inputs = {"target_hidden": features.contiguous(), "position_ids": torch.arange(context + drafter.block_size)[None],
              "noise_embedding": target.get_input_embeddings()(block).float().contiguous(),
              "lm_head": target.get_output_embeddings().weight.detach().float().contiguous()}
    save_file(inputs, str(work / "inputs.safetensors"))
    done = subprocess.run([str(python), "tests/train/reference_logits.py", str(checkpoint),
                           str(work / "inputs.safetensors"), str(work / "logits.safetensors")],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(not keys for keys in seen["loading_info"].values()), seen["loading_info"]
    assert (seen["block_size"], seen["mask_token_id"], seen["target_layer_ids"]) == (
        drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids)
    assert seen["rope_theta"] == drafter.config.rope_parameters["rope_theta"]
    torch.testing.assert_close(torch.tensor(seen["inv_freq"]), drafter.rotary_emb.inv_freq.float())
    assert math.isclose(seen["attention_scaling"], drafter.rotary_emb.attention_scaling, rel_tol=1e-6)
    assert seen["rope_type"] == drafter.config.rope_parameters.get("rope_type", "default")
    assert seen["layers"] == [[rule.window, rule.causal] for rule in drafter.layer_rules]
    reference = load_file(str(work / "logits.safetensors"))["logits"][0]
    torch.testing.assert_close(reference, ours.float(), rtol=1e-4, atol=1e-4)
    return Comparison(drafter, (features, int(input_ids[0, context]), context), reference)


@dataclass
class Dflash2Comparison:
    """A DFlash 2 comparison: our drafter, its block hidden rows, our walk, the reference's outputs."""

    drafter: Any
    hidden: Any
    anchor_id: int
    ours_logits: Any
    ours_path: list[int]
    reference_logits: Any
    reference_path: list[int]
    reference_candidates: Any


def run_dflash2_reference(checkpoint: Path, target, work: Path, context: int, first_token: int,
                          reference_checkpoint: Path | None = None) -> Dflash2Comparison:
    """Our DFlash 2 drafter (from `checkpoint`) and the reference `DFlash2DraftModel` (from
    `reference_checkpoint`, default the same, through its from_pretrained, codebook key mapping
    included) on the same target features and block: unary logits of every slot, the greedy
    selector path and the candidates of slots 1..B-1. Compares nothing (the callers do)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from dflash.drafter.checkpoint_files import load_drafter
    from dflash.drafter.taps import extract_taps

    python = reference_python()
    drafter = load_drafter(checkpoint, target)
    input_ids = (first_token + torch.arange(context + 1) * 7 % 300)[None]
    features = extract_taps(target, input_ids, drafter.target_layer_ids)[:, :context].float()
    anchor = int(input_ids[0, context])
    hidden = drafter.draft_hidden(features, anchor, context)
    ours_logits = drafter.logits(hidden)
    walk = drafter.selector.walk(ours_logits[1:], hidden[1:], anchor)
    block = drafter.block_input_ids(input_ids[:, context])
    inputs = {"target_hidden": features.contiguous(), "position_ids": torch.arange(context + drafter.block_size)[None],
              "noise_embedding": target.get_input_embeddings()(block).float().contiguous(),
              "lm_head": target.get_output_embeddings().weight.detach().float().contiguous(),
              "anchor_ids": input_ids[:, context].contiguous()}
    save_file(inputs, str(work / "inputs.safetensors"))
    done = subprocess.run([str(python), "tests/train/reference_dflash2.py", str(reference_checkpoint or checkpoint),
                           str(work / "inputs.safetensors"), str(work / "outputs.safetensors")],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(not keys for keys in seen["loading_info"].values()), seen["loading_info"]      # strict: nothing left over
    options = drafter.options
    assert (seen["block_size"], seen["mask_token_id"], seen["target_layer_ids"]) == (
        drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids)
    assert (seen["top_k"], seen["rank"]) == (options.selector_top_k, options.selector_rank) and not seen["q"]
    assert seen["conv"] == [[options.conv_kernel_size, options.conv_group_size]] * len(drafter.layers)
    assert seen["layers"] == [[rule.window, rule.causal] for rule in drafter.layer_rules]
    outputs = load_file(str(work / "outputs.safetensors"))
    return Dflash2Comparison(drafter, hidden, anchor, ours_logits, walk.tokens.tolist(), outputs["logits"][0],
                             outputs["path"][0].tolist(), outputs["candidates"][0])


def assert_same_as_reference(result: Dflash2Comparison) -> None:
    """Unary logits within 1e-4 (relative), the same greedy path, the same candidate set per slot."""
    import torch

    torch.testing.assert_close(result.reference_logits, result.ours_logits.float(), rtol=1e-4, atol=1e-4)
    assert result.ours_path == result.reference_path
    _, ours = torch.topk(result.ours_logits[1:], result.drafter.options.selector_top_k, dim=-1)
    assert ours.sort(dim=-1).values.tolist() == result.reference_candidates.sort(dim=-1).values.tolist()
