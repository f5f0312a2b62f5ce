"""Measuring a training step's peak on a real GPU: torch's peak allocated memory per micro-batch
size, what a calibration (`dflash.memory.calibration`) is fitted to. GPU only; torch is imported
here (inside the function), not by the torch-free model the launcher process plans with."""
from __future__ import annotations

from typing import Callable

from dflash.memory.attention_masks import MIB


def measure_peaks(run_step: Callable[[int], None], micro_batches: tuple[int, ...] = (1, 2)) -> dict[int, float]:
    """Run one worst-case training step per micro-batch size on the current CUDA device and
    return torch's peak allocated memory (MiB) for each."""
    import torch

    peaks = {}
    for micro_batch in micro_batches:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run_step(micro_batch)
        torch.cuda.synchronize()
        peaks[micro_batch] = torch.cuda.max_memory_allocated() / MIB
    return peaks
