"""Report figures from known decode runs: tau, histogram, per-position acceptance, speedup."""
from __future__ import annotations

import pytest

from dflash.eval.report import MethodRun, PromptRuns, build_report, render_markdown


def runs() -> list[PromptRuns]:
    first = PromptRuns("a", 10, {"target": MethodRun([1, 2, 3, 4, 5], [1, 1, 1, 1], 1.0),
                                 "dflash": MethodRun([1, 2, 3, 4, 5], [3, 1], 0.5)})
    second = PromptRuns("b", 12, {"target": MethodRun([7, 8, 9], [1, 1], 1.0),
                                  "dflash": MethodRun([7, 8, 0], [2], 1.0)})
    return [first, second]


def test_overall_and_per_prompt_figures():
    report = build_report(runs(), block_size=3, temperature=0.0, context={"profile": "p"})
    dflash = report["methods"]["dflash"]
    assert dflash["mean_tau"] == pytest.approx(2.0)                    # (3 + 1 + 2) / 3 steps
    assert dflash["tau_histogram"] == {"1": 1, "2": 1, "3": 1}
    assert dflash["position_acceptance"] == pytest.approx([2 / 3, 1 / 3])
    assert dflash["tokens_per_s"] == pytest.approx(8 / 1.5)
    assert dflash["speedup"] == pytest.approx((8 / 1.5) / (8 / 2.0))
    assert dflash["identical_to_target"] is False                      # prompt b differs
    assert report["methods"]["target"]["speedup"] == 1.0
    per_prompt = {p["id"]: p["methods"]["dflash"] for p in report["prompts"]}
    assert per_prompt["a"]["speedup"] == pytest.approx(2.0) and per_prompt["a"]["identical_to_target"] is True
    assert per_prompt["b"]["identical_to_target"] is False


def test_sampling_reports_no_identity_claim():
    report = build_report(runs(), block_size=3, temperature=0.8, context={})
    assert report["methods"]["dflash"]["identical_to_target"] is None


def test_markdown_has_the_tables():
    text = render_markdown(build_report(runs(), block_size=3, temperature=0.0, context={"profile": "p"}))
    assert "| dflash | 2.00 | 3 | 8 |" in text
    assert "| 1 | 0.67 |" in text          # acceptance at position 1
    assert "| b | 12 | 3 | 2.00 |" in text
