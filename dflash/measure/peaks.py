"""Measured peaks: torch's allocated and reserved peaks of a step on a GPU, what a calibration
(dflash.memory.calibration_record) is fitted to, and a call's transient on the CPU allocator
(`measure_cpu_transient`), what the model's smaller figures, such as a BlockMask's build, are held
to. torch is imported inside the functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from dflash.memory.attention_masks import MIB
from dflash.memory.calibration_record import AllocatorPeaks

T = TypeVar("T")


def measure_allocator_peaks(run: Callable[[], object]) -> AllocatorPeaks:
    """Run `run` on the current CUDA device from an emptied cache and return torch's peak allocated
    and peak reserved memory over it (`max_memory_allocated`, `max_memory_reserved`)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return AllocatorPeaks(torch.cuda.max_memory_allocated() / MIB, torch.cuda.max_memory_reserved() / MIB)


def measure_step_peaks(run_step: Callable[[int], None], micro_batches: tuple[int, ...] = (1, 2)) -> dict[int, AllocatorPeaks]:
    """One worst-case training step per micro-batch size, each from an emptied cache: its peaks."""
    return {micro_batch: measure_allocator_peaks(lambda: run_step(micro_batch)) for micro_batch in micro_batches}


@dataclass(frozen=True)
class CpuTransient(Generic[T]):
    """What a call allocated through torch's CPU allocator: the peak above what was live when it
    started, what it left allocated, and its result."""

    peak_bytes: int
    retained_bytes: int
    result: T


def measure_cpu_transient(run: Callable[[], T]) -> CpuTransient[T]:
    """Run `run` under torch's profiler with memory events (every allocation and free of the CPU
    allocator, temporaries inside ops included, in time order) and sum them up.

    Python's cyclic garbage collector is run before and held off during the call: a collection inside
    it would free tensors an earlier call left in reference cycles, and the profiler would count those
    frees as this call's."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = run()
    finally:
        if collecting:
            gc.enable()
    events = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                    if event.name() == "[memory]" and event.device_type().name == "CPU")
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return CpuTransient(peak, live, result)
