"""scripts/gpu_check.py on a machine without a GPU: every part is listed (one per tests/gpu file),
the CPU-capable parts pass, the GPU-only parts are skipped with their reason, and the report is
complete; the default items' budgets are docs/gpu_check.md's budget table and sum to at most 8 minutes.

The whole script runs once with `--parts all` (GPUs hidden with --cpu, so it is the CPU path even on a GPU node); a
test part runs its pytest child on the CPU (skipped by tests/gpu/conftest.py, reason collected
from the JUnit report); the runner's time-limit handling is checked on a real child process.
Its CPU counterparts are ordinary tests: flex vs SDPA in float32 in tests/train/test_drafter.py, lossless
speculative decoding in tests/eval/test_specdec.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
GPU_TESTS = SCRIPT.parent.parent / "tests" / "gpu"
DEFAULT_ITEMS = ["environment", "calibrate", "train", "async_save", "flight_recorder", "materialize", "served_twin"]
KNOWN_EXTRA_PARTS = ["drills", "eval"]
OTHER_TEST_PARTS = sorted(p.stem.removeprefix("test_").removesuffix("_gpu") for p in GPU_TESTS.glob("test_*_gpu.py")
                          if p.stem.removeprefix("test_").removesuffix("_gpu") not in DEFAULT_ITEMS + KNOWN_EXTRA_PARTS)
ALL_PARTS = [*DEFAULT_ITEMS, "audit", *KNOWN_EXTRA_PARTS, *OTHER_TEST_PARTS]
GPU_ONLY = set(ALL_PARTS) - {"environment", "audit"}


def import_script():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    return gpu_check


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--cpu", "--parts", "all"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    report = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))
    return done, report, out


def parts_by_name(report):
    return {part["name"]: part for part in report["parts"]}


def checks_of(part):
    return {check["name"]: check for check in part["checks"]}


def test_every_part_is_listed_ok_or_skipped_with_a_reason(cpu_run):
    done, report, _ = cpu_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [part["name"] for part in report["parts"]] == ALL_PARTS
    for part in report["parts"]:
        assert part["status"] in ("ok", "skipped"), (part["name"], part.get("reason"))
        if part["status"] == "skipped":
            assert part["reason"], part["name"]
        assert all(check["ok"] for check in part["checks"] if check["required"]), part
    assert report["ok"] is True and report["machine"]["cuda_available"] is False


def test_gpu_only_parts_are_skipped_without_a_gpu(cpu_run):
    _, report, _ = cpu_run
    parts = parts_by_name(report)
    for name in GPU_ONLY:
        assert parts[name]["status"] == "skipped"
        assert "CUDA" in parts[name]["reason"] and parts[name]["checks"] == []
    for name in set(ALL_PARTS) - GPU_ONLY:
        assert parts[name]["status"] == "ok", parts[name]


def test_environment_records_versions(cpu_run):
    _, report, _ = cpu_run
    import torch

    machine = report["machine"]
    assert machine["torch"] == torch.__version__ and machine["torch_cuda"] == torch.version.cuda
    assert machine["packages"]["transformers"] and machine["python"].count(".") == 2


def test_audit_part_ran_the_launcher_without_the_probe(cpu_run):
    _, report, out = cpu_run
    audit = parts_by_name(report)["audit"]
    snapshot = json.loads((out / "snapshot.json").read_text(encoding="utf-8"))
    findings = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    assert snapshot["gpus"] == [] and not snapshot.get("cuda_probe_ran")
    assert findings["profile"] == "cpu-demo" and findings["counts"] == audit["figures"]["audit_counts"]
    assert checks_of(audit)["snapshot written"]["ok"] and checks_of(audit)["audit ran"]["ok"]
    assert any(item.startswith("CUDA probe") for item in audit["skipped"])


def test_every_file_in_tests_gpu_is_a_part_run_by_pytest():
    gpu_check = import_script()
    files = sorted(GPU_TESTS.glob("test_*_gpu.py"))
    assert {spec.test_file for spec in gpu_check.PARTS if spec.test_file} == set(files)
    assert [spec.name for spec in gpu_check.PARTS] == ALL_PARTS
    spec = gpu_check.PART_BY_NAME["calibrate"]
    argv = gpu_check.pytest_command(spec, Path("OUT"))
    assert argv[1:6] == ["-m", "pytest", "-m", "gpu", str(GPU_TESTS / "test_calibrate_gpu.py")]
    assert "--junitxml=OUT/parts/calibrate.xml" in argv and "addopts=" in argv


def test_a_test_part_on_the_cpu_is_skipped_by_the_conftest_with_its_reason(tmp_path):
    """The real pytest child, its JUnit report and the recorded-figures file, without a GPU."""
    gpu_check = import_script()
    args = gpu_check.parse_args([str(tmp_path), "--cpu"])
    (tmp_path / "parts").mkdir()
    log = gpu_check.RunLog(tmp_path / "gpu_check.log")
    result = gpu_check.run_test_part(gpu_check.PART_BY_NAME["calibrate"], args, 240, log)
    assert result["status"] == "skipped" and "CUDA" in result["reason"], result
    assert result["checks"] == [] and result["tests"] and {t["outcome"] for t in result["tests"]} == {"skipped"}
    assert json.loads((tmp_path / "parts" / "calibrate.json").read_text())["status"] == "skipped"
    assert "----- part calibrate -----" in (tmp_path / "gpu_check.log").read_text()


def test_test_part_results_from_outcomes_and_recorded_figures(tmp_path):
    gpu_check = import_script()
    spec, log = gpu_check.PART_BY_NAME["train"], tmp_path / "train.log"
    log.write_text("last words\n")
    case = gpu_check.CaseOutcome
    recorded = {"summary": "60 steps", "figures": {"train_steps": 60},
                "checks": [{"name": "losses finite", "ok": True, "required": True, "detail": "60 steps"}], "skipped": []}
    passed = gpu_check.gpu_test_result(spec, [case("a", "passed", ""), case("b", "skipped", "why")], recorded, 0, False, log)
    assert passed["status"] == "ok" and passed["summary"] == "60 steps" and passed["figures"] == {"train_steps": 60}
    assert [c["name"] for c in passed["checks"]] == ["losses finite", "test a"] and passed["skipped"] == ["b: why"]
    failed = gpu_check.gpu_test_result(spec, [case("a", "failed", "assert 1 > 2")], recorded, 1, False, log)
    assert failed["status"] == "failed" and "a: assert 1 > 2" in failed["reason"]
    crashed = gpu_check.gpu_test_result(spec, [], {}, 2, False, log)
    assert crashed["status"] == "failed" and "last words" in crashed["reason"]
    killed = gpu_check.gpu_test_result(spec, [], recorded, -9, True, log)
    assert killed["status"] == "timeout" and killed["figures"] == {"train_steps": 60}


def test_junit_reports_are_read_case_by_case(tmp_path):
    gpu_check = import_script()
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite><testcase name="ok"/><testcase name="bad"><failure message="boom">x'
                      '</failure></testcase><testcase name="gone"><skipped message="needs a CUDA GPU"/></testcase>'
                      '</testsuite></testsuites>')
    assert [(o.name, o.outcome, o.message) for o in gpu_check.read_junit(report)] == [
        ("ok", "passed", ""), ("bad", "failed", "boom"), ("gone", "skipped", "needs a CUDA GPU")]
    assert gpu_check.read_junit(tmp_path / "missing.xml") == []


def test_log_holds_every_part_and_the_table_is_printed_last(cpu_run):
    done, report, out = cpu_run
    log = (out / "gpu_check.log").read_text(encoding="utf-8")
    for name in set(ALL_PARTS) - GPU_ONLY:
        assert f"----- part {name} -----" in log
        assert (out / "parts" / f"{name}.log").exists()
    table = done.stdout.strip().splitlines()[-(len(ALL_PARTS) + 3):]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert rows[0] == ["item", "status", "budget s", "wall s", "result"] and rows[1][0] == "---"
    assert [row[0] for row in rows[2:-1]] == ALL_PARTS and rows[-1][0] == "total"
    assert [row[1] for row in rows[2:-1]] == [parts_by_name(report)[n]["status"] for n in ALL_PARTS]
    assert (out / "gpu_check.md").read_text(encoding="utf-8") == "\n".join(table) + "\n"


def budget_table() -> dict[str, int]:
    """docs/gpu_check.md's budget table: item -> seconds (its total row apart)."""
    text = (SCRIPT.parent.parent / "docs" / "gpu_check.md").read_text(encoding="utf-8")
    section = text[text.index("## Budget"):]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    return {row[0].strip("`"): int(row[2].removesuffix(" s")) for row in rows}


def test_the_default_items_fit_8_minutes_each_within_its_budget():
    """The budget table in docs/gpu_check.md is the script's (each item's budget is its time limit), it sums to at
    most 8 minutes with the report's reserve, and the default run is those items in that order."""
    gpu_check = import_script()
    assert list(gpu_check.DEFAULT_ITEMS) == DEFAULT_ITEMS
    assert budget_table() == gpu_check.DEFAULT_ITEMS
    assert {name: gpu_check.PART_BY_NAME[name].limit_s for name in DEFAULT_ITEMS} == gpu_check.DEFAULT_ITEMS
    assert sum(gpu_check.DEFAULT_ITEMS.values()) + gpu_check.RESERVE_S <= gpu_check.DEFAULT_BUDGET_S <= 8 * 60
    assert [spec.name for spec in gpu_check.selected_parts(gpu_check.parse_args(["out"]).parts)] == DEFAULT_ITEMS


def test_parts_are_skipped_when_a_module_or_the_time_budget_is_missing():
    gpu_check = import_script()

    spec = gpu_check.PartSpec("x", "needs a module that is not there", 10, False, ("no_such_module_here",))
    assert "no_such_module_here" in gpu_check.why_not_run(spec, "yes", 100.0)
    gpu_part = gpu_check.PART_BY_NAME["drills"]
    assert "CUDA" in gpu_check.why_not_run(gpu_part, "no", 100.0)
    assert "time budget" in gpu_check.why_not_run(gpu_check.PART_BY_NAME["environment"], "yes", 5.0)
    assert gpu_check.why_not_run(gpu_check.PART_BY_NAME["environment"], "yes", 100.0) == ""


def test_the_readme_says_under_the_commands_that_nothing_has_run_on_a_gpu_and_how_to_check_a_node():
    readme = (SCRIPT.parent.parent / "README.md").read_text(encoding="utf-8")
    commands = readme[readme.index("## Commands"):readme.index("## GPU nodes")]
    assert "**What has run on a GPU: none of it yet.**" in commands
    assert "`python scripts/gpu_check.py OUT_DIR`" in commands and "under 8 minutes" in commands
