"""GPU facts through NVML (nvidia-ml-py): no CUDA context is created.

Where there is no driver (`NVMLError_LibraryNotFound`) or no nvidia-ml-py, the result says why,
and the GPU checks SKIP with that reason.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from envcheck.snapshot import GpuFacts, GpuProcess, NvmlFacts

MIB = 1024 * 1024


def collect() -> tuple[NvmlFacts, list[GpuFacts]]:
    """(driver facts, one GpuFacts per GPU); never raises for a missing driver."""
    try:
        import pynvml
    except ImportError:
        return NvmlFacts(error="nvidia-ml-py is not installed (pip install nvidia-ml-py)"), []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return NvmlFacts(error=f"NVML unavailable: {error} (no NVIDIA driver on this machine?)"), []
    try:
        return _driver_facts(pynvml), [_gpu_facts(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def cuda_version_text(encoded: int) -> str:
    """NVML's integer CUDA version (12080) -> "12.8"."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def _driver_facts(nvml: Any) -> NvmlFacts:
    cuda = _optional(nvml.nvmlSystemGetCudaDriverVersion_v2)
    return NvmlFacts(available=True, driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
                     cuda_driver_version=cuda_version_text(cuda) if cuda else "")


def _gpu_facts(nvml: Any, index: int) -> GpuFacts:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    memory = _memory_info(nvml, handle)
    gpu = GpuFacts(
        index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)), name=_text(nvml.nvmlDeviceGetName(handle)),
        compute_capability=f"{major}.{minor}", memory_total_mib=memory.total // MIB,
        memory_free_mib=memory.free // MIB, memory_used_mib=memory.used // MIB,
        memory_reserved_mib=getattr(memory, "reserved", None) and memory.reserved // MIB,
        processes=_processes(nvml, handle),
    )
    _add_health(nvml, handle, gpu)
    _add_pcie(nvml, handle, gpu)
    return gpu


def _memory_info(nvml: Any, handle: Any) -> Any:
    """Memory v2 (reports driver-reserved memory separately) where the driver supports it."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        info = _optional(nvml.nvmlDeviceGetMemoryInfo, handle, version=version)
        if info is not None:
            return info
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def _processes(nvml: Any, handle: Any) -> list[GpuProcess]:
    found: dict[int, GpuProcess] = {}
    for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        for proc in _optional(query, handle) or []:
            used = proc.usedGpuMemory
            used_mib = used // MIB if isinstance(used, int) and used < 2**63 else None
            found.setdefault(proc.pid, GpuProcess(pid=proc.pid, name=_process_name(nvml, proc.pid), used_mib=used_mib))
    return sorted(found.values(), key=lambda p: p.pid)


def _process_name(nvml: Any, pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm", encoding="utf-8").read().strip()
    except OSError:
        return _text(_optional(nvml.nvmlSystemGetProcessName, pid) or f"pid {pid}")


def _add_health(nvml: Any, handle: Any, gpu: GpuFacts) -> None:
    mode = _optional(nvml.nvmlDeviceGetEccMode, handle)
    gpu.ecc_enabled = bool(mode[0]) if mode else None
    if gpu.ecc_enabled:
        gpu.ecc_uncorrected_volatile = _optional(
            nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    pending = _optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    gpu.retired_pages_pending = None if pending is None else bool(pending)
    pages = _optional(nvml.nvmlDeviceGetRetiredPages, handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    gpu.retired_pages_count = None if pages is None else len(pages)
    rows = _optional(nvml.nvmlDeviceGetRemappedRows, handle)
    if rows is not None:
        _corrected, uncorrected, is_pending, failed = rows
        gpu.remapped_rows_uncorrectable, gpu.remapped_rows_pending, gpu.remapped_rows_failed = (
            int(uncorrected), bool(is_pending), bool(failed))


def _add_pcie(nvml: Any, handle: Any, gpu: GpuFacts) -> None:
    gpu.pcie_gen = _optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
    gpu.pcie_width = _optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
    gpu.pcie_gen_max = _optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    gpu.pcie_width_max = _optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)


def _optional(query: Callable[..., Any], *args: Any, **kwargs: Any) -> Optional[Any]:
    """A query that a GPU or driver may not support: None instead of an error."""
    import pynvml

    try:
        return query(*args, **kwargs)
    except (pynvml.NVMLError, AttributeError, TypeError):
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
