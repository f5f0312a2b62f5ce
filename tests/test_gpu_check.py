"""scripts/gpu_check.py on a machine without a GPU: every part is listed, the CPU-capable parts
pass, the GPU-only parts are skipped with their reason, and the report is complete.

The whole script runs once (GPUs hidden with --cpu, so it is the CPU path even on a GPU node);
the runner's time-limit handling is checked on a real child process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
ALL_PARTS = ["environment", "audit", "calibrate", "train", "drills", "eval"]
GPU_ONLY = {"calibrate", "drills"}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--cpu"], capture_output=True, text=True,
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


def test_train_part_compares_flex_with_sdpa_in_float32(cpu_run):
    _, report, _ = cpu_run
    train = parts_by_name(report)["train"]
    compared = train["figures"]["flex_vs_sdpa"]
    assert checks_of(train)["flex vs SDPA loss"]["ok"]
    assert compared["loss_rel_diff"] <= 1e-4 and compared["flex_loss"] > 0
    assert any(item.startswith("bf16 flex_attention training") for item in train["skipped"])
    assert any(item.startswith("flex vs SDPA gradients") for item in train["skipped"])


def test_eval_part_decodes_losslessly_and_reports_tau(cpu_run):
    _, report, out = cpu_run
    evaluation = parts_by_name(report)["eval"]
    methods = evaluation["figures"]["float32"]
    assert set(methods) == {"target", "dflash", "prompt_lookup", "oracle_corrupted"}
    for name in ("dflash", "prompt_lookup", "oracle_corrupted"):
        assert methods[name]["identical_to_target"] is True
    assert methods["oracle_corrupted"]["mean_tau"] > 1.5      # drafts accepted and rolled back
    decoded = json.loads((out / "eval_report.json").read_text(encoding="utf-8"))
    assert decoded["methods"]["target"]["new_tokens"] > 0


def test_log_holds_every_part_and_the_table_is_printed_last(cpu_run):
    done, report, out = cpu_run
    log = (out / "gpu_check.log").read_text(encoding="utf-8")
    for name in set(ALL_PARTS) - GPU_ONLY:
        assert f"----- part {name} -----" in log
        assert (out / "parts" / f"{name}.log").exists()
    tail = done.stdout.strip().splitlines()[-(len(ALL_PARTS) + 2):]
    assert tail[0].split() == ["part", "status", "wall", "s", "result"]
    assert [line.split()[0] for line in tail[2:]] == ALL_PARTS
    assert [line.split()[1] for line in tail[2:]] == [parts_by_name(report)[n]["status"] for n in ALL_PARTS]


def test_an_overrunning_child_is_killed_with_its_process_group(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    started = time.monotonic()
    assert gpu_check.wait_or_kill(child, 1.0) is True
    assert time.monotonic() - started < gpu_check.KILL_GRACE_S + 5
    assert child.returncode is not None
    assert not alive(int(pid_file.read_text()))              # the grandchild went with the group


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_parts_are_skipped_when_a_module_or_the_time_budget_is_missing():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    spec = gpu_check.PartSpec("x", "needs a module that is not there", 10, False, ("no_such_module_here",))
    assert "no_such_module_here" in gpu_check.why_not_run(spec, "yes", 100.0)
    gpu_part = gpu_check.PART_BY_NAME["drills"]
    assert "CUDA" in gpu_check.why_not_run(gpu_part, "no", 100.0)
    assert "time budget" in gpu_check.why_not_run(gpu_check.PART_BY_NAME["environment"], "yes", 5.0)
    assert gpu_check.why_not_run(gpu_check.PART_BY_NAME["environment"], "yes", 100.0) == ""
