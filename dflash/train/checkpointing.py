"""Sharded training checkpoints through torch.distributed.checkpoint (DCP), resumable at any world size.

`save_training_checkpoint` is a collective: every rank calls it.

    rank 0 makes a staging directory beside the checkpoints (`.step-N.*.tmp`) and tells the others;
    every rank writes its shards of the drafter and of the AdamW states into `dcp/` (dcp.save:
    one `__R_0.distcp` per rank, rank 0 the `.metadata`);
    the full weights are gathered to rank 0's host memory, one parameter at a time
    (get_model_state_dict, full_state_dict + cpu_offload), and rank 0 writes `model.safetensors`,
    `config.json` and `training_state.pt` (scheduler, step, micro-batch, world size), renames the
    staging directory to `step-N` and points `latest` at it (dflash.drafter.checkpoint.publish_checkpoint);
    no rank leaves before that (barrier).

`model.safetensors` is what `eval`, `export` and `drafter.init_from` read (the engines' and the
reference's format); `dcp/` is what `--resume` reads. DCP stores every tensor with its global
shape and each shard's offsets, so `restore_checkpoint` loads it into however many ranks the
resumed run has (resharding on load), where SpecForge's checkpoints need the same world size.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from launcher_core.errors import InputError

if TYPE_CHECKING:
    import torch

    from dflash.train.setup import TrainState

DCP_DIR = "dcp"
FORMAT = "dcp-1"


def save_training_checkpoint(state: TrainState, run_dir: Path) -> Path:
    """Every rank: its shards into the staging directory's dcp/; rank 0 the whole-weights files and
    the rename. Returns step-N's path (on every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dflash.train.dist import barrier

    staging = shared_staging_directory(run_dir, state.step, state.env.is_main)
    try:
        model_state, optimizer_state = get_state_dict(state.drafter, state.optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(staging / DCP_DIR))
        weights = full_weights(state)
        if state.env.is_main:
            from dflash.drafter.checkpoint import publish_checkpoint, write_checkpoint_files

            write_checkpoint_files(staging, weights, state.drafter.config, training_state(state))
            publish_checkpoint(run_dir, staging, state.step)
    except BaseException:
        if state.env.is_main:           # a save cut short (a full disk, a kill) leaves no staging directory behind
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier()
    from dflash.drafter.checkpoint import checkpoints_dir

    return checkpoints_dir(run_dir) / f"step-{state.step}"


def training_state(state: TrainState) -> dict[str, object]:
    return {"format": FORMAT, "step": state.step, "scheduler": state.scheduler.state_dict(),
            "micro_batch": state.micro_batch, "total_steps": state.total_steps,
            "world_size": state.env.world_size}


def shared_staging_directory(run_dir: Path, step: int, is_main: bool) -> Path:
    """Rank 0 makes `.step-N.*.tmp` beside the checkpoints; every rank gets its path."""
    import tempfile

    import torch.distributed as dist

    from dflash.drafter.checkpoint import checkpoints_dir
    from dflash.train.dist import distributed

    chosen: list[str | None] = [None]
    if is_main:
        root = checkpoints_dir(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        chosen[0] = tempfile.mkdtemp(prefix=f".step-{step}.", suffix=".tmp", dir=root)
    if distributed():
        dist.broadcast_object_list(chosen, src=0)
    assert chosen[0] is not None, "rank 0 names the staging directory"
    return Path(chosen[0])


def full_weights(state: TrainState) -> dict[str, torch.Tensor]:
    """The drafter's whole state dict on rank 0's host memory (a collective; {} elsewhere)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(state.drafter, options=options)
    return {name: tensor.contiguous() for name, tensor in weights.items() if isinstance(tensor, torch.Tensor)}


def restore_checkpoint(state: TrainState, run_dir: Path) -> Path | None:
    """Weights and AdamW states from the latest checkpoint's dcp/ (resharded to this world size),
    then the schedule, step and micro-batch. None when there is no checkpoint yet."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from dflash.drafter.checkpoint import latest_checkpoint, load_training_state

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        if state.env.is_main:
            print(f"no checkpoint under {run_dir}/train/checkpoints; starting from step 0", flush=True)
        return None
    require_sharded(checkpoint)
    model_state, optimizer_state = get_state_dict(state.drafter, state.optimizer)
    dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(checkpoint / DCP_DIR))
    set_state_dict(state.drafter, state.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    saved = load_training_state(checkpoint)
    state.scheduler.load_state_dict(saved["scheduler"])
    state.step, state.micro_batch = int(saved["step"]), int(saved.get("micro_batch", state.micro_batch))
    if state.env.is_main:
        written_by = int(saved.get("world_size", state.env.world_size))
        moved = f" (written by {written_by} rank(s), resharded to {state.env.world_size})" \
            if written_by != state.env.world_size else ""
        print(f"resumed from {checkpoint} (step {state.step}){moved}", flush=True)
    return checkpoint


def require_sharded(checkpoint: Path) -> None:
    """A checkpoint written before sharded checkpoints has no dcp/: its weights still serve
    `drafter.init_from`, but its optimizer state cannot be resumed."""
    if not (checkpoint / DCP_DIR / ".metadata").exists():
        raise InputError(f"{checkpoint}: no {DCP_DIR}/.metadata, so no sharded training state to resume "
                         f"(written before sharded checkpoints, or damaged). Start a new run from its weights: "
                         f"drafter.init = \"drafter\", drafter.init_from = \"{checkpoint}\"")
