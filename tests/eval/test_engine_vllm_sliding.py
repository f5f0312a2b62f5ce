"""A sliding-window drafter through the real engine (vLLM's CPU build, `--enforce-eager`), and the
parity gate's negative controls on it.

* the drafter: every layer `sliding_attention`, window SLIDING_WINDOW, causal as trained, at the
  demo's size (3 layers from the target's layers 27-29, block 8, tap [26]), trained on the target's
  own answers (engine_vllm_common.py builds the data and the drafter once for this module and
  test_engine_vllm.py, which runs beside it on another pytest-xdist worker); served as trained it
  passes the gate;
* two exports of it changed one way, each served once, each failing the gate with the divergence
  named: the tap layers shifted by one, and the sliding layers' rule flipped (served under the
  full-attention rule: bidirectional, no window, as SGLang 0.5.11-0.5.13 run every DFlash layer).

The losslessness reference of every served variant is this module's own target-only run of the
engine on the same prompt token ids."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_vllm_common import NUM_PROMPTS, SLIDING_WINDOW, assert_fails_the_gate, inprocess_of, serve_variant, served_settings

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def reference(engine_profile, sliding_drafter, tmp_path_factory):
    """The sliding drafter's in-process decoding of the eval prompts and the engine's target-only run
    of the same token ids (one start)."""
    from dflash.eval.engines import run_engines
    from dflash.eval.options import eval_prompts_path
    from dflash.models import resolve_model_path

    inprocess = inprocess_of(engine_profile, sliding_drafter, eval_prompts_path(engine_profile, None))
    assert len(inprocess.prompt_ids) == NUM_PROMPTS
    settings = served_settings(engine_profile, inprocess)
    target = resolve_model_path(engine_profile.model.target)
    runs = run_engines("vllm", engine_profile, target, target, settings.block_size, inprocess.prompt_ids, settings,
                       tmp_path_factory.mktemp("target-run") / "logs", methods=("target",))
    return runs["target"], inprocess


def test_a_sliding_window_drafter_is_served_and_passes_the_gate(engine_profile, reference, sliding_drafter, tmp_path):
    target_run, inprocess = reference
    gate, _ = serve_variant(engine_profile, target_run, inprocess, sliding_drafter, "", tmp_path)
    assert gate.within_tolerance is True and gate.failures == [] and gate.conclusive is True, gate
    assert gate.served_identical_to_target is True and gate.prompts_same_acceptance is not None
    assert gate.prompts_same_acceptance + (gate.prompts_near_tie or 0) == gate.prompts_same_tokens, gate
    config = json.loads((tmp_path / "served-as-trained" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 3 and config["sliding_window"] == SLIDING_WINDOW
    print(f"sliding drafter: served tau {gate.served_tau:.3f}, in-process {gate.inprocess_tau:.3f}")


@pytest.mark.parametrize("change", ["taps-shifted", "sliding-rule-flipped"])
def test_a_served_sliding_drafter_that_is_not_the_trained_one_fails_the_gate_naming_the_divergence(
        engine_profile, reference, sliding_drafter, change, tmp_path: Path):
    target_run, inprocess = reference
    gate, _ = serve_variant(engine_profile, target_run, inprocess, sliding_drafter, change, tmp_path)
    assert_fails_the_gate(gate, change)
