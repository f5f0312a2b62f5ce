"""The parity gate's constants come from its measured error rates: `choose_constants` of
benchmarks/bench_parity_gate.py, run on the committed records of the real vLLM CPU engine at the recorded
setting (1,000 sets of 16 prompts, seed 0), chooses exactly the constants dflash/eval/parity.py holds, and at
them every drafter served as trained fails at most 1 % of the sets and every negative control is caught in at
least 99 %. A constant changed by hand, or records changed without the constants, fails here."""
from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_parity_gate", REPO / "benchmarks" / "bench_parity_gate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_parity_gate"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured(bench):
    import numpy as np

    with gzip.open(bench.RECORDS, "rt", encoding="utf-8") as stream:
        records = json.load(stream)
    sets = np.asarray(bench.prompt_sets(len(records["prompt_ids"]), 16, 1000, 0))
    true_pairs, controls = bench.load_pairs(records, bench.TRUE_PAIRS), bench.load_pairs(records, bench.CONTROL_PAIRS)
    return true_pairs, controls, sets


def test_the_records_hold_every_drafter_and_control_on_at_least_64_prompts(measured):
    true_pairs, controls, _ = measured
    assert [p.name for p in true_pairs] == ["final", "early", "sliding", "weak"]
    assert len(controls) == 5 and all(len(p.served_prompts) >= 64 for p in [*true_pairs, *controls])
    assert all(p.served_prompts[0].per_step is not None for p in [*true_pairs, *controls])   # vLLM's per-step figures


def test_the_gate_s_constants_are_the_ones_its_measurements_choose(bench, measured):
    from dflash.eval.parity import GateConstants

    true_pairs, controls, sets = measured
    chosen = bench.choose_constants(bench.sweep(true_pairs, controls, sets, 16))
    assert chosen.constants == GateConstants()
    assert chosen.false_failure <= bench.FALSE_FAILURE_TARGET and chosen.detection >= bench.DETECTION_TARGET


def test_at_the_constants_the_production_gate_meets_both_targets_on_every_pair(bench, measured):
    from dflash.eval.parity import GateConstants

    true_pairs, controls, sets = measured
    for pair in true_pairs:
        assert bench.gate_on_sets(pair, sets[:200], GateConstants()).rate <= bench.FALSE_FAILURE_TARGET, pair.name
    for pair in controls:
        assert bench.gate_on_sets(pair, sets[:200], GateConstants()).rate >= bench.DETECTION_TARGET, pair.name
