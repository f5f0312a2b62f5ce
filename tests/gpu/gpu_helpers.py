"""What the GPU tests share: where their figures go, the profiles they train with.

Each test module records figures and checks in a `PartRecord`, saved (atomically, after every
entry, so a killed run keeps what it proved) to `$GPU_CHECK_OUT/figures/<part>.json`, where
`scripts/gpu_check.py` collects them into its report. <part> is the file's name without `test_`
and `_gpu` (test_calibrate_gpu.py -> calibrate). Without GPU_CHECK_OUT they go to a temporary
directory.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT_ENV = "GPU_CHECK_OUT"
MASK_ID = 151669                    # a padding row of the Qwen3 embedding


def out_dir() -> Path:
    path = Path(os.environ.get(OUT_ENV) or Path(tempfile.gettempdir()) / "gpu-check")
    path.mkdir(parents=True, exist_ok=True)
    return path


def part_name(test_file: str | Path) -> str:
    """tests/gpu/test_calibrate_gpu.py -> calibrate."""
    stem = Path(test_file).stem
    return stem.removeprefix("test_").removesuffix("_gpu")


def figures_path(out: Path, part: str) -> Path:
    return out / "figures" / f"{part}.json"


@dataclass
class PartRecord:
    """A part's figures, its checks (required or informational) and what it skipped, with reasons."""

    path: Path
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def figure(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.save()

    def check(self, name: str, ok: bool, detail: str, required: bool = True) -> bool:
        """Record a check; the test asserts the required ones (`assert record.check(...)`)."""
        self.checks.append({"name": name, "ok": bool(ok), "required": required, "detail": detail})
        print(f"{'PASS' if ok else ('FAIL' if required else 'WARN')} {name}: {detail}", flush=True)
        self.save()
        return bool(ok) or not required

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        self.save()

    def set_summary(self, text: str) -> None:
        self.summary = text
        self.save()

    def save(self) -> None:
        from launcher_core.fileio import write_json_atomic

        write_json_atomic(self.path, {"summary": self.summary, "figures": self.figures, "checks": self.checks,
                                      "skipped": self.skipped})


def gpu_profile(target: Path, dataset: Path, *, max_length: int, drafter_layers: int, block_size: int,
                num_anchors: int, dtype: str = "bfloat16", attention: str = "flex", **train: Any) -> Any:
    """A one-GPU Profile built in code: the trainer's and the planner's view of a test workload."""
    from launcher_core.schema import (
        DataSection,
        DrafterSection,
        MachineSection,
        MemorySection,
        ModelSection,
        PathsSection,
        Profile,
        TrainSection,
    )

    settings = {"num_anchors": num_anchors, "attention": attention, "max_steps": 1000, "warmup_ratio": 0.0,
                "global_batch": 8, "max_micro_batch": 8, **train}
    return Profile(name="gpu-check", description="built by tests/gpu",
                   machine=MachineSection(device="cuda", backend="nccl", nproc_per_node=1),
                   model=ModelSection(target=str(target), dtype=dtype),
                   paths=PathsSection(run_dir=str(dataset.parent / "run"), dataset=str(dataset)),
                   data=DataSection(max_length=max_length),
                   drafter=DrafterSection(num_layers=drafter_layers, block_size=block_size, mask_token_id=MASK_ID),
                   train=TrainSection(**settings), memory=MemorySection(margin=0.10))


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("inf")


def torch_allocator_expandable() -> bool | None:
    """Whether torch's own parsed allocator settings ask for expandable segments (what it read from the
    allocator variables, not what the launcher wrote); None where this torch has no such accessor."""
    import torch

    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return None if settings is None else "expandable_segments:True" in settings()
