"""The audit, snapshot and baseline commands end to end on this machine: the live snapshot runs
and SKIPs GPU checks where there is no GPU, secrets never leak, baselines are found by host,
and the preflight records its findings in the run directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envcheck.preflight import run_preflight
from envcheck.snapshot import load_snapshot
from launcher_core.errors import PreflightFailed
from launcher_core.manifest import read_manifest
from launcher_core.profile import load_profile

SECRET = "hf_s3cr3tV4lue0123456789"
GPU_CHECKS = {"gpu.count", "torch.arch", "driver.cuda", "gpu.free_memory", "gpu.processes", "gpu.health"}


def nvml_available() -> bool:
    from envcheck.nvml_facts import collect

    return collect()[0].available


def launcher(repo_root: Path, *args: str, env_extra: dict[str, str] | None = None, tmp: Path | None = None):
    env = {**os.environ, **(env_extra or {})}
    if tmp is not None:
        env["DFLASH_BASELINE_DIR"] = str(tmp / "baselines")
    return subprocess.run([sys.executable, str(repo_root / "launcher.py"), *args], capture_output=True,
                          text=True, env=env, cwd=repo_root, timeout=300)


PLANTED = {"HF_TOKEN": SECRET, "NCCL_IB_AUTH_KEY": SECRET, "NCCL_DEBUG_FILE": f"/logs/nccl-{SECRET}.log",
           "NCCL_DEBUG": "WARN"}


@pytest.mark.skipif(nvml_available(), reason="checks the CPU-machine behaviour (no NVML)")
def test_live_audit_on_cpu_skips_gpu_checks_and_leaks_no_secret(repo_root, tmp_path):
    done = launcher(repo_root, "audit", "--profile", "rtx6000-x8", "--json", env_extra=PLANTED, tmp=tmp_path)
    assert SECRET not in done.stdout + done.stderr
    document = json.loads(done.stdout)
    status = {f["id"]: f for f in document["findings"]}
    for check_id in GPU_CHECKS:
        assert status[check_id]["status"] == "SKIP" and "NVML" in status[check_id]["message"]
    assert done.returncode in (0, 1)     # the CPU torch here fails torch.cuda for a GPU profile
    table = launcher(repo_root, "audit", env_extra=PLANTED, tmp=tmp_path)
    assert SECRET not in table.stdout + table.stderr and "SKIP" in table.stdout


def test_snapshot_file_has_facts_and_no_secret(repo_root, tmp_path):
    out = tmp_path / "snap.json"
    done = launcher(repo_root, "snapshot", "-o", str(out), env_extra=PLANTED, tmp=tmp_path)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert SECRET not in text and SECRET not in done.stdout
    snapshot = load_snapshot(out)
    assert snapshot.env["NCCL_IB_AUTH_KEY"] == "<redacted>"
    assert snapshot.env["NCCL_DEBUG_FILE"] == "/logs/nccl-<redacted>.log"
    assert snapshot.env["NCCL_DEBUG"] == "WARN" and "HF_TOKEN" not in snapshot.env
    assert snapshot.packages["pytest"] and snapshot.torch.version and snapshot.host.cpu_count >= 1
    assert snapshot.host.disks and snapshot.host.ram_total_mib > 0


def test_audit_of_saved_snapshot_against_saved_baseline(repo_root, fixtures_dir, tmp_path):
    folder = fixtures_dir / "snapshots"
    saved = launcher(repo_root, "baseline", "save", "--profile", "rtx6000-x8", "--from", str(folder / "rtx6000-x8-baseline.json"), tmp=tmp_path)
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "baselines" / "rtx6000-x8" / "gpu-node-07.json").exists()
    done = launcher(repo_root, "audit", "--profile", "rtx6000-x8", "--snapshot", str(folder / "rtx6000-x8-cu130-upgrade.json"), tmp=tmp_path)
    assert done.returncode == 1
    assert "FAIL" in done.stdout and "GPU 6 (" in done.stdout and "204 MiB less free" in done.stdout
    healthy = [repo_root, "audit", "--profile", "rtx6000-x8", "--snapshot", str(folder / "rtx6000-x8-baseline.json")]
    assert launcher(*healthy, tmp=tmp_path).returncode == 0
    strict = launcher(*healthy, "--strict", tmp=tmp_path)        # it serves from SGLang's own venv (engine setup)
    assert strict.returncode == 0 and "0 FAIL, 0 WARN" in strict.stdout, strict.stdout


def test_audit_strict_passes_on_the_flagship_node_once_sglangs_own_venv_is_built(repo_root, fixtures_dir, tmp_path):
    """rtx6000-x8 trains on the cu128 set, whose SGLang has no DFLASH: before `launcher.py engine setup sglang`
    the strict audit exits 3, naming the command; with the venv built (recorded in the snapshot) it exits 0."""
    folder = fixtures_dir / "snapshots"
    fresh = launcher(repo_root, "audit", "--strict", "--profile", "rtx6000-x8", "--snapshot",
                     str(folder / "rtx6000-x8-fresh.json"), tmp=tmp_path)
    assert fresh.returncode == 3 and "0 FAIL, 1 WARN" in fresh.stdout, fresh.stdout
    assert "engine.sglang" in fresh.stdout and "run `launcher.py engine setup sglang`" in fresh.stdout
    built = launcher(repo_root, "audit", "--strict", "--profile", "rtx6000-x8", "--snapshot",
                     str(folder / "rtx6000-x8-baseline.json"), "--json", tmp=tmp_path)
    assert built.returncode == 0, built.stdout
    [sglang] = [f for f in json.loads(built.stdout)["findings"] if f["id"] == "engine.sglang"]
    assert sglang["status"] == "PASS" and sglang["message"].startswith("sglang 0.5.19 (engine venv sglang-")


def test_baseline_diff_of_two_snapshots(repo_root, fixtures_dir, tmp_path):
    folder = fixtures_dir / "snapshots"
    done = launcher(repo_root, "baseline", "diff", str(folder / "rtx6000-x8-baseline.json"), str(folder / "rtx6000-x8-cu130-upgrade.json"), "--json")
    changes = {(c["section"], c["subject"]): c for c in json.loads(done.stdout)}
    assert changes[("torch", "CUDA")]["after"] == "13.0"
    assert changes[("packages", "torch")]["after"] == "2.9.1+cu130"
    assert changes[("gpu", "GPU 6 free MiB")]["after"] == "97152 (-204)"
    assert changes[("gpu", "GPU 0 context MiB")]["after"] == "636 (+38)"
    assert changes[("env", "CUDA_HOME")]["before"] == "/usr/local/cuda-12.8"


def test_bad_snapshot_file_is_a_usage_error(repo_root, tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{\n  \"schema_version\": 1,\n")
    done = launcher(repo_root, "audit", "--snapshot", str(bad))
    assert done.returncode == 2 and "broken.json: line 3" in done.stderr


def test_preflight_records_findings_and_refuses_unless_forced(fixtures_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_BASELINE_DIR", str(tmp_path / "baselines"))
    profile = load_profile("rtx6000-x8")
    stale = load_snapshot(fixtures_dir / "snapshots" / "rtx6000-x8-stale-process.json")
    run_dir = tmp_path / "run"
    with pytest.raises(PreflightFailed, match=r"(?s)gpu.processes: GPU 3: process 48213.*--force"):
        run_preflight(profile, run_dir=run_dir, snapshot=stale)
    assert read_manifest(run_dir)["stages"]["audit"]["state"] == "failed"
    findings = run_preflight(profile, run_dir=run_dir, snapshot=stale, force=True)
    recorded = json.loads((run_dir / "audit" / "findings.json").read_text())
    assert recorded["forced"] is True and recorded["counts"]["FAIL"] == len([f for f in findings if f.status == "FAIL"]) > 0
    stage = read_manifest(run_dir)["stages"]["audit"]
    assert stage["state"] == "done" and stage["fail"] > 0


def test_audit_does_not_import_torch_in_the_launcher_process(repo_root):
    code = ("import sys, launcher; rc = launcher.main(['audit', '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('rc', rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "rc " in done.stdout
