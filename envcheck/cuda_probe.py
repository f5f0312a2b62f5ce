"""The CUDA probe: one child process per GPU measures what a worker pays before torch allocates
anything (CUDA context + cuBLAS handle + NCCL's first collective) and launches a real kernel.

The launcher process never creates a CUDA context (a forked rank would inherit it), so all of
this runs in `python -m envcheck.cuda_probe` children, each pinned to one GPU by UUID.
Overhead = the process's device memory (NVML) - what torch's allocator reserved.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from envcheck.snapshot import GpuFacts, Snapshot

MIB = 1024 * 1024


@dataclass
class ProbeResult:
    uuid: str
    context_mib: int | None = None
    kernel_ok: bool = False
    error: str = ""


def child_command(uuid: str, store_dir: Path, python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the child probing one GPU. Pure: starts nothing."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
           "DFLASH_PROBE_STORE": str(store_dir / f"store-{uuid}")}
    env.pop("CUDA_MODULE_LOADING", None)        # measure the default (lazy) loading
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    return [python, "-m", "envcheck.cuda_probe", uuid], env


def run_all(gpus: Sequence[GpuFacts], timeout_s: float = 180.0) -> list[ProbeResult]:
    """Probe every GPU in parallel (one child each) and collect their results."""
    with tempfile.TemporaryDirectory(prefix="cuda-probe-") as store_dir:
        children = []
        for gpu in gpus:
            argv, env = child_command(gpu.uuid, Path(store_dir))
            children.append((gpu.uuid, subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        return [_result_of(uuid, child, timeout_s) for uuid, child in children]


def _result_of(uuid: str, child: subprocess.Popen, timeout_s: float) -> ProbeResult:
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return ProbeResult(uuid, error=f"probe timed out after {timeout_s:.0f} s")
    lines = stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        last = (stderr.strip().splitlines() or [f"exit code {child.returncode}"])[-1]
        return ProbeResult(uuid, error=last[-300:])
    return ProbeResult(**json.loads(lines[-1]))


def apply(snapshot: Snapshot, results: Sequence[ProbeResult]) -> None:
    """Attach each result to the GPU with the same UUID."""
    for result in results:
        gpu = snapshot.gpu_by_uuid(result.uuid)
        if gpu is not None:
            gpu.context_mib, gpu.kernel_ok, gpu.probe_error = result.context_mib, result.kernel_ok, result.error
    snapshot.cuda_probe_ran = True


# ---- the child ----------------------------------------------------------------------------

def _device_used_mib(uuid: str) -> tuple[int, int | None]:
    """(device used MiB, this process's MiB or None) through NVML."""
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used // MIB
    mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
    own = mine[0] // MIB if mine and isinstance(mine[0], int) else None
    return used, own


def _exercise_gpu() -> bool:
    """Context, cuBLAS (a matmul), a real elementwise kernel checked on the host, NCCL all_reduce."""
    import torch
    import torch.distributed as dist

    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    kernel_ok = (x * 2 + 1).sum().item() == 1024 * 1024          # exact in float32 (< 2**24)
    a = torch.ones(256, 256, device="cuda")
    kernel_ok &= bool(((a @ a) == 256).all().item())
    store = dist.FileStore(os.environ["DFLASH_PROBE_STORE"], 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return kernel_ok and t.item() == 1.0


def child_main(uuid: str) -> int:
    import pynvml

    try:
        pynvml.nvmlInit()
        before, _ = _device_used_mib(uuid)
        import torch

        kernel_ok = _exercise_gpu()
        after, own = _device_used_mib(uuid)
        footprint = own if own is not None else after - before
        reserved = torch.cuda.memory_reserved() // MIB
        result = ProbeResult(uuid, context_mib=int(footprint - reserved), kernel_ok=kernel_ok)
    except Exception as error:  # report the failure (e.g. "no kernel image is available") as data
        result = ProbeResult(uuid, error=f"{type(error).__name__}: {error}"[:300])
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
