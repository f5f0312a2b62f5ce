"""Fact collection on this machine: torch facts through a cached child process, the toolkit found
in FlashInfer's order, cgroup-aware host limits, environment redaction."""
from __future__ import annotations

import json
import stat
from pathlib import Path

from envcheck import host, toolkit, torch_facts
from envcheck.packages import normalize, read_pins, version_matches_pin
from launcher_core import redact


def test_torch_facts_come_from_a_child_and_are_cached_by_install_key(tmp_path):
    cache = tmp_path / "torch-facts.json"
    first = torch_facts.collect(cache_path=cache)
    assert first.installed and not first.cached and first.version
    import torch  # the test process may import torch; the launcher never does

    assert first.version == torch.__version__ and first.cuda == (torch.version.cuda or "")
    second = torch_facts.collect(cache_path=cache)
    assert second.cached and second.version == first.version
    document = json.loads(cache.read_text())
    document["key"] = document["key"].replace(first.version, "0.0.1-old")   # as after an upgrade
    cache.write_text(json.dumps(document))
    assert not torch_facts.collect(cache_path=cache).cached


def _fake_toolkit(root: Path, release: str, cudart: int) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.41'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime_api.h").write_text(f"/* api */\n#define CUDART_VERSION {cudart}\n")
    (root / "include" / "cuda.h").write_text("")
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so.12").write_text("")
    return root


def test_toolkit_resolution_order_and_versions(tmp_path):
    home = _fake_toolkit(tmp_path / "cuda-12.8", "12.8", 12080)
    other = _fake_toolkit(tmp_path / "cuda-13.0", "13.0", 13000)
    facts = toolkit.collect({"CUDA_HOME": str(home), "CUDA_PATH": str(other), "PATH": ""})
    assert (facts.source, facts.nvcc_version, facts.cudart_version) == ("CUDA_HOME", "12.8", "12.8")
    assert "cuda_fp16.h" in facts.headers_missing and facts.libraries_missing == ["libnvrtc.so"]
    assert toolkit.collect({"CUDA_PATH": str(other), "PATH": ""}).nvcc_version == "13.0"
    on_path = toolkit.resolve_cuda_home({"PATH": str(other / "bin")})
    assert on_path == (str(other.resolve()), "nvcc on PATH")


def test_nvcc_and_header_parsing():
    assert toolkit.parse_nvcc_release("Cuda compilation tools, release 12.9, V12.9.86") == "12.9"
    assert toolkit.parse_cudart_define("#define CUDART_VERSION 13000\n") == "13.0"
    assert toolkit.parse_cudart_define("#define CUDART_VERSION_MINOR 1\n") is None


def test_cgroup_limits_cap_cores_and_ram(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "memory.max").write_text(str(8 * 1024**3))
    (tmp_path / "memory.current").write_text(str(3 * 1024**3))
    assert host.cgroup_cpu_quota(tmp_path) == 1.5
    assert host.cpu_count(tmp_path) <= 2
    total, available = host.ram_mib(tmp_path)
    assert total == 8192 and available <= 5120
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert host.cgroup_cpu_quota(tmp_path) is None


def test_max_jobs_recommendation_follows_ram():
    assert host.recommended_max_jobs(cpu=64, ram_available_mib=40 * 1024, gib_per_job=5) == 8
    assert host.recommended_max_jobs(cpu=4, ram_available_mib=400 * 1024, gib_per_job=5) == 4
    assert host.recommended_max_jobs(cpu=8, ram_available_mib=1024, gib_per_job=5) == 1


def test_gpu_environment_redacts_secrets():
    environ = {"NCCL_SOCKET_IFNAME": "eth0", "OPENAI_API_KEY": "sk-abcdef123456", "NCCL_IB_AUTH_KEY": "zzz999",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,note=sk-abcdef123456", "HOME": "/root"}
    env = redact.gpu_environment(environ)
    assert env == {"NCCL_IB_AUTH_KEY": "<redacted>", "NCCL_SOCKET_IFNAME": "eth0",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,note=<redacted>"}


def test_pins_parsing_and_matching(tmp_path):
    requirements = tmp_path / "r.txt"
    requirements.write_text("# c\ntransformers[serving]==5.3.0\nFlashInfer_Python == 0.6.7.post3 ; python_version>'3'\n-r other.txt\nnumpy>=2\n")
    assert read_pins(requirements) == {"transformers": "5.3.0", "flashinfer-python": "0.6.7.post3"}
    assert normalize("Flash_Infer.python") == "flash-infer-python"
    assert version_matches_pin("2.9.1+cu128", "2.9.1") and not version_matches_pin("2.9.1+cu128", "2.9.1+cu130")
    assert not version_matches_pin("2.9.10", "2.9.1")


def test_cuda_probe_child_command_pins_one_gpu(tmp_path, monkeypatch):
    from envcheck import cuda_probe

    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    argv, env = cuda_probe.child_command("GPU-abc", tmp_path, python="python3")
    assert argv == ["python3", "-m", "envcheck.cuda_probe", "GPU-abc"]
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc" and "CUDA_MODULE_LOADING" not in env
    assert env["DFLASH_PROBE_STORE"].startswith(str(tmp_path))


def test_cuda_probe_reports_failure_as_data(tmp_path):
    """A real child on a GPU-less machine (or a bogus UUID): the result carries the error."""
    from envcheck import cuda_probe
    from envcheck.snapshot import GpuFacts, Snapshot

    gpu = GpuFacts(index=0, uuid="GPU-00000000-0000-0000-0000-000000000000", name="x", compute_capability="9.0",
                   memory_total_mib=1, memory_free_mib=1, memory_used_mib=0)
    results = cuda_probe.run_all([gpu], timeout_s=120)
    assert results[0].uuid == gpu.uuid and results[0].kernel_ok is False and results[0].error
    snapshot = Snapshot(gpus=[gpu])
    cuda_probe.apply(snapshot, results)
    assert snapshot.cuda_probe_ran and snapshot.gpus[0].probe_error == results[0].error
