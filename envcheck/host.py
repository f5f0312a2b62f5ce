"""Host facts that honour cgroup limits: a container sees its quota, not the node's hardware."""
from __future__ import annotations

import math
import os
import resource
import shutil
from pathlib import Path
from typing import Optional, Sequence

from envcheck.snapshot import DiskFacts, HostFacts

MIB = 1024 * 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")


def collect(disk_paths: Sequence[Path] = (), cgroup_root: Path = CGROUP_ROOT) -> HostFacts:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shm = disk_usage(Path("/dev/shm"))
    total, available = ram_mib(cgroup_root)
    return HostFacts(
        cpu_count=cpu_count(cgroup_root), ram_total_mib=total, ram_available_mib=available,
        shm_total_mib=shm.total_mib if shm else 0, shm_free_mib=shm.free_mib if shm else 0,
        open_files_soft=_limit(soft), open_files_hard=_limit(hard),
        disks=[d for d in (disk_usage(p) for p in dict.fromkeys(disk_paths)) if d is not None],
    )


def cpu_count(cgroup_root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: affinity, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(root: Path) -> Optional[float]:
    """CPUs granted by cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`; None when unlimited."""
    v2 = _read(root / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    quota_us, period_us = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_us and period_us and int(quota_us) > 0:
        return int(quota_us) / int(period_us)
    return None


def ram_mib(cgroup_root: Path = CGROUP_ROOT) -> tuple[int, int]:
    """(total, available) MiB: /proc/meminfo, capped by the cgroup memory limit and usage."""
    meminfo = _meminfo()
    total, available = meminfo.get("MemTotal", 0), meminfo.get("MemAvailable", 0)
    limit, used = cgroup_memory(cgroup_root)
    if limit is not None and limit < total:
        total = limit
        available = min(available, max(0, limit - (used or 0)))
    return total // MIB, available // MIB


def cgroup_memory(root: Path) -> tuple[Optional[int], Optional[int]]:
    """(limit, usage) bytes from cgroup v2 or v1; limit None when unlimited."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read(root / limit_file)
        if limit:
            usage = _read(root / usage_file)
            unlimited = limit == "max" or int(limit) >= 2**60
            return (None if unlimited else int(limit)), (int(usage) if usage else None)
    return None, None


def recommended_max_jobs(cpu: int, ram_available_mib: int, gib_per_job: float) -> int:
    """Parallel nvcc jobs that fit: one per core, at most one per `gib_per_job` of RAM."""
    by_ram = int(ram_available_mib / 1024 // gib_per_job) if gib_per_job > 0 else cpu
    return max(1, min(cpu, by_ram))


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024
    return values


def disk_usage(path: Path) -> Optional[DiskFacts]:
    """Usage of the filesystem that holds `path` (its nearest existing ancestor)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    return DiskFacts(path=str(path), free_mib=usage.free // MIB, total_mib=usage.total // MIB)


def _limit(value: int) -> int:
    return -1 if value == resource.RLIM_INFINITY else value


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def nvidia_driver_version(proc_file: Path = Path("/proc/driver/nvidia/version")) -> Optional[str]:
    """The NVIDIA driver version from /proc (no library, no CUDA context); None without one."""
    text = _read(proc_file)
    for word in (text or "").split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None
