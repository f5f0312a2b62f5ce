"""`launcher.py plan --profile P [--snapshot FILE] [--json]`: the resolved profile and the per-rank
memory plan (budgets, micro-batch, accumulation). Starts nothing and never imports torch.

The memory model is the calibration stored in the baseline (`--baseline FILE`, else the profile's
saved baseline for the snapshot's host, where `launcher.py calibrate` writes it) when it was
measured on this workload, else the analytic model; the output says which (`memory model: ...`)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from core.cli import add_profile_option, load_profile_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_profile_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--snapshot", metavar="FILE", type=Path,
                        help="plan for the node this snapshot recorded (default: read this machine's GPUs through NVML)")
    parser.add_argument("--baseline", metavar="FILE", type=Path,
                        help="baseline snapshot: overheads for GPUs the snapshot did not probe, and the memory calibration "
                             "(default: the profile's saved baseline for the snapshot's host, if any)")
    parser.add_argument("--cuda-visible-devices", metavar="LIST", default=os.environ.get("CUDA_VISIBLE_DEVICES"),
                        help="map ranks to GPUs as CUDA would (indices or GPU-UUIDs; default: $CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples for the offline hidden-state storage comparison (default: the seeds' 902,087)")
    parser.add_argument("--avg-tokens", type=int, default=None,
                        help="average tokens per sample for that comparison (default: 2000)")


def run(args: argparse.Namespace) -> int:
    import json

    from dflash.memory.plan import make_plan
    from dflash.memory.model import load_calibration
    from core.profile import profile_as_dict

    profile = load_profile_arg(args)
    snapshot = _read_document(args.snapshot) if args.snapshot else _live_snapshot(profile)
    baseline_file = args.baseline or _saved_baseline(profile, snapshot)
    baseline = _read_document(baseline_file) if baseline_file else None
    calibration, where = (load_calibration(baseline, str(baseline_file)), baseline_file)
    if calibration is None:
        calibration, where = load_calibration(snapshot, str(args.snapshot)), args.snapshot
    plan = make_plan(profile, snapshot, baseline=baseline, calibration=calibration,
                     cuda_visible_devices=args.cuda_visible_devices)
    storage, source = _storage(plan, args), model_source(plan, calibration, where, baseline_file)
    if args.json:
        document = {"profile": profile_as_dict(profile), "plan": {**plan_as_dict(plan, storage), "model_source": source}}
        print(json.dumps(document, indent=2))
        return 0
    print(f"profile {profile.name}: {profile.description}")
    for section, values in document_sections(profile_as_dict(profile)):
        print(f"[{section}]")
        print("\n".join(f"  {key} = {value!r}" for key, value in values.items()))
    print("\n".join(format_plan(plan, storage)))
    print(f"memory model: {source}")
    return 0


def _saved_baseline(profile, snapshot: dict | None) -> Path | None:
    """The profile's saved baseline (`baseline save`, `calibrate`) for the snapshot's host (this host
    without a snapshot), if there is one."""
    from dflash.memory.calibration import saved_baseline

    return saved_baseline(profile, (snapshot or {}).get("hostname") or None)


def model_source(plan, calibration, where: Path | None, baseline_file: Path | None) -> str:
    """Which memory model the plan used, and why: the calibration from a file, or the analytic model."""
    if plan.peak_model.source == "calibration":
        return (f"calibration from {where} (measured {calibration.measured_at or 'at an unknown time'} on "
                f"{calibration.device_name or 'an unnamed device'}, torch {calibration.torch_version or '?'})")
    if calibration is not None:
        return (f"analytic model: the calibration in {where} was measured on another workload (key "
                f"{calibration.workload_key}, this profile's {plan.workload.key()}); re-run "
                f"`launcher.py calibrate --profile {plan.profile}`")
    looked = f"no calibration in {baseline_file}" if baseline_file else "no baseline with a calibration"
    return f"analytic model ({looked}; `launcher.py calibrate --profile {plan.profile}` measures one on the GPU node)"


def document_sections(document: dict) -> list[tuple[str, dict]]:
    return [(section, values) for section, values in document.items() if isinstance(values, dict)]


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unlimited (CPU) budget is null."""
    return None if value == float("inf") else value


def _read_document(path: Path) -> dict:
    from core.fileio import read_json

    return read_json(path)


def _live_snapshot(profile) -> dict | None:
    """This machine's GPUs through NVML (no CUDA context); None for a CPU profile."""
    if profile.machine.device == "cpu":
        return None
    from core.errors import ConfigError

    try:
        return {"gpus": _nvml_gpus()}
    except Exception as error:  # pynvml missing, NVMLError_LibraryNotFound, driver errors
        raise ConfigError(f"cannot read this machine's GPUs through NVML ({type(error).__name__}: {error}); "
                          f"pass --snapshot FILE recorded on the node to plan for") from None


def _nvml_gpus() -> list[dict]:
    import pynvml

    pynvml.nvmlInit()
    try:
        return [_nvml_gpu(index, pynvml.nvmlDeviceGetHandleByIndex(index), pynvml)
                for index in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def _nvml_gpu(index: int, handle, pynvml) -> dict:
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name, uuid = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetUUID(handle)
    return {"index": index, "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_total_mib": info.total / 2**20, "memory_free_mib": info.free / 2**20}


def _storage(plan, args: argparse.Namespace):
    from dflash.memory.model import SEEDS_AVG_TOKENS, SEEDS_SAMPLES, offline_storage

    return offline_storage(plan.workload, samples=args.samples or SEEDS_SAMPLES,
                           avg_tokens=args.avg_tokens or SEEDS_AVG_TOKENS)


# --- output -------------------------------------------------------------------------------

COLUMNS = ("rank", "gpu", "free MiB", "overhead MiB", "budget MiB", "static MiB", "peak MiB", "fits", "micro", "accum")


def format_plan(plan, storage) -> list[str]:
    rows = [COLUMNS] + [_row(plan, rank_plan) for rank_plan in plan.ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["", f"memory plan ({plan.world_size} ranks; peak = {plan.peak_model.intercept_mib:.0f} + "
                 f"{plan.peak_model.slope_mib:.0f} x micro-batch MiB, from the {plan.peak_model.source}; "
                 f"worst case: {plan.workload.max_length} tokens, {plan.workload.anchors} anchors x "
                 f"{plan.workload.block_size} block tokens per sequence)"]
    lines.append(_optimizer_line(plan))
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines += _summary(plan, storage)
    return lines


def _optimizer_line(plan) -> str:
    """How the AdamW states are held, and the peak between steps (update, checkpoint save)."""
    figures, shards = plan.estimate, plan.workload.optimizer_shards
    if shards > 1:
        held = (f"AdamW states sharded over {shards} ranks (zero1): largest shard {_mib(figures.optimizer_states)} "
                f"MiB per rank, {_mib(figures.checkpoint_gather)} MiB more while a checkpoint gathers them to rank 0")
    else:
        held = f"AdamW states on every rank (optimizer_sharding none or one rank): {_mib(figures.optimizer_states)} MiB"
    return f"optimizer: {held}; peak between steps {_mib(plan.peak_model.between_steps_mib)} MiB"


def _row(plan, rank_plan) -> tuple[str, ...]:
    budget, batch = rank_plan.budget, plan.batch
    gpu = f"{budget.gpu.index}" if budget.gpu else "cpu"
    mark = " <" if budget.rank in plan.bottleneck_ranks else ""
    return (str(budget.rank), gpu, _mib(budget.free_mib), f"{_mib(budget.overhead_mib)} ({budget.overhead_source})",
            _mib(budget.budget_mib), _mib(plan.peak_model.static_mib), _mib(rank_plan.peak_at_agreed_mib),
            f"{rank_plan.feasible_micro_batch}{mark}", str(batch.micro_batch), str(batch.accum_steps))


def _mib(value: float) -> str:
    return "-" if value == float("inf") else f"{value:,.0f}"


def _summary(plan, storage) -> list[str]:
    batch = plan.batch
    lines = [f"global batch per optimizer step: {batch.global_batch} sequences = {plan.world_size} ranks x "
             f"{batch.accum_steps} micro-batches ({'+'.join(map(str, batch.micro_batch_sizes))})"]
    if plan.bottleneck_ranks:
        lines.append(f"bottleneck: rank(s) {', '.join(map(str, plan.bottleneck_ranks))} "
                     f"(fits marked '<'); every rank runs micro-batch {batch.micro_batch}")
    if min(r.feasible_micro_batch for r in plan.ranks) == 0:
        lines.append("NOT FEASIBLE: one sequence does not fit some rank's budget; lower data.max_length "
                     "or train.num_anchors, or free GPU memory")
    lines.append(f"offline hidden states for comparison: {storage.samples:,} samples x {storage.avg_tokens:,} tokens "
                 f"x {storage.layers} layers x {storage.hidden} hidden x {storage.dtype_bytes} B = "
                 f"{storage.bytes / 1e12:,.1f} TB (online extraction stores none)")
    return lines


def plan_as_dict(plan, storage) -> dict[str, Any]:
    import dataclasses

    return {
        "world_size": plan.world_size,
        "micro_batch": plan.batch.micro_batch,
        "accum_steps": plan.batch.accum_steps,
        "micro_batch_sizes": list(plan.batch.micro_batch_sizes),
        "global_batch": plan.batch.global_batch,
        "bottleneck_ranks": list(plan.bottleneck_ranks),
        "peak_model": dataclasses.asdict(plan.peak_model),
        "estimate_mib": {**dataclasses.asdict(plan.estimate), "static": plan.estimate.static,
                         "per_sequence": plan.estimate.per_sequence},
        "workload": {**dataclasses.asdict(plan.workload), "key": plan.workload.key()},
        "ranks": [_rank_as_dict(rank_plan) for rank_plan in plan.ranks],
        "offline_storage": {**dataclasses.asdict(storage), "bytes": storage.bytes, "terabytes": storage.bytes / 1e12},
    }


def _rank_as_dict(rank_plan) -> dict[str, Any]:
    import dataclasses

    budget = rank_plan.budget
    return {"rank": budget.rank, "gpu": dataclasses.asdict(budget.gpu) if budget.gpu else None,
            "free_mib": _finite(budget.free_mib), "overhead_mib": budget.overhead_mib,
            "overhead_source": budget.overhead_source, "margin_mib": budget.margin_mib,
            "budget_mib": _finite(budget.budget_mib), "feasible_micro_batch": rank_plan.feasible_micro_batch,
            "peak_at_agreed_mib": rank_plan.peak_at_agreed_mib}
