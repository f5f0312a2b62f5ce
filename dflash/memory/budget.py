"""Per-rank memory budgets and the micro-batch every rank can run.

    budget(rank) = free memory of the rank's GPU (snapshot)
                   - non-torch overhead (CUDA context, NCCL, cuBLAS workspace)
                   - margin x free memory (profile memory.margin, default 0.10)

The rank's GPU is its LOCAL_RANK-th visible CUDA device: CUDA_VISIBLE_DEVICES entries that are
integers are NVML indices, entries starting with `GPU-` (or `MIG-`) are UUIDs (a unique prefix is
enough, as CUDA accepts). The overhead is the CUDA probe's measured context cost for that GPU when
the snapshot has it, else the baseline's for the same GPU (by UUID), else the profile's
memory.overhead_mib, else DEFAULT_OVERHEAD_MIB.

A rank's feasible micro-batch is the largest m <= train.max_micro_batch whose predicted allocated
peak (dflash.memory.peak_estimate) times the allocator's reserve ratio (dflash.memory.reserve) fits its
budget, the cap its allocator runs under; the ranks agree on the minimum, and gradient accumulation keeps
the global batch (train.global_batch sequences per optimizer step) exact. No torch import here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from dflash.memory import peak_estimate as memory
from dflash.memory.calibration_record import Calibration
from dflash.memory.reserve import Reserve, plan_reserve
from dflash.memory.target_shape import TargetShape
from dflash.memory.workload import world_size_of
from launcher_core.errors import ConfigError
from launcher_core.schema import Profile, batch_split_problem

if TYPE_CHECKING:
    from envcheck.snapshot import Snapshot

DEFAULT_OVERHEAD_MIB = 1024.0       # context ~500-600 MiB + NCCL buffers + cuBLAS workspace
UNLIMITED_MIB = float("inf")


@dataclass(frozen=True)
class GpuView:
    """The facts about one GPU that budgets need."""

    index: int
    uuid: str
    name: str
    total_mib: float
    free_mib: float
    context_mib: float | None = None    # measured non-torch overhead, if the probe ran


@dataclass(frozen=True)
class RankBudget:
    rank: int
    gpu: GpuView | None                 # None on a CPU profile
    free_mib: float
    overhead_mib: float
    overhead_source: str                # probe, baseline, profile, default, none
    margin_mib: float
    budget_mib: float


@dataclass(frozen=True)
class BatchPlan:
    """How one rank splits its share of the global batch into forward/backward calls."""

    micro_batch: int
    accum_steps: int
    rank_share: int                     # sequences per rank per optimizer step
    global_batch: int

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        """Sizes of the accum_steps micro-batches (the last one may be smaller)."""
        full, rest = divmod(self.rank_share, self.micro_batch)
        return (self.micro_batch,) * full + ((rest,) if rest else ())


@dataclass(frozen=True)
class RankPlan:
    budget: RankBudget
    feasible_micro_batch: int           # largest that fits this rank alone (0: none)
    peak_at_agreed_mib: float


@dataclass(frozen=True)
class Plan:
    profile: str
    world_size: int
    ranks: tuple[RankPlan, ...]
    batch: BatchPlan
    peak_model: memory.PeakModel
    estimate: memory.MemoryEstimate
    workload: memory.Workload
    reserve: Reserve

    @property
    def planned_reserve_mib(self) -> float:
        """The reserve above the allocated peak at the agreed micro-batch, inside every budget."""
        return self.reserve.reserve_mib(self.peak_model.peak_mib(self.batch.micro_batch))

    @property
    def bottleneck_ranks(self) -> tuple[int, ...]:
        lowest = min(r.feasible_micro_batch for r in self.ranks)
        if all(r.feasible_micro_batch == lowest for r in self.ranks):
            return ()
        return tuple(r.budget.rank for r in self.ranks if r.feasible_micro_batch == lowest)


# --- snapshots -> GPU facts ---------------------------------------------------------------

def gpus_from_snapshot(snapshot: Snapshot) -> list[GpuView]:
    """The facts budgets need of each GPU of a snapshot (a file's, or this machine's through NVML);
    `context_mib` is the CUDA probe's measured overhead where it ran."""
    return [GpuView(index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_mib=float(gpu.memory_total_mib),
                    free_mib=float(gpu.memory_free_mib),
                    context_mib=None if gpu.context_mib is None else float(gpu.context_mib))
            for gpu in snapshot.gpus]


def visible_gpus(gpus: Sequence[GpuView], cuda_visible_devices: str | None) -> list[GpuView]:
    """The GPUs CUDA numbers 0, 1, ... under CUDA_VISIBLE_DEVICES (None/unset: all, by index)."""
    ordered = sorted(gpus, key=lambda gpu: gpu.index)
    if cuda_visible_devices is None:
        return ordered
    entries = [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]
    return [_match_visible(entry, ordered) for entry in entries]


def _match_visible(entry: str, gpus: Sequence[GpuView]) -> GpuView:
    if entry.isdigit():
        matches = [gpu for gpu in gpus if gpu.index == int(entry)]
    else:
        matches = [gpu for gpu in gpus if gpu.uuid and gpu.uuid.startswith(entry)]
    if len(matches) != 1:
        known = ", ".join(f"{gpu.index}={gpu.uuid}" for gpu in gpus)
        problem = "matches no GPU" if not matches else "is ambiguous"
        raise ConfigError(f"CUDA_VISIBLE_DEVICES entry {entry!r} {problem}; GPUs in the snapshot: {known}")
    return matches[0]


# --- budgets ------------------------------------------------------------------------------

def overhead_for(gpu: GpuView, profile: Profile, baseline: Mapping[str, GpuView]) -> tuple[float, str]:
    """Non-torch overhead (MiB) and where the figure came from."""
    if gpu.context_mib is not None:
        return gpu.context_mib, "probe"
    known = baseline.get(gpu.uuid) or baseline.get(str(gpu.index))
    if known is not None and known.context_mib is not None:
        return known.context_mib, "baseline"
    if profile.memory.overhead_mib > 0:
        return float(profile.memory.overhead_mib), "profile"
    return DEFAULT_OVERHEAD_MIB, "default"


def rank_budget(rank: int, gpu: GpuView | None, profile: Profile, baseline: Mapping[str, GpuView]) -> RankBudget:
    if gpu is None:
        return RankBudget(rank, None, UNLIMITED_MIB, 0.0, "none", 0.0, UNLIMITED_MIB)
    overhead, source = overhead_for(gpu, profile, baseline)
    margin = profile.memory.margin * gpu.free_mib
    return RankBudget(rank=rank, gpu=gpu, free_mib=gpu.free_mib, overhead_mib=overhead, overhead_source=source,
                      margin_mib=margin, budget_mib=gpu.free_mib - overhead - margin)


def baseline_index(baseline: Snapshot | None) -> dict[str, GpuView]:
    """A baseline snapshot's GPUs keyed by UUID and by index (for overhead fallback)."""
    views = gpus_from_snapshot(baseline) if baseline is not None else []
    return {**{str(gpu.index): gpu for gpu in views}, **{gpu.uuid: gpu for gpu in views if gpu.uuid}}


# --- batch arithmetic ---------------------------------------------------------------------

def rank_share(global_batch: int, world_size: int) -> int:
    """Sequences per rank per step (the schema's rule, launcher_core.schema.batch_split_problem, on the world
    size the launch has)."""
    problem = batch_split_problem(global_batch, world_size)
    if problem is not None:
        raise ConfigError(f"train.global_batch: {problem}")
    return global_batch // world_size


def batch_plan(global_batch: int, world_size: int, micro_batch: int) -> BatchPlan:
    """Accumulation that keeps exactly `global_batch` sequences per optimizer step."""
    share = rank_share(global_batch, world_size)
    micro_batch = max(1, min(micro_batch, share))
    return BatchPlan(micro_batch=micro_batch, accum_steps=math.ceil(share / micro_batch),
                     rank_share=share, global_batch=global_batch)


# --- planning -----------------------------------------------------------------------------

def rank_gpus(profile: Profile, snapshot: Snapshot | None, world_size: int,
              cuda_visible_devices: str | None) -> list[GpuView | None]:
    """The GPU of each local rank. A CPU profile has none (unlimited budgets) unless a snapshot is
    given: then its GPUs' budgets apply, which is how a dry run plans a CPU run as if on that node."""
    if profile.machine.device == "cpu" and snapshot is None:
        return [None] * world_size
    if snapshot is None:
        raise ConfigError("a CUDA profile needs GPU facts: pass --snapshot FILE (see `launcher.py snapshot`)")
    visible = visible_gpus(gpus_from_snapshot(snapshot), cuda_visible_devices)
    local = profile.machine.nproc_per_node
    if len(visible) < local:
        raise ConfigError(f"machine.nproc_per_node = {local} but only {len(visible)} GPUs are visible "
                          f"(CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}); lower nproc_per_node or free GPUs")
    return [visible[rank % local] for rank in range(world_size)]


def make_plan(profile: Profile, snapshot: Snapshot | None = None, *, baseline: Snapshot | None = None,
              calibration: Calibration | None = None, cuda_visible_devices: str | None = None,
              world_size: int | None = None, shape: TargetShape | None = None) -> Plan:
    """The whole per-rank plan; pure apart from reading the target's config.json."""
    world = world_size or world_size_of(profile)
    workload = memory.workload_from_profile(profile, shape, world)
    model, reserve = memory.peak_model(workload, calibration), plan_reserve(profile, workload, calibration)
    known = baseline_index(baseline)
    budgets = [rank_budget(r, gpu, profile, known)
               for r, gpu in enumerate(rank_gpus(profile, snapshot, world, cuda_visible_devices))]
    feasible = [model.largest_fitting(reserve.allocated_budget(b.budget_mib), profile.train.max_micro_batch)
                for b in budgets]
    batch = batch_plan(profile.train.global_batch, world, max(1, min(feasible)))
    ranks = tuple(RankPlan(b, f, model.peak_mib(batch.micro_batch)) for b, f in zip(budgets, feasible))
    return Plan(profile=profile.name, world_size=world, ranks=ranks, batch=batch, peak_model=model,
                estimate=memory.estimate(workload), workload=workload, reserve=reserve)


def does_not_fit(budget: RankBudget, model: memory.PeakModel, reserve: Reserve) -> str:
    gpu = f"GPU {budget.gpu.index}" if budget.gpu else "this device"
    needs = reserve.reserved_mib(model.peak_mib(1))
    counted = f" ({model.peak_mib(1):.0f} allocated x reserve ratio {reserve.ratio:.3f})" if reserve.ratio != 1.0 else ""
    return (f"rank {budget.rank}: one sequence needs {needs:.0f} MiB{counted} but {gpu}'s budget is "
            f"{budget.budget_mib:.0f} MiB (free {budget.free_mib:.0f} - overhead {budget.overhead_mib:.0f} "
            f"- margin {budget.margin_mib:.0f}); lower data.max_length or train.num_anchors, free the GPU, "
            f"or lower memory.margin")
