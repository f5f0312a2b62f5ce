"""The CUDA toolkit, found the way FlashInfer's JIT finds it: CUDA_HOME, then CUDA_PATH, then
the nvcc on PATH, then /usr/local/cuda. Reports nvcc's version, the headers' CUDART_VERSION and
which headers and libraries a JIT build needs are missing."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from envcheck.snapshot import ToolkitFacts

DEFAULT_CUDA_HOME = "/usr/local/cuda"
JIT_HEADERS = ("cuda_runtime.h", "cuda_runtime_api.h", "cuda.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h")
JIT_LIBRARIES = ("libcudart.so", "libnvrtc.so")
_NVCC_RELEASE = re.compile(r"release (\d+)\.(\d+)")
_CUDART_DEFINE = re.compile(r"^#define\s+CUDART_VERSION\s+(\d+)", re.MULTILINE)


def resolve_cuda_home(environ: Mapping[str, str], which=shutil.which) -> tuple[str, str]:
    """(cuda_home, where it came from); ("", "") when none is found."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(variable):
            return environ[variable], variable
    nvcc = which("nvcc", path=environ.get("PATH"))
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent), "nvcc on PATH"
    if Path(DEFAULT_CUDA_HOME).is_dir():
        return DEFAULT_CUDA_HOME, DEFAULT_CUDA_HOME
    return "", ""


def collect(environ: Mapping[str, str]) -> ToolkitFacts:
    cuda_home, source = resolve_cuda_home(environ)
    if not cuda_home:
        return ToolkitFacts()
    home = Path(cuda_home)
    nvcc = home / "bin" / "nvcc"
    include_dirs = _include_dirs(home)
    return ToolkitFacts(
        cuda_home=cuda_home, source=source, nvcc_path=str(nvcc) if nvcc.exists() else "",
        nvcc_version=nvcc_version(nvcc) if nvcc.exists() else "",
        cudart_version=cudart_version(include_dirs),
        headers_missing=[h for h in JIT_HEADERS if not any((d / h).exists() for d in include_dirs)],
        libraries_missing=[lib for lib in JIT_LIBRARIES if not _library_present(home, lib)],
    )


def nvcc_version(nvcc: Path) -> str:
    """`nvcc --version` -> "12.8"; "" when it cannot run."""
    try:
        output = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return parse_nvcc_release(output) or ""


def parse_nvcc_release(output: str) -> Optional[str]:
    match = _NVCC_RELEASE.search(output)
    return f"{match[1]}.{match[2]}" if match else None


def cudart_version(include_dirs: list[Path]) -> str:
    for directory in include_dirs:
        header = directory / "cuda_runtime_api.h"
        if header.exists():
            return parse_cudart_define(header.read_text(encoding="utf-8", errors="replace")) or ""
    return ""


def parse_cudart_define(header_text: str) -> Optional[str]:
    """`#define CUDART_VERSION 12080` -> "12.8"."""
    match = _CUDART_DEFINE.search(header_text)
    if not match:
        return None
    encoded = int(match[1])
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def _include_dirs(home: Path) -> list[Path]:
    return [home / "include", *sorted(home.glob("targets/*/include"))]


def _library_present(home: Path, name: str) -> bool:
    directories = [home / "lib64", home / "lib", *sorted(home.glob("targets/*/lib"))]
    return any(any(d.glob(f"{name}*")) for d in directories if d.is_dir())
