"""The memory plan a training run starts from: computed at launch, written to
`<run_dir>/train/plan.json`, read back by every rank.

Inputs: the node's GPUs (a recorded snapshot given with `--snapshot`, else this machine's GPUs
through NVML, without a CUDA context: the same `envcheck.snapshot.Snapshot` either way), the
profile's baseline (a saved snapshot: overheads of GPUs the snapshot did not probe, and the memory
calibration `launcher.py calibrate` stored) and the profile. A rank whose budget cannot hold one
sequence stops the launch before any model loads.

Each rank starts from its own feasible micro-batch (`RankStart.micro_batch`); AutoBatch then
agrees on the smallest over all ranks, persists it and halves it on a runtime OOM. On CUDA a
rank also caps its allocator to its budget (`allocator_fraction`): the cap holds reserved memory,
and the plan fitted the allocated peak times the reserve ratio into that same budget
(dflash.memory.reserve), so the allocator's reserve lies inside the cap.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from envcheck.snapshot import GpuFacts, NvmlFacts, Snapshot
from launcher_core.errors import InputError, PreflightFailed
from launcher_core.fileio import read_json_object, write_json_atomic
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.memory.budget import Plan
    from dflash.memory.calibration_record import Calibration

PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is computed from, and where each part came from (shown to the user)."""

    snapshot: Snapshot | None           # None: a CPU profile without one
    baseline: Snapshot | None
    calibration: Calibration | None
    snapshot_source: str                # a file, "NVML", or "none (CPU profile)"
    calibration_file: Path | None = None    # where the calibration was read (baseline or snapshot)
    baseline_file: Path | None = None


@dataclass(frozen=True)
class RankStart:
    """One rank's line of plan.json: where it starts and what it may use."""

    rank: int
    micro_batch: int                # this rank's feasible micro-batch (before agreement)
    budget_mib: float | None        # None: unlimited (CPU)
    total_mib: float | None         # the GPU's total memory (None on CPU)
    predicted_peak_mib: float       # the plan's allocated peak at the agreed micro-batch
    predicted_reserved_mib: float | None = None     # that peak times the reserve ratio: what the cap holds


def plan_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / PLAN_FILE


def read_inputs(profile: Profile, snapshot_file: Path | None = None, baseline_file: Path | None = None) -> PlanInputs:
    """The plan's inputs; the baseline defaults to the profile's saved one for the snapshot's host
    (`launcher.py baseline save`, `launcher.py calibrate`). A malformed snapshot or baseline file is
    an InputError naming the file and the key."""
    from dflash.memory.calibration_record import stored_calibration

    snapshot, snapshot_source = _snapshot(profile, snapshot_file)
    baseline_file = baseline_file or saved_baseline(profile, snapshot)
    baseline, calibration = read_baseline(baseline_file) if baseline_file else (None, None)
    where = baseline_file
    if calibration is None and snapshot_file is not None:
        calibration, where = stored_calibration(snapshot, str(snapshot_file)), snapshot_file
    return PlanInputs(snapshot, baseline, calibration, snapshot_source, where if calibration else None, baseline_file)


def read_baseline(path: Path) -> tuple[Snapshot | None, Calibration | None]:
    """A baseline file: a saved snapshot (`launcher.py baseline save`: its GPUs' overheads) with or
    without the calibration `launcher.py calibrate` adds, or a calibration alone (`calibrate
    --baseline FILE` of a new file)."""
    from dflash.memory.calibration_record import CALIBRATION_KEY, load_calibration

    document = read_json_object(path, "a baseline")
    calibration = load_calibration(document, str(path))
    if "schema_version" not in document and "gpus" not in document:
        if calibration is None:
            raise InputError(f"{path}: neither a snapshot (`launcher.py baseline save`) nor a {CALIBRATION_KEY!r} "
                             f"(`launcher.py calibrate`); pass a baseline file")
        return None, calibration
    try:
        return Snapshot.from_dict(document), calibration
    except (ValueError, TypeError) as error:
        raise InputError(f"{path}: not a valid snapshot: {error}") from None


def _snapshot(profile: Profile, snapshot_file: Path | None) -> tuple[Snapshot | None, str]:
    from envcheck.snapshot import load_snapshot

    if snapshot_file is not None:
        return load_snapshot(snapshot_file), str(snapshot_file)
    if profile.machine.device == "cpu":
        return None, "none (CPU profile)"
    return nvml_gpu_snapshot(), "NVML"


def saved_baseline(profile: Profile, snapshot: Snapshot | None) -> Path | None:
    """The profile's saved baseline for the snapshot's host (this host without one), if any."""
    from envcheck.baseline import baseline_path

    path = baseline_path(profile.name, snapshot.hostname if snapshot is not None and snapshot.hostname else None)
    return path if path.exists() else None


def model_source(plan: Plan, inputs: PlanInputs) -> str:
    """Which memory model the plan used, and why: a calibration from a file, or the analytic model."""
    calibration, where = inputs.calibration, inputs.calibration_file
    if calibration is not None and plan.peak_model.source == "calibration":
        return (f"calibration from {where} (measured {calibration.measured_at or 'at an unknown time'} on "
                f"{calibration.device_name or 'an unnamed device'}, torch {calibration.torch_version or '?'})")
    if calibration is not None:
        return (f"analytic model: the calibration in {where} was measured on another workload (key "
                f"{calibration.workload_key}, this profile's {plan.workload.key()}); re-run "
                f"`launcher.py calibrate --profile {plan.profile}`")
    looked = f"no calibration in {inputs.baseline_file}" if inputs.baseline_file else "no baseline with a calibration"
    return f"analytic model ({looked}; `launcher.py calibrate --profile {plan.profile}` measures one on the GPU node)"


def nvml_gpu_snapshot() -> Snapshot:
    """This machine's GPUs through NVML (no CUDA context), as the snapshot `launcher.py snapshot`
    records (without the torch, toolkit, package and host facts a plan does not read)."""
    from envcheck.nvml_facts import collect
    from launcher_core.errors import ConfigError

    nvml, gpus = collect()
    if nvml.error:
        raise ConfigError(f"cannot read this machine's GPUs through NVML ({nvml.error}); "
                          f"pass --snapshot FILE recorded on the node to plan for")
    return gpu_snapshot(nvml, gpus)


def gpu_snapshot(nvml: NvmlFacts, gpus: list[GpuFacts]) -> Snapshot:
    """A snapshot of this host holding its NVML facts only."""
    import socket
    import time

    return Snapshot(created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), hostname=socket.gethostname(), nvml=nvml,
                    gpus=gpus)


def plan_for_launch(profile: Profile, inputs: PlanInputs, cuda_visible_devices: str | None = None) -> Plan:
    """The plan of this node's ranks; PreflightFailed (exit 1) when a rank cannot hold one sequence."""
    from dflash.memory.budget import does_not_fit, make_plan

    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if cuda_visible_devices is None else cuda_visible_devices
    plan = make_plan(profile, inputs.snapshot, baseline=inputs.baseline, calibration=inputs.calibration,
                     cuda_visible_devices=visible)
    short = [rank for rank in plan.ranks if rank.feasible_micro_batch == 0]
    if short:
        reasons = "\n  ".join(does_not_fit(rank.budget, plan.peak_model, plan.reserve) for rank in short)
        raise PreflightFailed(f"the memory plan does not fit (memory model: {model_source(plan, inputs)}):\n  "
                              f"{reasons}")
    return plan


def rank_starts(plan: Plan) -> list[RankStart]:
    peak = plan.peak_model.peak_mib(plan.batch.micro_batch)
    reserved = round(plan.reserve.reserved_mib(peak), 1)
    return [RankStart(rank=r.budget.rank, micro_batch=r.feasible_micro_batch, budget_mib=_finite(r.budget.budget_mib),
                      total_mib=r.budget.gpu.total_mib if r.budget.gpu else None, predicted_peak_mib=round(peak, 1),
                      predicted_reserved_mib=reserved) for r in plan.ranks]


def _finite(value: float) -> float | None:
    return None if value == float("inf") else round(value, 1)


def write_plan(run_dir: Path, plan: Plan, inputs: PlanInputs) -> Path:
    document = {"profile": plan.profile, "world_size": plan.world_size, "micro_batch": plan.batch.micro_batch,
                "accum_steps": plan.batch.accum_steps, "global_batch": plan.batch.global_batch,
                "snapshot_source": inputs.snapshot_source, "memory_model": model_source(plan, inputs),
                "peak_model": asdict(plan.peak_model), "reserve": reserve_document(plan),
                "ranks": [asdict(start) for start in rank_starts(plan)]}
    return write_json_atomic(plan_path(run_dir), document)


def reserve_document(plan: Plan) -> dict[str, object]:
    """The planned reserve (plan.json and `plan --json`): ratio, where it comes from, MiB at the agreed micro-batch."""
    return {**asdict(plan.reserve), "reserve_mib": round(plan.planned_reserve_mib, 1),
            "reserved_peak_mib": round(plan.reserve.reserved_mib(plan.peak_model.peak_mib(plan.batch.micro_batch)), 1)}


def describe_reserve(plan: Plan) -> str:
    """The planned reserve in words: the rule, the ratio and where it comes from."""
    peak = plan.peak_model.peak_mib(plan.batch.micro_batch)
    return (f"planned reserve: allocated peak {peak:,.0f} MiB x reserve ratio {plan.reserve.ratio:.3f} = "
            f"{plan.reserve.reserved_mib(peak):,.0f} MiB reserved at micro-batch {plan.batch.micro_batch} "
            f"({plan.planned_reserve_mib:,.0f} MiB of reserve), counted in each rank's budget, the allocator's cap "
            f"({plan.reserve.detail})")


def read_rank_start(run_dir: Path, rank: int) -> RankStart | None:
    """This rank's line of plan.json (None when the run was started without a plan)."""
    path = plan_path(run_dir)
    if not path.exists():
        return None
    ranks = read_json_object(path, "a memory plan").get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(line, dict) for line in ranks):
        raise InputError(f"{path}: key 'ranks' must be a list of objects; re-run `launcher.py train`")
    try:
        return RankStart(**ranks[rank]) if rank < len(ranks) else None
    except TypeError as error:
        raise InputError(f"{path}: ranks[{rank}] is malformed ({error}); re-run `launcher.py train`") from None


def allocator_fraction(start: RankStart) -> float | None:
    """The share of its GPU a rank's allocator may use: its budget over the GPU's total memory."""
    if start.budget_mib is None or not start.total_mib:
        return None
    return max(0.0, min(1.0, start.budget_mib / start.total_mib))


def describe(plan: Plan, inputs: PlanInputs) -> str:
    starts = ", ".join(f"rank {s.rank}: {s.micro_batch}" for s in rank_starts(plan))
    return (f"memory plan: micro-batch {plan.batch.micro_batch} x {plan.batch.accum_steps} accumulation steps on "
            f"{plan.world_size} ranks (GPUs from {inputs.snapshot_source}; memory model: "
            f"{model_source(plan, inputs)}); feasible per rank: {starts}\n{describe_reserve(plan)}")
