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

The losslessness reference of every served variant is the engine's target-only run on the same prompt
token ids: the demo drafter's `eval --engine vllm` flow's (test_engine_vllm.py), built once for both
modules (engine_vllm_common.demo_flow), checked to be of the same token ids and settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_vllm_common import (
    MAX_NEW_TOKENS,
    NUM_PROMPTS,
    SLIDING_WINDOW,
    assert_fails_the_gate,
    demo_flow,
    inprocess_of,
    passes_on_every_subset,
    serve_variant,
    served_settings,
    shared_root,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def inprocess(engine_profile, sliding_drafter):
    """The sliding drafter's in-process decoding of the eval prompts."""
    from dflash.eval.options import eval_prompts_path

    decoded = inprocess_of(engine_profile, sliding_drafter, eval_prompts_path(engine_profile, None))
    assert len(decoded.prompt_ids) == NUM_PROMPTS
    return decoded


def flow_target_run(request: pytest.FixtureRequest, profile, inprocess):
    """A function that returns the engine's target-only run of the prompts: the demo drafter's flow's
    (test_engine_vllm.py; built once per test run, by whichever module asks first), checked to be of
    the same prompt token ids, stop ids and settings. serve_variant calls it after serving the variant,
    so this module serves while the other module's worker builds the flow."""
    def target_run():
        _, flow = demo_flow(shared_root(request.getfixturevalue("tmp_path_factory")), profile,
                            request.getfixturevalue("demo_drafter"))
        assert flow.inprocess.prompt_ids == inprocess.prompt_ids
        assert flow.inprocess.stop_token_ids == inprocess.stop_token_ids
        assert flow.report.block_size == inprocess.report.block_size == served_settings(profile, inprocess).block_size
        assert (flow.report.context.max_new_tokens, flow.report.context.seed, flow.report.temperature) == \
            (MAX_NEW_TOKENS, profile.eval.seed, profile.eval.temperature)
        return flow.runs["target"]

    return target_run


def test_a_sliding_window_drafter_is_served_and_passes_the_gate_on_every_9_of_its_10_prompts(
        engine_profile, inprocess, sliding_drafter, request, tmp_path):
    from dflash.eval.served import served_side

    target_run = flow_target_run(request, engine_profile, inprocess)
    gate, run = serve_variant(engine_profile, target_run, inprocess, sliding_drafter, "", tmp_path)
    assert gate.within_tolerance is True and gate.failures == [] and gate.conclusive is True, gate
    assert gate.served_identical_to_target is True and gate.prompts_same_acceptance is not None
    assert gate.steps_before_near_tie, gate
    served = served_side(run, target_run())
    assert passes_on_every_subset(served, inprocess.side("dflash"), inprocess.prompt_names) == 10
    config = json.loads((tmp_path / "served-as-trained" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 3 and config["sliding_window"] == SLIDING_WINDOW
    print(f"sliding drafter: served tau {gate.served_tau:.3f}, in-process {gate.inprocess_tau:.3f}")


@pytest.mark.parametrize("change", ["taps-shifted", "sliding-rule-flipped"])
def test_a_served_sliding_drafter_that_is_not_the_trained_one_fails_the_gate_naming_the_divergence(
        engine_profile, inprocess, sliding_drafter, change, request, tmp_path: Path):
    target_run = flow_target_run(request, engine_profile, inprocess)
    gate, _ = serve_variant(engine_profile, target_run, inprocess, sliding_drafter, change, tmp_path)
    assert_fails_the_gate(gate, change)
