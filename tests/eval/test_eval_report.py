"""Report figures from known decode runs (tau, histogram, per-position acceptance, speedup), and the
report's records: what the writer puts on disk is what every reader gets back, reports written
before `report_version` (tests/fixtures/eval/*-v1.json, made by that launcher) still read, and a
bad field is named with its file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dflash.eval.report_schema import (
    REPORT_VERSION,
    Departure,
    EvalReport,
    MethodFigures,
    ParityRow,
    PromptFigures,
    PromptParity,
    ReportContext,
    SetBrief,
    read_report,
)
from dflash.eval.report_writer import MethodRun, PromptRuns, build_report, render_markdown
from launcher_core.errors import InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval"


def runs() -> list[PromptRuns]:
    first = PromptRuns("a", 10, {"target": MethodRun([1, 2, 3, 4, 5], [1, 1, 1, 1], 1.0),
                                 "dflash": MethodRun([1, 2, 3, 4, 5], [3, 1], 0.5)})
    second = PromptRuns("b", 12, {"target": MethodRun([7, 8, 9], [1, 1], 1.0),
                                  "dflash": MethodRun([7, 8, 0], [2], 1.0)})
    return [first, second]


def test_overall_and_per_prompt_figures():
    report = build_report(runs(), block_size=3, temperature=0.0, context=ReportContext(profile="p"))
    dflash = report.methods["dflash"]
    assert dflash.mean_tau == pytest.approx(2.0)                    # (3 + 1 + 2) / 3 steps
    assert dflash.tau_histogram == {"1": 1, "2": 1, "3": 1}
    assert dflash.position_acceptance == pytest.approx([2 / 3, 1 / 3])
    assert dflash.tokens_per_s == pytest.approx(8 / 1.5)
    assert dflash.speedup == pytest.approx((8 / 1.5) / (8 / 2.0))
    assert dflash.identical_to_target is False                      # prompt b differs
    assert report.methods["target"].speedup == 1.0
    per_prompt = {p.prompt_id: p.methods["dflash"] for p in report.prompts}
    assert per_prompt["a"].speedup == pytest.approx(2.0) and per_prompt["a"].identical_to_target is True
    assert per_prompt["b"].identical_to_target is False


def test_sampling_reports_no_identity_claim():
    report = build_report(runs(), block_size=3, temperature=0.8)
    assert report.methods["dflash"].identical_to_target is None


def test_markdown_has_the_tables():
    text = render_markdown(build_report(runs(), block_size=3, temperature=0.0, context=ReportContext(profile="p")))
    assert "| dflash | 2.00 | 3 | 8 |" in text
    assert "| 1 | 0.67 |" in text          # acceptance at position 1
    assert "| b | 12 | 3 | 2.00 |" in text


def through_disk(report: EvalReport, tmp_path: Path) -> EvalReport:
    return read_report(report.write_json(tmp_path / "report.json"))


def test_the_in_process_report_reads_back_as_written(tmp_path):
    report = build_report(runs(), block_size=3, temperature=0.0, context=ReportContext(profile="p", seed=3, torch_threads=1))
    extra = build_report(runs()[:1], block_size=3, temperature=0.0, context=ReportContext(prompt_set="extra (x.jsonl)"))
    report = dataclasses.replace(report, also_sets=[SetBrief.of(extra, tmp_path / "x" / "report.json")])
    document = json.loads(report.write_json(tmp_path / "report.json").read_text())
    assert document["report_version"] == REPORT_VERSION and document["profile"] == "p" and document["torch_threads"] == 1
    assert "engine" not in document and "parity" not in document and "tau_source" not in document["methods"]["dflash"]
    assert set(document["also_sets"][0]["methods"]["dflash"]) == {"mean_tau", "speedup", "tokens_per_s", "identical_to_target",
                                                                  "position_acceptance"}
    assert "benchmark" not in document["also_sets"][0]
    assert read_report(tmp_path / "report.json") == report


def every_field_set(record: object) -> bool:
    return all(getattr(record, item.name) not in (None, [], {}) for item in dataclasses.fields(record))


def test_every_field_of_every_record_survives_the_disk(tmp_path):
    """A field added to a record but not to its reader (or writer) fails here."""
    method = MethodFigures(mean_tau=2.5, tokens_per_s=9.0, speedup=1.4, identical_to_target=True, new_tokens=12,
                           steps=5, wall_s=1.5, tau_histogram={"1": 2, "2": 3}, position_acceptance=[0.6, 0.2],
                           tau_source="vllm (engine-reported)", argv=["python", "-m", "vllm"],
                           candidate_recall=[0.9, None], selector_overrides=[0.25, 0.0])
    row = ParityRow(2.5, 2.45, [0.6, 0.2], [0.6, 0.25], True, True, False, "prompt 1 (a), new token 3: served 7, in-process 8",
                    True, False, served_steps=40, inprocess_steps=41, prompts_same_tokens=5, prompts_same_acceptance=4,
                    steps_before_near_tie=17, prompts_fewer=3, prompts_more=1, p_value=0.625,
                    failed_rules=["deterministic prefix"], failures=["1 of 5 prompts decoded differently ..."],
                    conclusive=True, prompts=[PromptParity("a", 10, 4, 11, 5, 3, "step 2 ...",
                                                           Departure(2, 3, 0, 1, 0.42, 0.9, [17, 4, 4], [17, 99]))],
                    verdict="fail", undecided=["3 prompt(s): ..."], rules_ran=["lossless: ..."])
    context = ReportContext("p", "t", "c", 3, "x.jsonl", "your prompts (x.jsonl)", 16, 2, "eval/engine-vllm-drafter",
                            "one cached forward a token", "thinking off (--thinking), chat template 872be49d",
                            "mode mismatch (on purpose, --allow-mode-mismatch): thinking: ...",
                            "vLLM's CPU build norms every draft layer's context keys with layer 0's k_norm weight")
    inner = EvalReport(3, 0.0, 1, {"dflash": method})
    report = EvalReport(3, 0.5, 2, {"target": method, "dflash": method}, context, "vllm",
                        [PromptFigures("a", 10, {"dflash": method})], [SetBrief("s", "x.jsonl", 1, "r.json", {"dflash": method}, "humaneval")],
                        {"dflash": row}, inner)
    for record in (method, row, (row.prompts or [])[0], ((row.prompts or [])[0]).departure, context, report, report.prompts[0], report.also_sets[0]):
        assert every_field_set(record), record
    assert through_disk(report, tmp_path) == report


def test_reports_written_before_the_version_field_still_read(tmp_path):
    old = json.loads((FIXTURES / "report-v1.json").read_text())
    report = read_report(FIXTURES / "report-v1.json")
    assert "report_version" not in old
    assert report.methods["dflash"].mean_tau == old["methods"]["dflash"]["mean_tau"] == pytest.approx(2.5)   # (3+2+1+4) / 4 steps
    assert report.context.prompt_set == old["prompt_set"] and report.prompts[1].prompt_id == "everyday-01-code"
    assert report.also_sets[0].methods["dflash"].mean_tau == old["also_sets"][0]["methods"]["dflash"]["mean_tau"]
    assert report.to_json() == {**old, "report_version": REPORT_VERSION}      # an in-process report: the same keys


def test_an_old_engine_report_with_parity_still_reads():
    old = json.loads((FIXTURES / "engine-vllm-v1.json").read_text())
    report = read_report(FIXTURES / "engine-vllm-v1.json")
    assert report.engine == "vllm" and report.context.served_drafter == old["served_drafter"]
    assert report.methods["dflash"].argv == old["methods"]["dflash"]["argv"]
    assert report.parity["dflash"].within_tolerance is False and report.parity["dflash"].served_tau == pytest.approx(2.25)
    assert report.inprocess is not None and report.inprocess.methods["dflash"].mean_tau == old["inprocess"]["methods"]["dflash"]["mean_tau"]
    assert EvalReport.from_json(report.to_json(), "again") == report


def write_document(tmp_path: Path, change) -> Path:
    document = json.loads((FIXTURES / "report-v1.json").read_text())
    change(document)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("change,message", [
    (lambda d: d["methods"]["dflash"].update(mean_tau="fast"), r"field methods\.dflash\.mean_tau: expected a number or null, got 'fast'"),
    (lambda d: d.pop("block_size"), r"field block_size: expected a whole number, it is missing"),
    (lambda d: d["prompts"][1]["methods"]["target"].update(new_tokens=2.5), r"field prompts\[1\]\.methods\.target\.new_tokens: expected a whole number"),
    (lambda d: d.update(methods={}), r"field methods: expected an object with one entry per method"),
    (lambda d: d.update(report_version=REPORT_VERSION + 1), r"field report_version: expected a version up to"),
])
def test_a_bad_report_names_the_file_and_the_field(tmp_path, change, message):
    path = write_document(tmp_path, change)
    with pytest.raises(InputError, match=message) as raised:
        read_report(path)
    assert str(path) in str(raised.value)


def test_a_report_that_is_not_an_object_or_not_json_is_named(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InputError, match=r"list\.json: the document: expected a JSON object"):
        read_report(tmp_path / "list.json")
    (tmp_path / "torn.json").write_text('{"methods": ')
    with pytest.raises(InputError, match=r"torn\.json: line 1: not valid JSON"):
        read_report(tmp_path / "torn.json")


def test_the_pipeline_summary_puts_in_process_and_served_figures_side_by_side(tmp_path):
    from dflash.commands.pipeline import side_by_side

    def report(dflash: tuple[float, float], lookup: tuple[float, float], rate: float, **extra: object) -> EvalReport:
        figures = {"target": MethodFigures(1.0, rate, 1.0, None),
                   "dflash": MethodFigures(dflash[0], rate * dflash[1], dflash[1], True),
                   "prompt_lookup": MethodFigures(lookup[0], rate * lookup[1], lookup[1], True)}
        return EvalReport(8, 0.0, 16, figures, ReportContext(prompt_set="out-of-template held-out (e.jsonl)",
                                                             baseline=f"how {extra.get('engine') or 'in-process'}"),
                          **extra)

    (tmp_path / "eval").mkdir()
    report((1.381, 1.05), (1.224, 0.96), 11.1).write_json(tmp_path / "eval" / "report.json")
    lines = side_by_side(tmp_path, "vllm")
    assert lines[0] == "in-process, 16 prompts, out-of-template held-out (e.jsonl):"        # nothing served yet
    assert lines[2].split() == ["DFlash", "1.381", "1.05x"] and "how in-process" in lines[-1]
    report((1.38, 1.12), (1.97, 0.87), 24.9, engine="vllm").write_json(tmp_path / "eval" / "engine-vllm.json")
    lines = side_by_side(tmp_path, "vllm")
    assert lines[0].startswith("in-process and served, 16 prompts") and "served (vllm) tau" in lines[1]
    assert lines[2].split() == ["DFlash", "1.381", "1.05x", "1.380", "1.12x"]
    assert lines[3].split() == ["prompt", "lookup", "1.224", "0.96x", "1.970", "0.87x"]
    assert lines[4].split() == ["target", "alone", "-", "1.00x", "(11.1", "tok/s)", "-", "1.00x", "(24.9", "tok/s)"]
    assert lines[-2:] == ["  in-process: how in-process", "  served: how vllm"]
    assert side_by_side(tmp_path / "missing", "vllm") == []
