"""The checks on recorded snapshots of real machine kinds: each yields the right FAIL, naming
the GPU or the package; healthy nodes pass."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from envcheck import checks, findings_format
from envcheck.preflight import audit
from envcheck.snapshot import GpuProcess, Snapshot, load_snapshot
from launcher_core.errors import EXIT_FAIL, EXIT_OK, EXIT_WARN_STRICT, InputError
from launcher_core.profile import load_profile


@pytest.fixture(scope="module")
def snapshots(fixtures_dir):
    folder = fixtures_dir / "snapshots"
    return {path.stem: load_snapshot(path) for path in folder.glob("*.json")}


@pytest.fixture(scope="module")
def rtx():
    return load_profile("rtx6000-x8")


def sglang_finding(findings) -> str:
    return next(f.message for f in findings if f.id == "engine.sglang")


def served_apart(profile):
    """The profile serving its drafter from a requirements-cu130.txt environment (eval.engine_python)."""
    return dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_python="/envs/cu130/bin/python"))


def fails(findings, check_id=None):
    return [f for f in findings if f.status == "FAIL" and (check_id is None or f.id == check_id)]


def test_healthy_baseline_node_has_no_fail_nor_warn_and_serves_from_sglangs_own_venv(snapshots, rtx):
    """The baseline node trains on the cu128 set, whose SGLang (0.5.10.post1) has no DFLASH, and serves the
    drafter from SGLang's own venv (`launcher.py engine setup sglang`, recorded in the snapshot)."""
    base = snapshots["rtx6000-x8-baseline"]
    findings = audit(rtx, base, baseline=base)
    assert [f for f in findings if f.status in ("FAIL", "WARN")] == []
    assert sglang_finding(findings).startswith("sglang 0.5.19 (engine venv sglang-")
    assert {f.id for f in findings if f.status == "PASS"} >= {"gpu.count", "torch.arch", "toolkit.nvcc", "packages.pins",
                                                              "baseline.memory", "engine.sglang"}


def test_the_same_node_before_engine_setup_warns_only_that_its_sglang_cannot_serve_the_drafter(snapshots, rtx):
    fresh = snapshots["rtx6000-x8-fresh"]
    findings = audit(rtx, fresh, baseline=fresh)
    [warning] = [f for f in findings if f.status in ("FAIL", "WARN")]
    assert warning.id == "engine.sglang" and warning.status == "WARN"
    assert "sglang 0.5.10.post1 (installed) would not serve profile rtx6000-x8" in warning.message
    assert warning.hint.startswith("run `launcher.py engine setup sglang`")
    assert [f for f in audit(served_apart(rtx), fresh, baseline=fresh) if f.status in ("FAIL", "WARN")] == []


def test_cu130_upgrade_fails_on_gpu6_free_memory_only(snapshots, rtx):
    findings = audit(rtx, snapshots["rtx6000-x8-cu130-upgrade"], baseline=snapshots["rtx6000-x8-baseline"])
    memory = fails(findings, "baseline.memory")
    assert len(memory) == 1
    assert "GPU 6 " in memory[0].message and "204 MiB less free" in memory[0].message
    assert fails(findings, "torch.cuda")[0].message.endswith("pins CUDA 12.8")
    changed = [f for f in findings if f.id == "baseline.versions"][0]
    assert changed.status == "WARN" and "torch: 2.9.1 -> 2.9.1+cu130" in changed.message


def test_stale_process_names_gpu_pid_and_memory(snapshots, rtx):
    findings = audit(rtx, snapshots["rtx6000-x8-stale-process"], baseline=snapshots["rtx6000-x8-baseline"])
    stale = fails(findings, "gpu.processes")
    assert [f.message for f in stale] == ["GPU 3: process 48213 (python3) holds 71236 MiB"]
    assert "kill 48213" in stale[0].hint
    assert [f.message.split(" (")[0] for f in fails(findings, "gpu.free_memory")] == ["GPU 3"]


def test_sm120_with_cu126_torch_fails_with_the_fix(snapshots, rtx):
    arch = fails(audit(rtx, snapshots["rtx6000-x8-cu126-torch"]), "torch.arch")
    assert len(arch) == 1
    assert "sm_120" in arch[0].message and "GPUs 0, 1, 2, 3, 4, 5, 6, 7" in arch[0].message
    assert "CUDA >= 12.8" in arch[0].hint and "requirements-cu128.txt" in arch[0].hint


def test_nvcc_128_with_cu130_torch_fails_naming_both(snapshots):
    findings = audit(load_profile("b200-x8"), snapshots["b200-x8-nvcc128-cu130"], use_saved_baseline=False)
    assert [f.id for f in fails(findings)] == ["toolkit.nvcc"]
    message = fails(findings)[0].message
    assert "nvcc 12.8" in message and "CUDA 13.0" in message and "/usr/local/cuda" in message


def test_mismatched_flashinfer_companions_named(snapshots, rtx):
    family = fails(audit(rtx, snapshots["rtx6000-x8-flashinfer-mismatch"]), "packages.flashinfer")
    assert len(family) == 1
    assert "flashinfer-python==0.6.8.post1" in family[0].message
    assert "flashinfer-cubin==0.6.7.post3" in family[0].message


def test_pins_list_each_difference(snapshots, rtx):
    pins = fails(audit(rtx, snapshots["rtx6000-x8-flashinfer-mismatch"]), "packages.pins")
    assert "flashinfer-python: installed 0.6.8.post1, pinned 0.6.7.post3" in pins[0].message


@pytest.fixture(scope="module")
def rtx_on_qwen36(rtx, fixtures_dir):
    """rtx6000-x8 with its target's config.json at hand (the recorded Qwen3.6-27B config)."""
    target = str(fixtures_dir / "targets" / "qwen3.6-27b")
    return dataclasses.replace(rtx, model=dataclasses.replace(rtx.model, target=target))


def test_qwen36_target_without_linear_attention_kernels_fails_with_the_fix(snapshots, rtx_on_qwen36):
    """A node installed from the pins of before the Qwen3.6 target (no fla, no causal-conv1d)."""
    findings = audit(rtx_on_qwen36, snapshots["rtx6000-x8-no-linear-kernels"], use_saved_baseline=False)
    kernels = fails(findings, "packages.linear_attention")
    assert len(kernels) == 1
    assert "48 of its 64 layers are linear attention (Gated DeltaNet)" in kernels[0].message
    assert "flash-linear-attention and causal-conv1d are not installed" in kernels[0].message
    assert "pip install flash-linear-attention==0.5.2 fla-core==0.5.2" in kernels[0].hint
    assert "--no-build-isolation causal-conv1d==1.7.0" in kernels[0].hint and "MAX_JOBS" in kernels[0].hint


def test_qwen36_target_with_the_kernels_installed_passes(snapshots, rtx_on_qwen36):
    findings = audit(rtx_on_qwen36, snapshots["rtx6000-x8-baseline"], use_saved_baseline=False)
    assert [f.status for f in findings if f.id == "packages.linear_attention"] == ["PASS"]
    snap = copy.deepcopy(snapshots["rtx6000-x8-baseline"])
    del snap.packages["causal-conv1d"]
    kernels = fails(audit(rtx_on_qwen36, snap, use_saved_baseline=False), "packages.linear_attention")
    assert "causal-conv1d is not installed" in kernels[0].message and "fla-core" not in kernels[0].hint


def test_linear_attention_check_needs_a_hybrid_target_on_a_gpu_profile(snapshots, rtx, tiny_qwen3_target):
    no_kernels = snapshots["rtx6000-x8-no-linear-kernels"]
    qwen3 = dataclasses.replace(rtx, model=dataclasses.replace(rtx.model, target=str(tiny_qwen3_target)))
    status = lambda profile: [(f.status, f.message) for f in audit(profile, no_kernels, use_saved_baseline=False)  # noqa: E731
                              if f.id == "packages.linear_attention"][0]
    assert status(qwen3)[0] == "PASS" and "no linear-attention layers" in status(qwen3)[1]
    assert status(rtx)[0] == "SKIP" and "/models/Qwen3.6-27B/config.json" in status(rtx)[1]   # not on this machine
    assert status(load_profile("flagship-twin"))[0] == "SKIP"                               # CPU profile


def _with(snapshot: Snapshot, **changes) -> Snapshot:
    copy_ = copy.deepcopy(snapshot)
    for dotted, value in changes.items():
        target = copy_
        *path, last = dotted.split("__")
        for part in path:
            target = target[int(part)] if isinstance(target, list) else getattr(target, part)
        setattr(target, last, value)
    return copy_


def test_headers_from_another_toolkit_fail(snapshots, rtx):
    snap = _with(snapshots["rtx6000-x8-baseline"], toolkit__cudart_version="12.6")
    headers = fails(audit(rtx, snap), "toolkit.headers")
    assert "CUDART_VERSION 12.6" in headers[0].message and "nvcc is 12.8" in headers[0].message


def test_sm12x_jit_needs_nvcc_129_unless_jit_cache_installed(snapshots, rtx):
    snap = copy.deepcopy(snapshots["rtx6000-x8-baseline"])
    assert fails(audit(rtx, snap), "toolkit.sm12x") == []
    del snap.packages["flashinfer-jit-cache"]
    sm12x = fails(audit(rtx, snap), "toolkit.sm12x")
    assert "nvcc 12.8" in sm12x[0].message and ">= 12.9" in sm12x[0].message


def test_driver_older_than_torch_cuda_fails(snapshots, rtx):
    snap = _with(snapshots["rtx6000-x8-baseline"], nvml__cuda_driver_version="12.4", nvml__driver_version="550.54.15")
    driver = fails(audit(rtx, snap), "driver.cuda")
    assert "driver 550.54.15 supports CUDA 12.4, torch needs CUDA 12.8" == driver[0].message


@pytest.mark.parametrize("profile_name, backend, ok", [
    ("rtx6000-x8", "fa3", False), ("rtx6000-x8", "trtllm", False), ("rtx6000-x8", "triton", True),
    ("h200-x1", "fa3", True), ("b200-x8", "trtllm", True), ("b200-x8", "fa3", False)])
def test_attention_backend_per_arch(profile_name, backend, ok):
    profile = load_profile(profile_name)
    profile = dataclasses.replace(profile, audit=dataclasses.replace(profile.audit, attention_backend=backend))
    findings = checks.check_attention_backend(checks.CheckInput(snapshot=Snapshot(), profile=profile))
    assert (findings[0].status == "PASS") is ok
    if not ok:
        assert "attention_backend" in findings[0].hint


def test_health_problems_name_the_gpu(snapshots, rtx):
    snap = _with(snapshots["rtx6000-x8-baseline"], gpus__5__remapped_rows_pending=True, gpus__2__ecc_uncorrected_volatile=3)
    health = fails(audit(rtx, snap), "gpu.health")
    assert [f.message.split(" (")[0] for f in health] == ["GPU 2", "GPU 5"]
    assert "3 uncorrected ECC" in health[0].message and "row remapping pending" in health[1].message


def test_context_cost_regression_names_the_gpu(snapshots, rtx):
    snap = _with(snapshots["rtx6000-x8-baseline"], gpus__2__context_mib=598 + 100)
    context = fails(audit(rtx, snap, baseline=snapshots["rtx6000-x8-baseline"]), "baseline.context")
    assert len(context) == 1 and context[0].message.startswith("GPU 2 ") and "100 MiB more" in context[0].message


def test_failed_kernel_probe_fails(snapshots, rtx):
    snap = _with(snapshots["rtx6000-x8-baseline"], gpus__4__kernel_ok=False,
                 gpus__4__probe_error="CUDA error: no kernel image is available for execution on the device")
    kernel = fails(audit(rtx, snap), "gpu.kernel")
    assert len(kernel) == 1 and "GPU 4" in kernel[0].message and "no kernel image" in kernel[0].message


def test_gpu_count_and_model(snapshots):
    h200 = load_profile("h200-x1")
    findings = fails(audit(h200, snapshots["rtx6000-x8-baseline"], use_saved_baseline=False))
    assert "8 GPU(s) visible, profile h200-x1 expects 1" in [f.message for f in findings if f.id == "gpu.count"]
    assert len([f for f in findings if f.id == "gpu.model"]) == 8


def test_host_minimums_and_build_jobs(snapshots, rtx):
    snap = _with(snapshots["rtx6000-x8-baseline"], host__shm_total_mib=64, host__ram_available_mib=40 * 1024)
    snap.env["MAX_JOBS"] = "64"
    findings = audit(rtx, snap)
    assert fails(findings, "host.shm")[0].message == "/dev/shm: 64 MiB, profile needs 16384 MiB"
    jobs = [f for f in findings if f.id == "host.max_jobs"][0]
    assert jobs.status == "WARN" and jobs.hint == "export MAX_JOBS=8"


def test_the_ranks_host_ram_at_start_is_held_against_the_node_s_ram(snapshots, rtx):
    """The workload's figure (the caller's: dflash.memory.host_ram) against the snapshot's RAM; unknown: no finding."""
    need = checks.RamNeed(43_784.0, "8 x (runtime, target tensor, drafter init units)")
    small = _with(snapshots["rtx6000-x8-baseline"], host__ram_total_mib=40 * 1024)
    failed = fails(audit(rtx, small, ram_at_start=need), "host.ram_start")
    assert failed[0].message == ("RAM (cgroup limit applied): 40960 MiB, the ranks need 43784 MiB at start "
                                 "(8 x (runtime, target tensor, drafter init units))")
    passed = [f for f in audit(rtx, snapshots["rtx6000-x8-baseline"], ram_at_start=need) if f.id == "host.ram_start"]
    assert [f.status for f in passed] == ["PASS"]
    assert not [f for f in audit(rtx, small) if f.id == "host.ram_start"]


def test_eager_module_loading_warns_and_strict_exit_code(snapshots, rtx):
    snap = copy.deepcopy(snapshots["rtx6000-x8-baseline"])
    snap.env["CUDA_MODULE_LOADING"] = "EAGER"
    findings = audit(served_apart(rtx), snap, baseline=snapshots["rtx6000-x8-baseline"])
    assert [f.id for f in findings if f.status == "WARN"] == ["env.module_loading"]
    assert findings_format.exit_code(findings) == EXIT_OK
    assert findings_format.exit_code(findings, strict=True) == EXIT_WARN_STRICT
    assert findings_format.exit_code(audit(rtx, snapshots["rtx6000-x8-stale-process"]), strict=True) == EXIT_FAIL


@pytest.mark.parametrize("capability, arch_list, covered", [
    ("12.0", ["sm_90", "sm_100", "sm_120"], True), ("12.0", ["sm_80", "sm_90"], False),
    ("12.0", ["sm_100"], False), ("8.9", ["sm_80", "sm_86"], True), ("9.0", ["sm_90a"], True),
    ("10.3", ["sm_100a"], False), ("12.0", ["sm_80", "compute_90"], True), ("8.0", ["compute_90"], False)])
def test_arch_coverage(capability, arch_list, covered):
    assert checks.arch_covered(capability, arch_list) is covered


def test_snapshot_round_trip_and_strict_loading(snapshots, tmp_path):
    base = snapshots["rtx6000-x8-baseline"]
    assert Snapshot.from_dict(base.to_dict()) == base
    assert base.gpus[6].memory_total_mib == 97887 and base.gpu_by_uuid(base.gpus[6].uuid).index == 6
    document = base.to_dict()
    document["gpus"][1]["memory_fre_mib"] = 1
    bad = tmp_path / "bad.json"
    bad.write_text(__import__("json").dumps(document))
    with pytest.raises(InputError, match=r"bad.json.*gpus\[1\].*memory_fre_mib"):
        load_snapshot(bad)
    document = base.to_dict() | {"schema_version": 99}
    bad.write_text(__import__("json").dumps(document))
    with pytest.raises(InputError, match="schema_version 99"):
        load_snapshot(bad)


def test_processes_record_fields(snapshots):
    proc = snapshots["rtx6000-x8-stale-process"].gpus[3].processes[0]
    assert proc == GpuProcess(pid=48213, name="python3", used_mib=71236)
