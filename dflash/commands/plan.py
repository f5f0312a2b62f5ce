"""`launcher.py plan --profile P [--snapshot FILE] [--json]`: the resolved profile and the per-rank
memory plan (budgets, micro-batch, accumulation), the disk the checkpoints take and the host RAM the
node's ranks need at start. Starts nothing and never imports torch.

The memory model is the calibration stored in the baseline (`--baseline FILE`, else the profile's
saved baseline for the snapshot's host, where `launcher.py calibrate` writes it) when it was
measured on this workload, else the analytic model; the output says which (`memory model: ...`)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from launcher_core.cli import add_profile_option, load_profile_arg

if TYPE_CHECKING:
    from dflash.memory.budget import BatchPlan, Plan, RankPlan
    from dflash.memory.offline import OfflineStorage
    from envcheck.snapshot import Snapshot
    from launcher_core.schema import Profile


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
    parser.add_argument("--trace", action="store_true",
                        help="also trace the trainer's own step on fake tensors at the profile's world size (imports "
                             "torch; a few minutes per micro-batch at the flagship's shapes) and print it against "
                             "the model, at micro-batch 1 and 2")


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from dflash.memory.budget import make_plan
    from dflash.memory.checkpoint_costs import restart_cost
    from dflash.memory.launch_plan import model_source, read_inputs
    from dflash.memory.target_shape import describe_target
    from dflash.train.supervisor.watchdog import plan_figures
    from launcher_core.profile import profile_as_dict

    profile = load_profile_arg(args)
    inputs = read_inputs(profile, args.snapshot, args.baseline)
    plan = make_plan(profile, inputs.snapshot, baseline=inputs.baseline, calibration=inputs.calibration,
                     cuda_visible_devices=args.cuda_visible_devices)
    storage, source = _storage(plan, args), model_source(plan, inputs)
    checkpoints, checkpoints_json = checkpoint_figures(profile, plan, inputs.snapshot)
    restart = restart_cost(plan, profile.train, inputs.calibration.start_s if inputs.calibration else None)
    host_ram, host_ram_json = host_ram_figures(profile, plan, inputs.snapshot)
    train = profile.train
    stuck = plan_figures(train.stuck_floor_s, train.stuck_after_steps, train.collective_timeout_s, train.heartbeat_timeout_s)
    shape = plan.workload.target
    target = {"model_target": profile.model.target, "source": shape.source, "assumed": shape.assumed,
              "line": describe_target(shape)}
    if args.json:
        document = {"profile": profile_as_dict(profile), "plan": {**plan_as_dict(plan, storage), "model_source": source,
                                                                  "target": target,
                                                                  "checkpoints": checkpoints_json,
                                                                  "restart": {**asdict(restart), "line": restart.line()},
                                                                  "host_ram_at_start": host_ram_json,
                                                                  "stuck_rank": stuck}}
        print(json.dumps(document, indent=2))
        return 0
    print(f"profile {profile.name}: {profile.description}")
    for section, values in document_sections(profile_as_dict(profile)):
        print(f"[{section}]")
        print("\n".join(f"  {key} = {value!r}" for key, value in values.items()))
    print(f"\n{target['line']}")
    print("\n".join(format_plan(plan, storage, [checkpoints, restart.line(), host_ram, str(stuck["line"])])))
    print(f"memory model: {source}")
    if args.trace:
        print("\n".join(traced_vs_modelled(profile)))
    return 0


def traced_vs_modelled(profile: Profile, micro_batches: tuple[int, ...] = (1, 2)) -> list[str]:
    """`plan --trace`: the trainer's own step (dflash.measure.trace) traced per micro-batch against the model."""
    from dflash.measure import fake, trace

    lines = ["", "traced vs modelled (the trainer's step on fake tensors at the profile's world size; "
                 "the plan above uses the model):"]
    for micro_batch in micro_batches:
        traced = trace.trace_step(profile, micro_batch)
        workload = fake.workload_for_config(profile, fake.target_config(profile), traced.world_size)
        lines += fake.format_comparison(profile.name, traced, fake.compare(traced, workload))
    return lines


def document_sections(document: dict[str, object]) -> list[tuple[str, dict[str, object]]]:
    return [(section, values) for section, values in document.items() if isinstance(values, dict)]


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unlimited (CPU) budget is null."""
    return None if value == float("inf") else value


def _storage(plan, args: argparse.Namespace):
    from dflash.memory.offline import SEEDS_AVG_TOKENS, SEEDS_SAMPLES, offline_storage

    return offline_storage(plan.workload, samples=args.samples or SEEDS_SAMPLES,
                           avg_tokens=args.avg_tokens or SEEDS_AVG_TOKENS)


# --- output -------------------------------------------------------------------------------

def checkpoint_figures(profile: Profile, plan: Plan, snapshot: Optional[Snapshot]) -> tuple[str, dict[str, object]]:
    """The disk the run's checkpoints take, beside what the snapshot recorded free at its run directory (without
    a snapshot: this machine's, read now): the plan's line and its JSON."""
    from dataclasses import asdict

    from dflash.memory.checkpoint_costs import checkpoint_disk, run_dir_disk
    from envcheck.host import disk_usage
    from launcher_core.profile import expand_path

    run_dir = expand_path(profile, profile.paths.run_dir)
    disks = snapshot.host.disks if snapshot is not None else [d for d in [disk_usage(run_dir)] if d is not None]
    disk, free = checkpoint_disk(plan, profile.train), run_dir_disk(disks, str(run_dir))
    document = {**asdict(disk), "each_mib": disk.each_mib, "held": disk.held, "need_mib": disk.need_mib,
                "free_mib": free.free_mib if free else None, "fits": disk.problem(free) is None}
    return disk.line(free), document


def host_ram_figures(profile: Profile, plan: Plan, snapshot: Optional[Snapshot]) -> tuple[str, dict[str, object]]:
    """The host RAM the node's ranks need at start, beside the RAM the snapshot recorded (without a snapshot:
    this machine's, read now): the plan's line and its JSON."""
    from dataclasses import asdict

    from dflash.memory.host_ram import host_ram_at_start
    from envcheck.host import ram_mib

    need = host_ram_at_start(profile, plan)
    ram = snapshot.host.ram_total_mib if snapshot is not None else ram_mib()[0]
    document = {**asdict(need), "per_rank_mib": need.per_rank_mib, "node_mib": need.node_mib,
                "whole_per_rank_mib": need.whole_per_rank_mib, "whole_node_mib": need.whole_node_mib,
                "ram_mib": ram or None, "fits": need.problem(ram) is None}
    return need.line(ram), document


COLUMNS = ("rank", "gpu", "free MiB", "overhead MiB", "budget MiB", "static MiB", "peak MiB", "reserved MiB", "fits",
           "micro", "accum")


def format_plan(plan: Plan, storage: OfflineStorage, run_lines: Sequence[str] = ()) -> list[str]:
    """The plan's lines; `run_lines`: those of dflash.memory.checkpoint_costs (the disk the run's checkpoints take,
    what an OOM restart costs)."""
    from dflash.memory.launch_plan import describe_reserve

    rows = [COLUMNS] + [_row(plan, rank_plan) for rank_plan in plan.ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["", f"memory plan ({plan.world_size} ranks; peak = {plan.peak_model.intercept_mib:.0f} + "
                 f"{plan.peak_model.slope_mib:.0f} x micro-batch MiB{_accumulation(plan)}, from the {plan.peak_model.source}; "
                 f"worst case: {plan.workload.max_length} tokens, {plan.workload.anchors} anchors x "
                 f"{plan.workload.block_size} block tokens per sequence)"]
    lines.append(_optimizer_line(plan))
    lines.append(describe_reserve(plan))
    lines += list(run_lines)
    lines += ["  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines += _summary(plan, storage)
    return lines


def _accumulation(plan: Plan) -> str:
    """The gradients alive from the second micro-batch of a step on (when micro-batches accumulate)."""
    model = plan.peak_model
    if not model.accumulation_mib or plan.batch.micro_batch >= model.rank_share:
        return ""
    return f" + {model.accumulation_mib:.0f} of gradients while micro-batches accumulate"


def _optimizer_line(plan: Plan) -> str:
    """How the drafter is sharded, the peak between steps, what one target forward trains, and
    how the checkpoints resume."""
    figures, workload = plan.estimate, plan.workload
    world = plan.world_size
    sharded = (f"drafter sharded over {world} rank(s) by FSDP2: {_mib(figures.drafter_weights)} MiB of float32 weights "
               f"+ {_mib(figures.optimizer_states)} of AdamW states per rank, {_mib(figures.gathered_weights)} gathered "
               f"in {workload.compute_dtype} in a forward/backward; peak between steps "
               f"{_mib(plan.peak_model.between_steps_mib)} MiB")
    signal = (f"supervised slots per target forward: {workload.supervised_slots:,} per sequence "
              f"({workload.anchors} anchors x {workload.block_size - 1} slots), "
              f"{workload.supervised_slots * plan.batch.micro_batch:,} per micro-batch; activation checkpointing: "
              f"{workload.activation_checkpointing}; gradients reduced {workload.gradient_sync.replace('_', ' ')}")
    return "\n".join([sharded, signal])


def _row(plan: Plan, rank_plan: RankPlan) -> tuple[str, ...]:
    budget, batch = rank_plan.budget, plan.batch
    gpu = f"{budget.gpu.index}" if budget.gpu else "cpu"
    mark = " <" if budget.rank in plan.bottleneck_ranks else ""
    return (str(budget.rank), gpu, _mib(budget.free_mib), f"{_mib(budget.overhead_mib)} ({budget.overhead_source})",
            _mib(budget.budget_mib), _mib(plan.peak_model.static_mib), _mib(rank_plan.peak_at_agreed_mib),
            _mib(plan.reserve.reserved_mib(rank_plan.peak_at_agreed_mib)), f"{rank_plan.feasible_micro_batch}{mark}", str(batch.micro_batch), str(batch.accum_steps))


def _mib(value: float) -> str:
    return "-" if value == float("inf") else f"{value:,.0f}"


def micro_batch_split(batch: BatchPlan) -> str:
    """The sizes of a rank's micro-batches, in a line of fixed length: "2+2+1" for a few, "4 x 250,000
    + 3" for many (never one number per micro-batch)."""
    full, rest = divmod(batch.rank_share, batch.micro_batch)
    if full + bool(rest) <= 8:
        return "+".join(map(str, [batch.micro_batch] * full + ([rest] if rest else [])))
    return f"{batch.micro_batch} x {full:,}" + (f" + {rest}" if rest else "")


def _summary(plan: Plan, storage: OfflineStorage) -> list[str]:
    batch = plan.batch
    lines = [f"global batch per optimizer step: {batch.global_batch} sequences = {plan.world_size} ranks x "
             f"{batch.accum_steps} micro-batches ({micro_batch_split(batch)})"]
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


LISTED_MICRO_BATCHES = 64


def plan_as_dict(plan: Plan, storage: OfflineStorage) -> dict[str, object]:
    import dataclasses

    from dflash.memory.launch_plan import reserve_document

    return {
        "world_size": plan.world_size,
        "micro_batch": plan.batch.micro_batch,
        "accum_steps": plan.batch.accum_steps,
        # one number per micro-batch only while they are few; `micro_batch_split` always
        "micro_batch_sizes": list(plan.batch.micro_batch_sizes) if plan.batch.accum_steps <= LISTED_MICRO_BATCHES else None,
        "micro_batch_split": dict(zip(("micro_batch", "full", "last"),
                                      (plan.batch.micro_batch, *divmod(plan.batch.rank_share, plan.batch.micro_batch)))),
        "global_batch": plan.batch.global_batch,
        "bottleneck_ranks": list(plan.bottleneck_ranks),
        "peak_model": dataclasses.asdict(plan.peak_model),
        "reserve": reserve_document(plan),
        "estimate_mib": {**dataclasses.asdict(plan.estimate), "static": plan.estimate.static,
                         "per_sequence": plan.estimate.per_sequence},
        "workload": {**dataclasses.asdict(plan.workload), "key": plan.workload.key()},
        "ranks": [_rank_as_dict(rank_plan) for rank_plan in plan.ranks],
        "offline_storage": {**dataclasses.asdict(storage), "bytes": storage.bytes, "terabytes": storage.bytes / 1e12},
    }


def _rank_as_dict(rank_plan: RankPlan) -> dict[str, object]:
    import dataclasses

    budget = rank_plan.budget
    return {"rank": budget.rank, "gpu": dataclasses.asdict(budget.gpu) if budget.gpu else None,
            "free_mib": _finite(budget.free_mib), "overhead_mib": budget.overhead_mib,
            "overhead_source": budget.overhead_source, "margin_mib": budget.margin_mib,
            "budget_mib": _finite(budget.budget_mib), "feasible_micro_batch": rank_plan.feasible_micro_batch,
            "peak_at_agreed_mib": rank_plan.peak_at_agreed_mib}
