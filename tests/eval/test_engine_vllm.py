"""The parity gate against the real engine: vLLM's CPU build (`launcher.py engine setup vllm`) serving
the demo target (SmolLM2-135M) with drafters trained here on the target's own answers, `--enforce-eager`.

* the demo's drafter (3 layers from the target's layers 27-29, block 8, tap [26], a draft vocabulary
  as cpu-demo has: served as lm_head rows + d2t) through the whole `eval --engine vllm` flow (three
  engine starts: target, DFlash, prompt lookup): it passes the gate;
* a negative control on it: its export with random weights, served once, fails the gate with the
  divergence named (the sliding-window drafter and its two controls, the taps shifted and the sliding
  rule flipped, are in test_engine_vllm_sliding.py, which runs beside this module on another worker;
  the data, the drafters and this flow are built once for both: engine_vllm_common.py);
* the flagship's pattern, sliding layers mixed with a full one, needs vLLM's V2 model runner, which on
  CPU needs Triton with a CPU backend (triton-cpu, not on PyPI): vLLM's CPU build cannot serve it here
  and the launcher refuses it naming why (tests/eval/test_engine_code.py runs vLLM's own layer rule on
  that pattern and tests/gpu serves it).

The engine's target-only run of the flow is the losslessness reference of every served variant, the
sliding module's too (same prompts, same token ids). Skipped, with the reason, only where the engine's
venv cannot be built (no local CPU torch wheel, no package index)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from engine_vllm_common import (
    NUM_PROMPTS,
    assert_fails_the_gate,
    demo_flow,
    passes_on_every_subset,
    serve_variant,
    shared_root,
)

from dflash.eval.report_schema import read_report
from dflash.generate.vllm_server import SEPARATE_WORKER_LOG_MARKS

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def demo_eval(engine_profile, demo_drafter, tmp_path_factory):
    """The whole `eval --engine vllm` flow on the demo's drafter; its files written as `eval` writes them
    (built once per test run: test_engine_vllm_sliding.py reads its target-only run)."""
    return demo_flow(shared_root(tmp_path_factory), engine_profile, demo_drafter)


def test_the_demo_drafter_passes_the_gate_served_as_trained(demo_eval):
    run_dir, result = demo_eval
    gate = result.report.parity["dflash"]
    assert result.report.num_prompts == NUM_PROMPTS
    assert gate.within_tolerance is True and gate.failures == [] and gate.conclusive is True, gate
    assert gate.served_identical_to_target is True and gate.inprocess_identical_to_target is True
    assert gate.inprocess_tau is not None and gate.inprocess_tau > 1.2, gate      # a drafter with a gain to lose
    assert gate.prompts_same_tokens and gate.prompts_same_acceptance is not None
    assert gate.steps_before_near_tie and gate.p_value is not None and gate.p_value >= 0.01, gate
    assert json.loads((run_dir / "eval" / "engine-vllm-drafter" / "config.json").read_text())["draft_vocab_size"] > 0
    assert len(gate.served_position_acceptance or []) == len(gate.inprocess_position_acceptance or []) == 7
    assert read_report(run_dir / "eval" / "engine-vllm.json") == result.report
    print(f"demo drafter: served tau {gate.served_tau:.3f} over {gate.served_steps} steps, in-process "
          f"{gate.inprocess_tau:.3f} over {gate.inprocess_steps}; {gate.steps_before_near_tie} steps compared before "
          f"near-ties, {gate.prompts_fewer} fewer / {gate.prompts_more} more after them")


def test_the_demo_drafter_passes_the_gate_on_every_9_of_its_10_prompts(demo_eval):
    from dflash.eval.served import served_side

    _, result = demo_eval
    served = served_side(result.runs["dflash"], result.runs["target"])
    assert served.prompts[0].per_step is not None             # vLLM's per-request metrics: each step's acceptance
    assert passes_on_every_subset(served, result.inprocess.side("dflash"), result.inprocess.prompt_names) == 10


def test_the_served_speedup_is_measured_against_the_engine_alone(demo_eval):
    _, result = demo_eval
    dflash, target = result.report.methods["dflash"], result.report.methods["target"]
    assert target.speedup == pytest.approx(1.0) and dflash.speedup is not None and dflash.speedup > 0
    assert dflash.speedup == pytest.approx(dflash.tokens_per_s / target.tokens_per_s)
    assert result.report.inprocess is not None and result.report.inprocess.methods["dflash"].speedup is not None


def test_the_engine_decodes_the_same_tokens_as_the_in_process_target(demo_eval):
    _, result = demo_eval
    target = result.report.parity["target"]
    assert (result.report.methods["target"].new_tokens or 0) > NUM_PROMPTS * 4
    assert target.same_tokens_as_inprocess is True, target.first_divergence


def test_prompt_lookup_is_served_too(demo_eval):
    _, result = demo_eval
    lookup = result.report.methods["prompt_lookup"]
    assert lookup.mean_tau is not None and lookup.mean_tau >= 1.0
    assert lookup.identical_to_target is True and result.report.parity["prompt_lookup"].within_tolerance is None
    assert '"method": "ngram"' in " ".join(lookup.argv or [])


def test_the_servers_bound_to_loopback_and_were_stopped(demo_eval):
    run_dir, result = demo_eval
    ports = {(method.argv or [])[(method.argv or []).index("--port") + 1] for method in result.report.methods.values()}
    assert len(ports) == 1      # the profile's eval.engine_port (the flow may have been run by the sliding module's worker)
    port = int(ports.pop())
    for name, method in result.report.methods.items():
        argv = method.argv or []
        assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
        assert f"http://127.0.0.1:{port}" in (run_dir / "eval" / "logs" / f"vllm-{name}.log").read_text()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and f"--port\0{port}\0".encode() in _cmdline(pid)]


def test_each_server_ran_the_model_in_its_engine_process(demo_eval):
    """vllm_server.CPU_ONE_PROCESS took effect in the real engine: its log has the engine process's
    lines and none of what vLLM's default CPU layout logs (a worker process's lines, its OpenMP
    binding of a core to the worker and one kept for the spinning engine process)."""
    run_dir, result = demo_eval
    for name, method in result.report.methods.items():
        argv = method.argv or []
        assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
        log = (run_dir / "eval" / "logs" / f"vllm-{name}.log").read_text()
        assert "(EngineCore pid=" in log and not [mark for mark in SEPARATE_WORKER_LOG_MARKS if mark in log], name


def test_the_served_drafter_is_the_vllm_export(demo_eval):
    run_dir, result = demo_eval
    exported = run_dir / "eval" / "engine-vllm-drafter"
    assert result.report.context.served_drafter == str(exported) and (exported / "config.json").exists()
    assert str(exported) in " ".join(result.report.methods["dflash"].argv or [])
    assert "Served vs in-process" in (run_dir / "eval" / "engine-vllm.md").read_text()


def test_a_drafter_mixing_sliding_and_full_layers_is_refused_on_cpu_naming_the_v2_runner(engine_profile, tmp_path):
    """vLLM's V2 model runner (which mixed layers need) requires Triton with a CPU backend here: the
    engine venv's triton has none (vllm/config/vllm.py: `Model Runner V2 requires Triton.`)."""
    from dflash.eval.engines import check_engine_serves
    from launcher_core.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"layer_types": ["sliding_attention"] * 4 + ["full_attention"]}))
    with pytest.raises(ConfigError, match="only on its V2 model runner; on CPU that runner needs Triton with a CPU backend"):
        check_engine_serves("vllm", "0.32.0", engine_profile, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"layer_types": ["sliding_attention"] * 3}))
    check_engine_serves("vllm", "0.32.0", engine_profile, tmp_path)


def test_a_served_drafter_with_random_weights_fails_the_gate_naming_the_divergence(engine_profile, demo_eval,
                                                                                   demo_drafter, tmp_path):
    """Negative control: the demo drafter's export with every matrix re-drawn (the other two controls,
    on the sliding drafter, are in test_engine_vllm_sliding.py)."""
    _, flow = demo_eval
    gate, _ = serve_variant(engine_profile, lambda: flow.runs["target"], flow.inprocess, demo_drafter, "random-weights", tmp_path)
    assert_fails_the_gate(gate, "random-weights")


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
