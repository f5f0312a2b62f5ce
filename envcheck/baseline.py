"""Baselines: a saved snapshot per (profile, host) that later audits compare against, and the
diff of two snapshots (packages, driver, per-GPU free memory and context cost, environment)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from envcheck.snapshot import Snapshot, load_snapshot, save_snapshot


def baseline_dir() -> Path:
    """`DFLASH_BASELINE_DIR`, default `<cache>/baselines` (see launcher_core.paths.cache_dir)."""
    override = os.environ.get("DFLASH_BASELINE_DIR")
    if override:
        return Path(override)
    from launcher_core.paths import cache_dir

    return cache_dir() / "baselines"


def baseline_path(profile_name: str, hostname: str | None = None) -> Path:
    return baseline_dir() / profile_name / f"{hostname or socket.gethostname()}.json"


def load_baseline(profile_name: str, hostname: str | None = None) -> Optional[Snapshot]:
    path = baseline_path(profile_name, hostname)
    return load_snapshot(path) if path.exists() else None


def save_baseline(snapshot: Snapshot, profile_name: str) -> Path:
    return save_snapshot(snapshot, baseline_path(profile_name, snapshot.hostname or None))


@dataclass(frozen=True)
class Change:
    section: str          # packages, driver, gpu, env, torch, toolkit
    subject: str          # package name, "GPU 6", variable name
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.section:<9} {self.subject}: {self.before} -> {self.after}"


def diff_snapshots(old: Snapshot, new: Snapshot) -> list[Change]:
    return [*_scalar_changes(old, new), *_mapping_changes("packages", old.packages, new.packages),
            *_gpu_changes(old, new), *_mapping_changes("env", old.env, new.env)]


def _scalar_changes(old: Snapshot, new: Snapshot) -> list[Change]:
    pairs = {("driver", "version"): (old.nvml.driver_version, new.nvml.driver_version),
             ("driver", "CUDA"): (old.nvml.cuda_driver_version, new.nvml.cuda_driver_version),
             ("torch", "version"): (old.torch.version, new.torch.version),
             ("torch", "CUDA"): (old.torch.cuda, new.torch.cuda),
             ("toolkit", "nvcc"): (old.toolkit.nvcc_version, new.toolkit.nvcc_version),
             ("toolkit", "CUDA_HOME"): (old.toolkit.cuda_home, new.toolkit.cuda_home)}
    return [Change(section, subject, a or "-", b or "-") for (section, subject), (a, b) in pairs.items() if a != b]


def _mapping_changes(section: str, old: dict[str, str], new: dict[str, str]) -> list[Change]:
    return [Change(section, key, old.get(key, "absent"), new.get(key, "absent"))
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _gpu_changes(old: Snapshot, new: Snapshot) -> list[Change]:
    changes = []
    for gpu in new.gpus:
        before = old.gpu_by_uuid(gpu.uuid)
        label = f"GPU {gpu.index}"
        if before is None:
            changes.append(Change("gpu", label, "absent", f"{gpu.name} {gpu.uuid}"))
            continue
        if before.memory_free_mib != gpu.memory_free_mib:
            changes.append(Change("gpu", f"{label} free MiB", str(before.memory_free_mib),
                                  f"{gpu.memory_free_mib} ({gpu.memory_free_mib - before.memory_free_mib:+d})"))
        if before.context_mib is not None and gpu.context_mib is not None and before.context_mib != gpu.context_mib:
            changes.append(Change("gpu", f"{label} context MiB", str(before.context_mib),
                                  f"{gpu.context_mib} ({gpu.context_mib - before.context_mib:+d})"))
    known = {gpu.uuid for gpu in new.gpus}
    changes += [Change("gpu", f"GPU {g.index}", f"{g.name} {g.uuid}", "absent") for g in old.gpus if g.uuid not in known]
    return changes
