"""`eval --engine sglang|vllm` without a real engine: SGLang's argv against the pinned SGLang's own
option list, its `/generate` requests and answers against the shapes its code declares (both from
its wheel, tests/fixtures/engines/), its flow against a stand-in that decodes with our decoder
behind that API (tests/eval/engine_standin.py; SGLang needs CUDA, so the SGLang gate is unproven
until tests/gpu/test_engine_eval_gpu.py runs it on a GPU); vLLM's argv builders (the real vLLM CPU
engine runs in tests/eval/test_engine_vllm.py), the install check and the parity gate's rules."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest

from dflash.eval.engines import engine_command
from dflash.eval.parity import (
    NEAR_TIE_DRAFT_LOGITS,
    NEAR_TIE_TARGET_LOGITS,
    PREFIX_PROMPTS,
    SIGNIFICANCE,
    VERDICT_FAIL,
    VERDICT_PASS,
    VERDICT_UNDECIDED,
    GateConstants,
    PromptAcceptance,
    SideFigures,
    check_parity,
    check_parity_sets,
    histogram_of_positions,
    histogram_of_taus,
    method_parity,
    parity_lines,
    parity_summary,
    prompt_parity_lines,
    sign_test,
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


def python_with(tmp_path: Path, distribution: str, version: str) -> Path:
    """A python whose environment has `distribution` at `version` (its metadata only)."""
    info = tmp_path / "site" / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={info.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu"])
def test_the_install_check_accepts_either_vllm_distribution_name(distribution, tmp_path):
    from dflash.eval.engines import check_engine_installed

    python = python_with(tmp_path, distribution, "0.32.0")
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


def test_the_install_check_names_sglangs_own_venv_where_this_sglang_has_no_dflash(tmp_path, private_cache):
    """rtx6000-x8 on its cu128 set (SGLang 0.5.10.post1), `engine setup sglang` not run: the refusal names it; once
    its venv is built (an empty eval.engine_python), `eval --engine sglang` starts SGLang from there."""
    from dflash.eval.engines import check_engine_installed
    from dflash.generate.vllm_server import engine_python
    from envcheck.engine_venvs import STAMP, engine_env_dir
    from launcher_core.errors import ConfigError

    profile = load_profile("rtx6000-x8")
    old = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_python=str(
        python_with(tmp_path, "sglang", "0.5.10.post1"))))
    with pytest.raises(ConfigError, match=r"sglang 0\.5\.10\.post1 at .* has no DFLASH .*run `launcher\.py engine setup "
                                          r"sglang` \(it builds the engine's venv from requirements-engine-sglang-cu130"):
        check_engine_installed("sglang", old)
    assert profile.eval.engine_python == "" and engine_python(profile, "sglang") == sys.executable
    venv = engine_env_dir("sglang")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / STAMP).write_text(venv.name + "\n")            # what the setup writes last
    assert engine_python(profile, "sglang") == str(venv / "bin" / "python")


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

FAR = 5.0       # a margin no near-tie constant reaches
NEAR = 0.001    # one every near-tie constant reaches


def prompt(per_step: list[int], tokens: Optional[list[int]] = None, ties: Sequence[int] = (),
           target_ties: Sequence[int] = (), totals_only: bool = False) -> PromptAcceptance:
    """A prompt decoded step by step: `per_step` accepted drafts; its tokens by default one id per committed
    position; margins FAR except NEAR at the steps in `ties` (drafter side) and `target_ties`."""
    count = 1 + sum(a + 1 for a in per_step)
    return PromptAcceptance(list(range(count)) if tokens is None else tokens, len(per_step), sum(per_step),
                            None if totals_only else list(per_step),
                            [NEAR if k in ties else FAR for k in range(len(per_step))],
                            [NEAR if k in target_ties else FAR for k in range(len(per_step))])


def figures(prompts: list[PromptAcceptance], lossless: bool = True) -> SideFigures:
    return SideFigures(prompts, histogram_of_taus([a + 1 for p in prompts for a in p.per_step or []]), [0.1] * 3,
                       lossless)


def ids(count: int) -> list[str]:
    return [f"p{k}" for k in range(count)]


def test_a_drafter_served_as_trained_passes_when_prompts_differ_only_after_their_first_near_tie():
    ours = [prompt([1, 0, 2, 0, 1], ties=[2]), prompt([0, 0, 1, 1])] * PREFIX_PROMPTS
    theirs = [prompt([1, 0, 0, 0, 0, 3]), prompt([0, 0, 1, 1])] * PREFIX_PROMPTS    # departing at the near-tie (step 3)
    row = method_parity("dflash", figures(theirs), figures(ours), ids(len(ours)))
    assert row.within_tolerance is True and row.failures == [] and row.failed_rules == [], row.failures
    assert row.steps_before_near_tie == (2 + 4) * PREFIX_PROMPTS and row.prompts_same_acceptance == PREFIX_PROMPTS
    assert [p.first_near_tie for p in row.prompts or []][:2] == [3, None]
    assert [p.prefix_mismatch for p in row.prompts or []] == [None] * len(ours)


def departing(count: int, *, tied_at: int = 3, target_side: bool = False) -> tuple[list, list]:
    """`count` prompts whose served step 3 differs, their first near-tie at step `tied_at + 1`; one that does not."""
    tie = {"target_ties": [tied_at]} if target_side else {"ties": [tied_at]}
    ours = [prompt([1, 0, 2, 0, 1], **tie) for _ in range(count)] + [prompt([0, 0, 1, 1])]
    theirs = [prompt([1, 0, 1, 1, 1]) for _ in range(count)] + [prompt([0, 0, 1, 1])]
    return theirs, ours


def test_the_gate_fails_when_enough_prompts_depart_before_their_first_near_tie_naming_prompt_and_step():
    theirs, ours = departing(PREFIX_PROMPTS)
    row = method_parity("dflash", figures(theirs), figures(ours), ids(len(ours)))
    assert row.within_tolerance is False and row.failed_rules == ["deterministic prefix"]
    assert (row.failures or [""])[0].startswith(
        f"{PREFIX_PROMPTS} of {len(ours)} prompts decoded differently where the same drafter must decode alike, before "
        "any near-tie: prompt 1 (p0): step 3 before its first near-tie (step 4): served accepted 1 draft(s), "
        "in-process 2"), row.failures
    # the controls: one prompt fewer departing passes (and is counted), and so does a step 3 that was itself a
    # near-tie, on the drafter's side or the target's
    fewer = method_parity("dflash", *(figures(side) for side in departing(PREFIX_PROMPTS - 1)), ids(PREFIX_PROMPTS))
    assert fewer.within_tolerance is True and sum(1 for p in fewer.prompts or [] if p.prefix_mismatch) == PREFIX_PROMPTS - 1
    assert f"{PREFIX_PROMPTS - 1} prompt(s) departing there (the gate fails from {PREFIX_PROMPTS})" in \
        "\n".join(parity_summary({"dflash": fewer}))
    for target_side in (False, True):
        theirs, ours = departing(PREFIX_PROMPTS, tied_at=2, target_side=target_side)
        assert method_parity("dflash", figures(theirs), figures(ours), ids(len(ours))).within_tolerance is True


def test_the_near_tie_margins_are_the_gate_s_constants():
    just_below, at = NEAR_TIE_DRAFT_LOGITS * 0.99, NEAR_TIE_DRAFT_LOGITS
    ours = PromptAcceptance([0], 3, 0, [0, 0, 0], [FAR, just_below, FAR], [FAR, FAR, NEAR_TIE_TARGET_LOGITS * 0.99])
    assert ours.first_near_tie(GateConstants()) == 1
    level = dataclasses.replace(ours, draft_margins=[FAR, at, FAR])
    assert level.first_near_tie(GateConstants()) == 2                  # the target's side at step 3
    assert dataclasses.replace(level, target_margins=[FAR] * 3).first_near_tie(GateConstants()) is None


def test_below_the_prompt_count_where_a_rule_can_fail_a_wrong_lossless_drafter_is_undecided_and_never_passes():
    """`eval --engine ... --num-prompts 3`: neither the prefix rule (4 departing prompts) nor the paired test
    (9 differing ones) can fail, so a wrong drafter that stays lossless is undecided, exit 6, not a pass."""
    few = PREFIX_PROMPTS - 1
    theirs, ours = departing(few)
    theirs, ours = theirs[:few], ours[:few]                                    # every prompt departs at step 3
    row = method_parity("dflash", figures(theirs), figures(ours), ids(few))
    assert row.verdict == VERDICT_UNDECIDED and row.within_tolerance is None and row.failures == []
    assert (row.undecided or [""])[0].startswith(f"{few} prompt(s): the deterministic rule fails from {PREFIX_PROMPTS} "
                                                 "departing prompts and the paired test from 9 differing ones")
    with pytest.raises(ParityFailed) as undecided:
        check_parity({"dflash": row}, "report.json")
    assert undecided.value.exit_code == EXIT_PARITY and undecided.value.rules == ("undecided",)
    assert str(undecided.value).splitlines()[0].startswith("eval --engine: the parity gate cannot decide")
    assert "  UNDECIDED" in str(undecided.value)
    # the same drafter on enough prompts fails; an honest one on them passes; a broken stream fails on any count
    theirs, ours = departing(PREFIX_PROMPTS)
    assert method_parity("dflash", figures(theirs), figures(ours), ids(len(ours))).verdict == VERDICT_FAIL
    honest = [prompt([1, 0, 2])] * PREFIX_PROMPTS
    assert method_parity("dflash", figures(honest), figures(honest), ids(PREFIX_PROMPTS)).verdict == VERDICT_PASS
    broken = method_parity("dflash", figures(honest[:1], lossless=False), figures(honest[:1]), ids(1))
    assert broken.verdict == VERDICT_FAIL and broken.failed_rules == ["lossless"]


def test_in_a_dtype_the_margins_were_not_measured_in_the_margin_rules_leave_the_verdict_undecided():
    """The flagship serves in bfloat16, where rounding alone departs a true drafter before its first near-tie at the
    float32 margins: neither a pass nor a prefix failure is a verdict there; the lossless rule still fails."""
    honest = [prompt([1, 0, 2])] * PREFIX_PROMPTS
    row = method_parity("dflash", figures(honest), figures(honest), ids(PREFIX_PROMPTS), dtype="bfloat16")
    assert row.verdict == VERDICT_UNDECIDED and row.failures == []
    assert (row.undecided or [""])[0].startswith("both sides decoded in bfloat16; the near-tie margins are measured "
                                                 "in float32 only")
    assert "(in bfloat16, where the margins are not measured" in (row.rules_ran or [""])[2]
    theirs, ours = departing(PREFIX_PROMPTS)
    departed = method_parity("dflash", figures(theirs), figures(ours), ids(len(ours)), dtype="bfloat16")
    assert departed.verdict == VERDICT_UNDECIDED and departed.failed_rules == []
    assert any(reason.startswith(f"the deterministic prefix rule found: {PREFIX_PROMPTS} of {len(ours)} prompts "
                                 "decoded differently") and reason.endswith("in bfloat16 a drafter served as trained "
                                                                            "does that too")
               for reason in departed.undecided or [])
    with pytest.raises(ParityFailed) as undecided:                     # undecided is not a pass: exit 6
        check_parity({"dflash": departed}, "report.json")
    assert undecided.value.rules == ("undecided",)
    broken = method_parity("dflash", figures(honest, lossless=False), figures(honest), ids(PREFIX_PROMPTS),
                           dtype="bfloat16")
    assert broken.verdict == VERDICT_FAIL and broken.failed_rules == ["lossless"]
    # float32, the measured dtype, decides as before
    assert method_parity("dflash", figures(theirs), figures(ours), ids(len(ours)), dtype="float32").verdict == VERDICT_FAIL


def test_every_gated_row_says_which_rules_ran_and_on_what():
    ours = [prompt([1, 0, 2]), prompt([2, 0, 0], ties=[1])] * PREFIX_PROMPTS
    mixed = [prompt([1, 0, 2]), prompt([2, 0, 0], totals_only=True)] * PREFIX_PROMPTS
    row = method_parity("dflash", figures(mixed), figures(ours), ids(len(ours)))
    assert row.rules_ran == [
        "drafted: the engine reported speculative steps",
        "lossless: against the engine's own target-only output",
        f"deterministic prefix: step by step on {PREFIX_PROMPTS} of {2 * PREFIX_PROMPTS} prompts, totals of near-tie-free "
        f"prompts on the other {PREFIX_PROMPTS}; fails from {PREFIX_PROMPTS} departing prompts",
        f"paired test: p < {SIGNIFICANCE:g} over {2 * PREFIX_PROMPTS} prompts (cannot fail below 9 prompts)"]
    assert "Rules that ran on dflash: drafted: the engine reported" in "\n".join(prompt_parity_lines({"dflash": row}))


def test_a_departure_before_any_near_tie_shows_the_step_the_drafts_the_targets_tokens_and_the_margins():
    ours = dataclasses.replace(prompt([1, 2, 0, 1]), drafts=[[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]],
                               draft_margins=[FAR, 0.42, FAR, FAR], target_margins=[FAR, 0.9, FAR, FAR])
    theirs = prompt([1, 0, 1, 0, 1])                                          # step 2: 0 accepted instead of 2
    row = method_parity("dflash", figures([theirs]), figures([ours]), ids(1))
    departure = (row.prompts or [])[0].departure
    assert departure is not None and (departure.step, departure.new_token) == (2, 3)    # 1 (prefill) + 2 (step 1)
    assert (departure.served_accepted, departure.inprocess_accepted) == (0, 2)
    assert (departure.drafter_margin, departure.target_margin, departure.drafts) == (0.42, 0.9, [8, 9, 10])
    assert departure.target_tokens == [3, 4, 5]                               # the 2 accepted drafts, then the bonus
    assert "departed with no near-tie, p0: step 2 (new token 3): served accepted 0 draft(s), in-process 2 of the " \
        "drafts [8, 9, 10]; the target's tokens [3, 4, 5]; in-process margins drafter 0.420, target 0.900 logits" \
        in "\n".join(parity_summary({"dflash": row}))
    assert "| p0 | 2 | 3 | 0 / 2 | [8, 9, 10] | [3, 4, 5] | 0.420 | 0.900 |" in prompt_parity_lines({"dflash": row})
    tied = dataclasses.replace(ours, draft_margins=[FAR, NEAR, FAR, FAR])   # the same step at a near-tie: no departure
    assert (method_parity("dflash", figures([theirs]), figures([tied]), ids(1)).prompts or [])[0].departure is None


def test_every_prompt_set_of_a_served_check_is_gated_and_named_not_only_the_first_that_fails():
    theirs, ours = departing(PREFIX_PROMPTS)
    failing = {"dflash": method_parity("dflash", figures(theirs), figures(ours), ids(len(ours)))}
    honest = [prompt([1, 0, 2])] * PREFIX_PROMPTS
    passing = {"dflash": method_parity("dflash", figures(honest), figures(honest), ids(PREFIX_PROMPTS))}
    with pytest.raises(ParityFailed) as failed:
        check_parity_sets([("benchmark humaneval", failing, "bench/humaneval/engine-vllm.json"),
                           ("benchmark mt-bench", passing, "bench/mt-bench/engine-vllm.json"),
                           ("held-out", dict(failing), "engine-vllm.json")])
    text = str(failed.value)
    assert "benchmark humaneval:" in text and "held-out:" in text and "benchmark mt-bench:" not in text
    assert text.splitlines()[-1].startswith("parity gate failed (deterministic prefix): read "
                                            "bench/humaneval/engine-vllm.json, engine-vllm.json")
    check_parity_sets([("benchmark mt-bench", passing, "r.json")])                       # a pass raises nothing


def test_the_report_table_shows_the_verdict():
    few = method_parity("dflash", figures([prompt([1])]), figures([prompt([1])]), ids(1))
    assert few.verdict == VERDICT_UNDECIDED and "| UNDECIDED: 1 prompt(s)" in "\n".join(parity_lines({"dflash": few}))


def test_a_prompt_without_any_near_tie_must_match_to_its_last_step_and_token():
    ours = [prompt([1, 0, 2])]
    for theirs, found in ((prompt([1, 0, 2, 0]), "with no near-tie in it: served 4 steps, in-process 3"),
                          (prompt([1, 0, 2], tokens=[0, 1, 2, 3, 4, 9, 6, 7]),
                           "new token 5 with no near-tie in it: served 9, in-process 5")):
        row = method_parity("dflash", figures([theirs]), figures(ours), ids(1))
        assert (row.prompts or [])[0].prefix_mismatch == found, row.prompts
        many = method_parity("dflash", figures([theirs] * PREFIX_PROMPTS), figures(ours * PREFIX_PROMPTS),
                             ids(PREFIX_PROMPTS))
        assert many.within_tolerance is False and many.failed_rules == ["deterministic prefix"]


def test_with_totals_only_a_prompt_without_near_ties_must_match_and_one_with_a_near_tie_is_left_to_the_test():
    """SGLang when its stream coalesced steps: no per-step figures, only the request's totals."""
    ours = [prompt([1, 0, 2]), prompt([2, 0, 0], ties=[1])] * PREFIX_PROMPTS
    equal = [prompt([1, 0, 2], totals_only=True), prompt([0, 0, 1, 1], totals_only=True)] * PREFIX_PROMPTS
    undecided = method_parity("dflash", figures(equal), figures(ours), ids(len(ours)))
    assert undecided.verdict == VERDICT_UNDECIDED and undecided.within_tolerance is None and undecided.failures == []
    assert "the engine gave no per-step acceptance for 8 of 8 prompts" in (undecided.undecided or [""])[0]
    unequal = [prompt([1, 1, 2], totals_only=True), prompt([2, 0, 0], totals_only=True)] * PREFIX_PROMPTS
    row = method_parity("dflash", figures(unequal), figures(ours), ids(len(ours)))
    assert row.failed_rules == ["deterministic prefix"] and "prompt 1 (p0): with no near-tie in it: served 4 accepted " \
        "drafts over 3 steps, in-process 3 over 3" in (row.failures or [""])[0]


def test_the_sign_test_is_exact():
    assert sign_test(0, 0) == 1.0 and sign_test(1, 0) == 1.0
    assert sign_test(8, 0) == pytest.approx(2 / 256) and sign_test(0, 8) == sign_test(8, 0)
    assert sign_test(7, 0) == pytest.approx(2 / 128)
    assert sign_test(9, 1) == pytest.approx(2 * 11 / 1024)
    assert sign_test(5, 5) == 1.0


def test_prompts_that_all_accept_fewer_after_their_near_ties_fail_the_paired_test_and_a_balanced_split_passes():
    ours = [prompt([1, 1, 1, 1], ties=[0]) for _ in range(10)]
    fewer = [prompt([1, 1, 0, 0, 0, 1]) for _ in range(10)]             # each: 3 drafts over 6 steps < 4 over 4
    row = method_parity("dflash", figures(fewer), figures(ours), ids(10))
    assert SIGNIFICANCE > 2 / 1024
    assert row.failed_rules == ["paired test"] and (row.prompts_fewer, row.prompts_more) == (10, 0)
    assert row.p_value == pytest.approx(2 / 1024) and row.conclusive is True
    assert row.failures == ["the served drafter accepted fewer drafts per step than in-process on 10 of the 10 prompts "
                            f"that differ (paired two-sided sign test p = 0.002 < {SIGNIFICANCE:g}: a drafter served as "
                            "trained splits this unevenly less often)"]
    more = [prompt([2, 2, 2]) for _ in range(5)]                         # 6 over 3 > 4 over 4
    balanced = method_parity("dflash", figures(fewer[:5] + more), figures(ours), ids(10))
    assert balanced.within_tolerance is True and (balanced.prompts_fewer, balanced.prompts_more) == (5, 5)


def test_on_too_few_prompts_the_paired_test_cannot_fail_and_the_row_says_so():
    few = next(n for n in range(2, 30) if sign_test(n, 0) < SIGNIFICANCE) - 1     # 8 at a significance of 0.005
    ours = [prompt([1, 1], ties=[0]) for _ in range(few)]
    dead = [prompt([0, 0, 0, 0]) for _ in range(few)]
    row = method_parity("dflash", figures(dead), figures(ours), ids(few))
    assert row.conclusive is False and row.within_tolerance is True and row.p_value == pytest.approx(2 / 2 ** few)
    assert f"cannot reach p < {SIGNIFICANCE:g}" in "\n".join(parity_summary({"dflash": row}))
    one_more = method_parity("dflash", figures(dead + dead[:1]), figures(ours + ours[:1]), ids(few + 1))
    assert one_more.conclusive is True and one_more.within_tolerance is False


def test_a_dead_drafter_served_for_a_weak_one_fails_where_a_fixed_tau_tolerance_passed_it():
    ours = [prompt([0] * 18 + [1, 0], ties=[5]) for _ in range(12)]      # tau 1.05, a near-tie early on each prompt
    dead = [prompt([0] * 21) for _ in range(12)]
    row = method_parity("dflash", figures(dead), figures(ours), ids(12))
    assert abs((row.served_tau or 0) - (row.inprocess_tau or 0)) < 0.10        # the old 0.10 tolerance: a pass
    assert row.within_tolerance is False and row.failed_rules == ["paired test"] and row.prompts_fewer == 12
    with pytest.raises(ParityFailed) as failed:
        check_parity({"dflash": row}, "report.json")
    assert failed.value.exit_code == EXIT_PARITY == 6
    last = str(failed.value).splitlines()[-1]
    assert last == 'parity gate failed (paired test): read report.json (per prompt: its .md) and ' \
        'docs/parity-gate.md'


def test_the_pipeline_s_last_line_names_the_rule_and_the_report_and_keeps_the_in_process_eval(tmp_path):
    from dflash.stages import served_check_failed

    ours = [prompt([1, 1, 1, 1], ties=[0]) for _ in range(10)]
    fewer = [prompt([1, 1, 0, 0, 0, 1]) for _ in range(10)]
    report = tmp_path / "eval" / "engine-vllm.json"
    with pytest.raises(ParityFailed) as failed:
        check_parity({"dflash": method_parity("dflash", figures(fewer), figures(ours), ids(10))}, str(report))
    final = served_check_failed(tmp_path, failed.value)
    assert final.exit_code == EXIT_PARITY and final.rules == ("paired test",)
    assert str(final).splitlines()[-1] == (
        f"pipeline: the in-process eval is done and kept ({tmp_path / 'eval' / 'report.md'}); the served check failed "
        f"the parity gate (paired test): read {tmp_path / 'eval' / 'engine-vllm.md'} for each prompt")


def test_a_served_stream_that_is_not_lossless_fails_naming_where_it_left_the_target():
    ours = [prompt([1, 0]), prompt([0, 0])]
    row = method_parity("dflash", figures(ours, lossless=False), figures(ours), ["a", "b"],
                        served_target=[[0, 1, 2, 3], [0, 1, 9]])
    assert row.within_tolerance is False and row.failed_rules == ["lossless"]
    assert row.failures == ["the served output is not lossless: with the drafter the engine's output differs from its "
                            "target-only output (first difference: prompt 2 (b), new token 2: with the drafter 2, "
                            "target alone 9)"]


def test_an_engine_that_drafted_nothing_fails_and_prompt_lookup_is_shown_not_gated():
    ours = [prompt([1, 0])]
    nothing = [PromptAcceptance([0, 1, 2, 3, 4], 0, 0, [])]
    row = method_parity("dflash", figures(nothing), figures(ours), ids(1))
    assert "drafted" in (row.failed_rules or []) and "the drafter was not served" in (row.failures or [""])[0]
    lookup = method_parity("prompt_lookup", figures(nothing), figures(ours), ids(1))
    assert lookup.within_tolerance is None and lookup.failures is None


def test_a_step_s_margins_are_the_decisive_leads_on_each_side():
    import torch

    from dflash.eval.specdec import Proposal, VerifyOutput, draft_margin, target_margin

    clear = torch.tensor([[5.0, 1.0, 0.0, 0.0], [0.0, 4.0, 1.0, 0.0], [0.0, 0.0, 3.0, 1.0]])   # drafts 0, 1, 2
    proposal = Proposal(tokens=[0, 1, 2], logits=clear)
    assert draft_margin(proposal, 3, 3) == pytest.approx(2.0)           # all accepted: the smallest lead, slot 3
    assert draft_margin(proposal, 1, 3) == pytest.approx(min(4.0, 4.0 - 0.0))    # slot 2 rejected for token 3
    close = clear.clone()
    close[1, 3] = 3.9                                                    # the target's token just behind draft 2
    assert draft_margin(Proposal(tokens=[0, 1, 2], logits=close), 1, 3) == pytest.approx(0.1)
    assert draft_margin(Proposal(tokens=[0, 1, 2], logits=close), 0, 2) == pytest.approx(5.0)   # slot 1's draft vs 2
    # a draft vocabulary: rows are target ids 10, 11, 12, 13; a target token outside it cannot be drafted
    vocab = torch.tensor([10, 11, 12, 13])
    assert draft_margin(Proposal(tokens=[10, 11, 12], logits=close, vocab=vocab), 1, 13) == pytest.approx(0.1)
    assert draft_margin(Proposal(tokens=[10, 11, 12], logits=close, vocab=vocab), 1, 99) == pytest.approx(4.0)
    assert draft_margin(Proposal(tokens=[0, 1, 2]), 1, 3) is None       # no scores (prompt lookup): none measured
    logits = torch.tensor([[3.0, 2.5, 0.0], [1.0, 4.0, 3.9], [0.0, 0.0, 1.0]])
    assert target_margin(VerifyOutput(logits=logits), 1) == pytest.approx(0.1)    # rows 0 and 1 read
    assert target_margin(VerifyOutput(logits=logits), 0) == pytest.approx(0.5)


def test_the_decoder_records_each_steps_margins(tiny_qwen3_target, tiny_drafter):
    from transformers import AutoModelForCausalLM

    from dflash.eval.dflash_drafter import load_dflash_draft
    from dflash.eval.specdec import DecodeSettings, TargetVerifier, speculative_decode

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()
    draft = load_dflash_draft(str(tiny_drafter), model)
    result = speculative_decode(TargetVerifier(model, draft.layer_ids), draft, [1, 2, 3, 4], DecodeSettings(4, 12))
    assert len(result.draft_margins) == len(result.target_margins) == len(result.taus) > 0
    assert all(m is not None and m >= 0 for m in result.target_margins)
    assert all(m is None or m >= 0 for m in result.draft_margins)


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

    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.drafter.network import DFlashDrafter, drafter_config

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()
    torch.manual_seed(0)
    config = drafter_config(target.config, num_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=151669)
    return save_checkpoint(tmp_path_factory.mktemp("tiny-drafter"), DFlashDrafter(config).attach_target(target), 1, {})


@pytest.fixture(scope="module")
def sharp_target(tmp_path_factory, tiny_qwen3_target) -> Path:
    """The tiny target with its final norm scaled 100x: a random target's logits are nearly flat (its greedy
    token leads the next by 0.004-0.1 logits, a near-tie at every step, where no step is deterministic); these
    lead by about 100x that, as a trained model's mostly do."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("sharp") / "target"
    shutil.copytree(tiny_qwen3_target, out)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True)
    with torch.no_grad():
        model.model.norm.weight.mul_(100.0)
    model.save_pretrained(out)
    return out


STANDIN_PROMPTS = PREFIX_PROMPTS + 1       # enough for the deterministic rule to fail the gate


@pytest.fixture(scope="module")
def standin_decoders() -> Iterator[str]:
    """One DecoderHost for the module's stand-in servers (engine_standin.py `--decoder`): each server is
    still its own process on its port, started and stopped by the eval, but torch and the models load once."""
    from engine_standin import serve_decoders

    server, url = serve_decoders()
    yield url
    server.shutdown()
    server.server_close()


def standin_launch(mode: str, decoders: str) -> list[str]:
    return [sys.executable, str(STANDIN), "sglang", "--mode", mode, "--decoder", decoders]


def standin_eval(mode: str, tiny_qwen3_target: Path, checkpoint: Path, tmp_path: Path, decoders: str,
                 draft_tokens: int = 0):
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.served import evaluate_with_engine

    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"say {i} " * 5}]})
                                 for i in range(STANDIN_PROMPTS)) + "\n")
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, model=dataclasses.replace(profile.model, target=str(tiny_qwen3_target)),
                                  eval=dataclasses.replace(profile.eval, engine_port=free_port(), max_new_tokens=12,
                                                           draft_tokens=draft_tokens),
                                  paths=dataclasses.replace(profile.paths, run_dir=str(tmp_path / "run")))   # not the demo's data
    options = EvalOptions(prompts_path=str(prompts), benchmarks=())    # this set only: the benchmarks' served
    #                                             check is test_the_served_check_sends_each_benchmark_s_first_turns...
    return evaluate_with_engine(profile, tmp_path / "run", checkpoint, options, "sglang",
                                launch=standin_launch(mode, decoders))


@pytest.fixture(scope="module")
def honest_standin(sharp_target, tiny_drafter, standin_decoders, tmp_path_factory):
    """The SGLang flow against the stand-in serving the drafter as decoded: (its run's folder, the summary)."""
    folder = tmp_path_factory.mktemp("honest")
    return folder, standin_eval("honest", sharp_target, tiny_drafter, folder, standin_decoders)


@pytest.mark.slow
def test_the_sglang_gate_sends_token_ids_and_passes_a_drafter_served_as_decoded(honest_standin):
    from dflash.eval.report_schema import read_report

    tmp_path, summary = honest_standin
    report, parity = summary.report, summary.report.parity
    assert parity["target"].same_tokens_as_inprocess and parity["dflash"].same_tokens_as_inprocess
    assert parity["dflash"].within_tolerance is True and parity["dflash"].failures == []
    assert parity["dflash"].prompts_same_acceptance == parity["dflash"].prompts_same_tokens == STANDIN_PROMPTS
    assert report.methods["dflash"].mean_tau == parity["dflash"].inprocess_tau and report.methods["dflash"].identical_to_target
    assert read_report(tmp_path / "run" / "eval" / "engine-sglang.json") == report
    served = tmp_path / "run" / "eval" / "engine-sglang-drafter"
    assert report.context.served_drafter == str(served) and (served / "config.json").exists()
    assert str(served) in (tmp_path / "run" / "eval" / "logs" / "sglang-dflash.log").read_text()


@pytest.mark.slow
def test_the_sglang_gate_with_fewer_draft_tokens_than_the_block_pads_the_slots_it_does_not_draft(
        tiny_qwen3_target, tiny_drafter, standin_decoders, tmp_path):
    """eval.draft_tokens 2 of B - 1 = 3: SGLang gets a block of 3, its histogram stops at 2 accepted
    drafts; slot 3 counts as 0 accepted on both sides and the honest drafter passes."""
    summary = standin_eval("honest", tiny_qwen3_target, tiny_drafter, tmp_path, standin_decoders, draft_tokens=2)
    argv = summary.report.methods["dflash"].argv or []
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "3"
    row = summary.report.parity["dflash"]
    assert row.within_tolerance is True and row.failures == [] and row.same_tokens_as_inprocess, row.failures
    assert row.prompts_same_acceptance == row.prompts_same_tokens == STANDIN_PROMPTS
    assert len(row.served_position_acceptance or []) == len(row.inprocess_position_acceptance or []) == 3
    assert (row.served_position_acceptance or [])[2] == (row.inprocess_position_acceptance or [])[2] == 0.0


@pytest.mark.slow
def test_the_sglang_gate_fails_a_served_drafter_that_accepts_differently(sharp_target, tiny_drafter, standin_decoders,
                                                                        tmp_path):
    with pytest.raises(ParityFailed, match="prompts decoded differently where the same drafter must decode alike") as failed:
        standin_eval("extra-accept", sharp_target, tiny_drafter, tmp_path, standin_decoders)
    assert str(failed.value).splitlines()[-1].startswith("parity gate failed (deterministic prefix): read ")
    assert (tmp_path / "run" / "eval" / "engine-sglang.json").exists()       # the report is written first


@pytest.mark.slow
def test_the_sglang_gate_reads_each_steps_acceptance_from_the_stream_and_totals_where_steps_were_coalesced(
        honest_standin, sharp_target, tiny_drafter, standin_decoders, tmp_path):
    """SGLang streams a chunk per verify step with the request's running spec counters: the per-step figures
    match the in-process ones; where the stream coalesced steps the gate compares whole prompts and says it
    cannot decide."""
    from dflash.eval.report_schema import read_report

    streamed = honest_standin[1].report.parity["dflash"]
    assert streamed.within_tolerance is True and streamed.prompts_same_acceptance == STANDIN_PROMPTS
    assert (streamed.steps_before_near_tie or 0) > 0, streamed.prompts
    assert streamed.steps_before_near_tie == sum(p.first_near_tie - 1 if p.first_near_tie else p.inprocess_steps
                                                 for p in streamed.prompts or [])
    with pytest.raises(ParityFailed) as undecided:          # totals only decide nothing: undecided, not a pass
        standin_eval("coalesce", sharp_target, tiny_drafter, tmp_path, standin_decoders)
    assert undecided.value.rules == ("undecided",) and "no per-step acceptance" in str(undecided.value)
    coalesced = read_report(tmp_path / "run" / "eval" / "engine-sglang.json").parity["dflash"]   # written before
    assert coalesced.verdict == "undecided" and coalesced.failures == []
    assert coalesced.steps_before_near_tie == sum(p.inprocess_steps for p in coalesced.prompts or [] if not p.first_near_tie)


def test_vllm_from_0_32_is_asked_for_each_requests_per_step_acceptance_and_its_answer_is_read():
    from dflash.eval.engines import vllm_answer_prompt

    profile = load_profile("cpu-demo")

    def argv(method: str, version: Optional[str]) -> list[str]:
        return engine_command("vllm", profile, Path("/t"), method, Path("/d"), 8, 30100, version=version).argv

    flag = "--per-request-spec-decode-metrics"
    assert argv("dflash", "0.32.0")[argv("dflash", "0.32.0").index(flag) + 1] == "detailed"
    assert flag in argv("prompt_lookup", "0.32.0")
    assert flag not in argv("target", "0.32.0")        # vLLM refuses the flag without a speculative method
    assert flag not in argv("dflash", "0.28.0") and flag not in argv("dflash", None)
    metrics = {"mean_acceptance_length": 1.6, "draft_acceptance_rate": 0.2, "acceptance_histogram": [3, 1, 1, 0],
               "num_spec_steps": 5, "num_accepted_draft_tokens": 3, "num_draft_tokens": 15, "num_spec_tokens": 3,
               "per_step_accepted": [0, 2, 0, 1, 0], "per_step_drafted": [3, 3, 3, 3, 3]}
    answer = {"choices": [{"text": "hi", "token_ids": [5, 6, 7]}], "metrics": {"speculative_decoding": metrics}}
    served = vllm_answer_prompt(answer)
    assert served is not None and (served.token_ids, served.steps, served.accepted) == ([5, 6, 7], 5, 3)
    assert served.per_step == [0, 2, 0, 1, 0] and served.histogram == [3, 1, 1, 0]
    summary = {key: value for key, value in metrics.items() if not key.startswith("per_step")}   # `summary` level
    assert vllm_answer_prompt({**answer, "metrics": {"speculative_decoding": summary}}).per_step is None
    assert vllm_answer_prompt({"choices": answer["choices"]}) is None                          # no metrics


def test_sglang_per_step_acceptance_comes_from_the_running_counters_of_single_step_chunks():
    from dflash.eval.engines import sglang_per_step

    def meta(steps: int, accepted: int) -> dict:
        return {"spec_verify_ct": steps, "spec_num_correct_drafts": accepted} if steps else {}

    assert sglang_per_step([meta(0, 0), meta(1, 2), meta(2, 2), meta(3, 5)]) == [2, 0, 3]
    assert sglang_per_step([meta(0, 0), meta(2, 2), meta(3, 5)]) is None          # two steps in one chunk
    assert sglang_per_step([meta(0, 0), meta(1, 1), meta(1, 1), meta(2, 1)]) == [1, 0]   # a chunk with no new step
    assert sglang_per_step([meta(1, 1), meta(1, 2)]) is None                      # counters moved without a step


def test_the_pipeline_prints_the_served_speedup_beside_the_served_tau_and_the_in_process_figures():
    from dflash.eval.report_schema import EvalReport, MethodFigures
    from dflash.stages import served_line

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
    controls: an in-process side that accepted a 4th draft on 4 steps departs from it either way round,
    and the summary shows a list one side left short as 0 there."""
    from dflash.eval.engines import engine_run, vllm_served_prompt
    from dflash.eval.report_writer import position_acceptance
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
    row = method_parity("dflash", served, ours, ["a"])
    assert row.failures == [] and row.verdict == VERDICT_UNDECIDED     # no rule broken; one totals-only prompt decides nothing
    assert row.served_position_acceptance == pytest.approx(row.inprocess_position_acceptance)
    beyond = [5, 5, 5, 5, 1, 2, 1, 1, 3, 1]                        # 4 steps accepted slot 4 (and 4 drafts)
    accepted_beyond = SideFigures([PromptAcceptance([1, 2, 3], 10, 19)], histogram_of_taus(beyond),
                                  position_acceptance(beyond, 8), True)
    for one, other in ((served, accepted_beyond), (accepted_beyond, served)):      # the prompt departs either way
        assert (method_parity("dflash", one, other, ["a"]).prompts or [])[0].prefix_mismatch is not None
    short = dataclasses.replace(method_parity("dflash", served, accepted_beyond, ["a"]),
                                served_position_acceptance=[0.4, 0.2, 0.1])   # as vLLM lists them
    assert "per position 0.40/0.60 0.20/0.50 0.10/0.40 0.00/0.40 0.00/0.00 0.00/0.00 0.00/0.00 " in \
        parity_summary({"dflash": short})[1]


@pytest.mark.slow
def test_the_served_check_sends_each_benchmark_s_first_turns_and_reports_a_row_each(sharp_target, tiny_drafter,
                                                                                    standin_decoders, tmp_path):
    """`eval --engine --bench humaneval,mt-bench`: each benchmark's samples (z-lab's choice and wrapping, first
    turns as its served benchmark sends them: MT-Bench's questions have two, only the first is sent) served and
    decoded in-process, its own engine report and parity gate, and a row in the main engine report beside the
    default set."""
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.report_schema import read_report
    from dflash.eval.served import evaluate_with_engine
    from dflash.prompts.benchmarks import load_benchmark

    names = ("humaneval", "mt-bench")
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, model=dataclasses.replace(profile.model, target=str(sharp_target)),
                                  eval=dataclasses.replace(profile.eval, engine_port=free_port(), max_new_tokens=8),
                                  paths=dataclasses.replace(profile.paths, run_dir=str(tmp_path / "run")))   # not the demo's data
    summary = evaluate_with_engine(profile, tmp_path / "run", tiny_drafter,
                                   EvalOptions(num_prompts=PREFIX_PROMPTS, benchmarks=names), "sglang",
                                   launch=standin_launch("honest", standin_decoders))
    assert [brief.benchmark for brief in summary.report.also_sets] == list(names)
    for name, brief in zip(names, summary.report.also_sets):
        bench_dir = tmp_path / "run" / "eval" / "bench" / name
        bench = read_report(bench_dir / "engine-sglang.json")
        assert bench.context.prompts_file == str(bench_dir / "prompts.jsonl") and bench.num_prompts == PREFIX_PROMPTS
        assert bench.inprocess is not None and bench.inprocess.num_prompts == PREFIX_PROMPTS
        assert bench.parity["dflash"].verdict == VERDICT_PASS      # enough prompts for the gate to decide
        assert bench.parity["dflash"].same_tokens_as_inprocess and bench.methods["dflash"].identical_to_target
        sent = [json.loads(line) for line in (bench_dir / "prompts.jsonl").read_text().splitlines()]
        samples = load_benchmark(name, count=PREFIX_PROMPTS)
        assert [(r["id"], r["messages"]) for r in sent] == \
            [(p.prompt_id, [{"role": "user", "content": p.turns[0]}]) for p in samples]
        assert brief.methods["dflash"].mean_tau == bench.methods["dflash"].mean_tau
    assert all(len(p.turns) == 2 for p in load_benchmark("mt-bench", count=PREFIX_PROMPTS))   # a later turn left out
    assert "## Benchmarks (served, first turns)" in (tmp_path / "run" / "eval" / "engine-sglang.md").read_text()


CLAIM_AND_HOLD = """
import sys, time
from dflash.eval.engines import engine_port
with engine_port(int(sys.argv[1])) as port:
    print(port, flush=True)
    time.sleep(60)
"""


REPO = Path(__file__).resolve().parents[2]


def test_the_engine_servers_take_a_free_port_when_eval_engine_port_is_taken(private_cache):
    """Two `eval --engine` at once do not collide on eval.engine_port (which would stop the second with exit 5,
    "something already listens on 127.0.0.1:30100"): eval.engine_port is the first choice while no other eval has claimed it (another process holds the claim
    while its engine loads, before anything listens) and nothing listens there; otherwise a free port."""
    import socket

    from dflash.eval.engines import engine_port

    preferred = free_port()
    with engine_port(preferred) as port:
        assert port == preferred                                     # the first choice, free
    holder = subprocess.Popen([sys.executable, "-c", CLAIM_AND_HOLD, str(preferred)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout is not None
    try:
        assert int(holder.stdout.readline()) == preferred             # another eval's engine, not listening yet
        with engine_port(preferred) as port:
            assert port != preferred
    finally:
        holder.kill()
        holder.wait()
    with socket.socket() as listener:                                # something else listens on it
        listener.bind(("127.0.0.1", preferred))
        listener.listen()
        with engine_port(preferred) as port:
            assert port != preferred
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) != 0
    with engine_port(preferred) as port:
        assert port == preferred                                     # free again: the first choice again
