"""The caching allocator's reserve, counted inside each rank's budget.

On CUDA a rank caps its allocator at its budget (`torch.cuda.set_per_process_memory_fraction`,
dflash.train.rank.worker.apply_rank_plan), and that cap holds RESERVED memory: the segments the caching
allocator holds, tensors and the free blocks between them. The memory model predicts ALLOCATED memory
(tensors, `max_memory_allocated`). One rule makes the two agree:

    allocated peak(m) x reserve ratio <= budget  (= the allocator's cap)

so the fragmentation allowance lies inside the budget and inside the cap, where torch can use it.

The ratio is the calibration's measured one (`launcher.py calibrate`: max_memory_reserved over
max_memory_allocated across worst-case steps of differently shaped micro-batches, measured under the
profile's memory.expandable_segments), else a default: DEFAULT_RESERVE_RATIO with expandable segments,
FIXED_SEGMENTS_RESERVE_RATIO without. The defaults are UNPROVEN: placeholders until a GPU calibration
of the profile measures its own (docs/plan.md, "The allocator's reserve"). A CPU profile has no
caching allocator: ratio 1. No torch import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.memory.calibration_record import Calibration
    from dflash.memory.workload import Workload
    from launcher_core.schema import Profile

# Unproven defaults (no GPU measurement behind them yet): expandable segments grow one segment per stream
# in 2 MiB pages, so the reserve over the allocated peak is the page rounding plus free blocks inside the
# segment; fixed segments (20 MiB-rounded large blocks, one cudaMalloc each) fragment more under
# variable-length batches. A calibration replaces either with the measured ratio.
DEFAULT_RESERVE_RATIO = 1.05
FIXED_SEGMENTS_RESERVE_RATIO = 1.15


@dataclass(frozen=True)
class Reserve:
    """The allocator's reserve over allocated memory that the plan counts inside each budget."""

    ratio: float                    # reserved / allocated at the peak
    source: str                     # "calibration", "default", "cpu"
    detail: str                     # where the figure comes from, in words

    def allocated_budget(self, budget_mib: float) -> float:
        """What tensors may allocate so that their reserve fits the budget."""
        return budget_mib / self.ratio

    def reserved_mib(self, allocated_mib: float) -> float:
        """The reserved peak of an allocated peak (what the cap holds)."""
        return allocated_mib * self.ratio

    def reserve_mib(self, allocated_mib: float) -> float:
        """The reserve above an allocated peak."""
        return allocated_mib * (self.ratio - 1.0)


def plan_reserve(profile: Profile, workload: Workload, calibration: Calibration | None) -> Reserve:
    """The calibration's measured ratio when it measured this workload under the profile's allocator
    setting, else the default for that setting (1 on a CPU profile)."""
    if profile.machine.device != "cuda":
        return Reserve(1.0, "cpu", "CPU profile: no CUDA caching allocator")
    expandable = profile.memory.expandable_segments
    if calibration is not None and calibration.reserve_ratio is not None and \
            calibration.workload_key == workload.key() and calibration.expandable_segments == expandable:
        return Reserve(calibration.reserve_ratio, "calibration",
                       f"measured by `launcher.py calibrate` on {calibration.device_name or 'the GPU'} across "
                       f"differently shaped micro-batches")
    return default_reserve(expandable, calibration)


def default_reserve(expandable: bool, calibration: Calibration | None = None) -> Reserve:
    ratio = DEFAULT_RESERVE_RATIO if expandable else FIXED_SEGMENTS_RESERVE_RATIO
    segments = "expandable segments" if expandable else "fixed segments (memory.expandable_segments = false)"
    why = _why_not_calibrated(expandable, calibration)
    return Reserve(ratio, "default", f"default for {segments}, unproven until `launcher.py calibrate` measures it; {why}")


def _why_not_calibrated(expandable: bool, calibration: Calibration | None) -> str:
    if calibration is None:
        return "no calibration"
    if calibration.reserve_ratio is None:
        return "the calibration predates reserve measurement"
    if calibration.expandable_segments != expandable:
        return "the calibration measured the other allocator setting"
    return "the calibration measured another workload"
