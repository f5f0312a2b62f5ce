"""The ranks' CUDA allocator variables (envcheck.allocator) and the audit's line about them."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from envcheck import checks
from envcheck.allocator import allocator_setting
from envcheck.snapshot import load_snapshot
from launcher_core.profile import load_profile


def _profile(expandable: bool = True):
    profile = load_profile("rtx6000-x8")
    return dataclasses.replace(profile, memory=dataclasses.replace(profile.memory, expandable_segments=expandable))


def test_the_installed_torch_reads_the_completed_variable(tmp_path):
    """What the ranks get is what torch parses: the user's PYTORCH_CUDA_ALLOC_CONF, completed in place, is
    the config torch's allocator reads (torch 2.13 reads it before PYTORCH_ALLOC_CONF; 2.9 reads either)."""
    setting = allocator_setting(True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"})
    probe = "import json, torch; print(json.dumps(torch._C._accelerator_getAllocatorSettings()))"
    out = subprocess.run([sys.executable, "-c", probe], env={"PATH": "/usr/bin:/bin", **setting.env},
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == "max_split_size_mb:256,expandable_segments:True"


def torch_reads(env: dict[str, str]) -> str:
    """The allocator config the installed torch parses in a process with `env`'s allocator variables."""
    probe = "import json, torch; print(json.dumps(torch._C._accelerator_getAllocatorSettings()))"
    out = subprocess.run([sys.executable, "-c", probe], env={"PATH": "/usr/bin:/bin", **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_an_empty_variable_is_dropped_for_the_ranks_and_for_the_calibration(monkeypatch):
    """A set-but-empty PYTORCH_CUDA_ALLOC_CONF is what torch 2.13 reads first (and nothing from the other):
    the ranks' environment and the calibrating process (dflash.measure.gpu_calibration.apply_allocator_setting)
    both drop it, so torch runs with the expandable segments the calibration records."""
    from dflash.measure.gpu_calibration import apply_allocator_setting
    from dflash.train.supervisor.launch import TrainPaths, _worker_env

    assert torch_reads({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == ""
    ranks = _worker_env(_profile(), {"PYTORCH_CUDA_ALLOC_CONF": ""}, None, TrainPaths(Path("run")))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in ranks and torch_reads(ranks) == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert apply_allocator_setting(_profile()).expandable is True
    here = {name: value for name, value in __import__("os").environ.items() if name.startswith("PYTORCH_")}
    assert torch_reads(here) == "expandable_segments:True"


def test_the_source_names_what_decided():
    assert allocator_setting(True, {}).source == "memory.expandable_segments = true (default)"
    explicit = allocator_setting(True, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert not explicit.expandable and "PYTORCH_ALLOC_CONF set by the user says expandable_segments:False" in explicit.source
    asynchronous = allocator_setting(True, {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert not asynchronous.expandable and asynchronous.env == {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    kept = allocator_setting(False, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"})
    assert not kept.expandable and kept.env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}


BASELINE = Path(__file__).parents[1] / "fixtures" / "snapshots" / "rtx6000-x8-baseline.json"


def _allocator_finding(profile, env):
    snapshot = dataclasses.replace(load_snapshot(BASELINE), env=env)
    found = checks.check_allocator(checks.CheckInput(snapshot=snapshot, profile=profile))
    assert len(found) == 1 and found[0].id == "env.allocator"
    return found[0]


def test_the_audit_says_whether_ranks_run_with_expandable_segments_and_from_which_source():
    default = _allocator_finding(_profile(), {})
    assert default.status == "PASS" and default.message.startswith("ranks run with expandable segments")
    assert "memory.expandable_segments = true (default)" in default.message
    off = _allocator_finding(_profile(expandable=False), {})
    assert off.status == "PASS" and "without expandable segments (memory.expandable_segments = false" in off.message
    overridden = _allocator_finding(_profile(), {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert overridden.status == "WARN" and "PYTORCH_CUDA_ALLOC_CONF set by the user" in overridden.message
    clash = _allocator_finding(_profile(), {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert clash.status == "FAIL" and "disagree" in clash.message


def test_the_audit_skips_a_cpu_profile():
    found = checks.check_allocator(checks.CheckInput(snapshot=load_snapshot(BASELINE), profile=load_profile("cpu-demo")))
    assert [f.status for f in found] == ["SKIP"]
