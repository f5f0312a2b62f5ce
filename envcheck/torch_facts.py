"""torch's version, CUDA tag and compiled arch list, read in a child process.

The launcher process never imports torch. Importing it takes seconds, and these facts change
only when torch is (re)installed, so the result is cached, keyed by the interpreter and by
torch's installed version and RECORD file: an upgrade or a reinstall invalidates it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from envcheck.snapshot import TorchFacts

CACHE_NAME = "torch-facts.json"

# Runs in the child. `_cuda_getArchFlags` reads the compiled arch list without initialising CUDA
# (torch.cuda.get_arch_list() returns [] on a machine where CUDA is not available).
CHILD_CODE = r"""
import json, torch
flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)()
arch = flags.split() if flags else []
print(json.dumps({"version": torch.__version__, "cuda": torch.version.cuda or "", "arch_list": arch}))
"""


def torch_install_key(python: str = sys.executable) -> Optional[str]:
    """What identifies the installed torch: interpreter, version, RECORD mtime. None if absent."""
    from envcheck.packages import find_dist

    dist = find_dist("torch")
    if dist is None:
        return None
    record = dist.path / "RECORD"
    stamp = record.stat().st_mtime_ns if record.exists() else dist.path.stat().st_mtime_ns
    return f"{python}|{dist.version}|{dist.path}|{stamp}"


def child_argv(python: str = sys.executable) -> list[str]:
    return [python, "-c", CHILD_CODE]


def collect(cache_path: Path | None = None, use_cache: bool = True) -> TorchFacts:
    key = torch_install_key()
    if key is None:
        return TorchFacts(installed=False, error="torch is not installed in this environment")
    path = cache_path or _default_cache_path()
    cached = _read_cache(path, key) if use_cache else None
    if cached is not None:
        return cached
    facts = _probe_child()
    if not facts.error:
        _write_cache(path, key, facts)
    return facts


def _probe_child(timeout_s: float = 120.0) -> TorchFacts:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}   # belt and braces: no device is touched
    try:
        done = subprocess.run(child_argv(), capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return TorchFacts(installed=True, error=f"importing torch took more than {timeout_s:.0f} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return TorchFacts(installed=True, error=f"importing torch failed: {last}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return TorchFacts(installed=True, version=data["version"], cuda=data["cuda"], arch_list=data["arch_list"])


def _default_cache_path() -> Path:
    from launcher_core.paths import cache_dir

    return cache_dir() / CACHE_NAME


def _read_cache(path: Path, key: str) -> Optional[TorchFacts]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if document.get("key") != key:
        return None
    return TorchFacts(installed=True, cached=True, **document["facts"])


def _write_cache(path: Path, key: str, facts: TorchFacts) -> None:
    from launcher_core.fileio import write_json_atomic

    facts_data = {"version": facts.version, "cuda": facts.cuda, "arch_list": facts.arch_list}
    try:
        write_json_atomic(path, {"key": key, "facts": facts_data})
    except OSError:
        pass  # a read-only cache only costs speed
