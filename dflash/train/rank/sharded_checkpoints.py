"""Sharded training checkpoints through torch.distributed.checkpoint (DCP), resumable at any world size.

Every save is a collective. Rank 0 stages `.step-N.*.tmp` beside the checkpoints with `config.json`
and `training_state.pt` (scheduler, step, micro-batch, world size); every rank writes its shards of
the drafter and of the AdamW states into `dcp/`; the run's last save also gathers the full weights
to rank 0's host, one parameter at a time, into `model.safetensors`; rank 0 renames the stage to
`step-N` and points `latest` at it (dflash.drafter.checkpoint_files.publish_checkpoint). A kill or a failed
save leaves `latest` on the previous whole checkpoint (`--resume` removes the stage); a full disk is
raised as DiskFull on every rank, naming the bytes needed and free (`abandon_save`), not as the
writer's words (DCP's CheckpointException, torch's "unexpected pos").

`AsyncCheckpointer` (train.async_save, the default) writes the shards from host copies in a thread
while the rank trains on, on a gloo process group of its own so its collectives never interleave
with the step's; rank 0 publishes at the first step boundary after the write, and a rank waits for a
save still being written before the next, before a stop's save and before the last. DCP keeps each
tensor's global shape and shard offsets, so `restore_checkpoint` reshards onto any number of ranks;
`eval`, `export` and `drafter.init_from` read an intermediate step's weights from its `dcp/`.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, cast

from dflash.drafter.checkpoint_files import DCP_DIR
from launcher_core.errors import DiskFull, InputError

if TYPE_CHECKING:
    import torch

    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import TrainState

FORMAT = "dcp-1"
WRITING = "a checkpoint (and the run's logs)"     # what a full disk's message says was being written
SMALL_FILES_BYTES = 16 * 1024                      # config.json, training_state.pt
ITEM_BYTES = 2048                                  # DCP's container of each item it writes (a torch.save zip) and its .metadata entry


def save_training_checkpoint(state: TrainState, run_dir: Path, *, with_weights: bool = True) -> Path:
    """Every rank, synchronously: its shards into the staging directory's dcp/, `model.safetensors` too when
    `with_weights` (the run's last save), then rank 0's rename. Returns step-N's path (on every rank)."""
    import torch.distributed.checkpoint as dcp

    from dflash.train.rank.parallel import barrier

    staging = shared_staging_directory(run_dir, state.step, state.env.is_main)
    needed: Optional[int] = None
    try:
        shards = sharded_state(state)
        needed = save_bytes(shards, with_weights)
        write_small_files(state, staging, run_dir)
        dcp.save(shards, checkpoint_id=str(staging / DCP_DIR))
        weights = full_weights(state) if with_weights else {}
        if state.env.is_main:
            from dflash.drafter.checkpoint_files import publish_checkpoint, write_weights

            if with_weights:
                write_weights(staging, weights)
            publish_checkpoint(run_dir, staging, state.step)
    except BaseException as error:
        full = abandon_save(error, staging, run_dir, state.env.is_main, needed)
        if full is None:
            raise
        raise full from error
    barrier()
    from dflash.drafter.checkpoint_files import checkpoints_dir

    return checkpoints_dir(run_dir) / f"step-{state.step}"


def sharded_state(state: TrainState) -> dict[str, object]:
    """The drafter's and AdamW's sharded state dicts, as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(state.drafter, state.optimizer)
    return {"model": model_state, "optim": optimizer_state}


def save_bytes(shards: dict[str, object], with_weights: bool) -> int:
    """About what a save writes over all ranks: every tensor of the sharded state at its global size (DCP
    writes each shard once) and each item's container, the small files, and the whole weights again when
    `with_weights` (model.safetensors): 1 to 6 % above the files of the tests' drafters."""
    stored = sum(leaf_bytes(leaf) + ITEM_BYTES * shard_count(leaf) for leaf in leaves(shards))
    weights = sum(leaf_bytes(leaf) for leaf in leaves(shards.get("model")))
    return stored + SMALL_FILES_BYTES + (weights if with_weights else 0)


def leaves(tree: object) -> Iterator[object]:
    """The values of a nested state dict (tensors, and the optimizer's numbers)."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from leaves(value)
    elif tree is not None:
        yield tree


def leaf_bytes(leaf: object) -> int:
    """A tensor's bytes at its global size (a DTensor's numel is the whole tensor's); 0 for anything else."""
    import torch

    return leaf.numel() * leaf.element_size() if isinstance(leaf, torch.Tensor) else 0


def shard_count(leaf: object) -> int:
    """The items DCP writes for a value: one per shard of a DTensor, one for anything else."""
    from torch.distributed.tensor import DTensor

    return leaf.device_mesh.size() if isinstance(leaf, DTensor) else 1


def abandon_save(error: BaseException, staging: Path, run_dir: Path, is_main: bool,
                 needed: Optional[int]) -> Optional[DiskFull]:
    """A save that failed with `error`: rank 0 removes its staging directory. Returns the DiskFull it
    amounts to (None: another failure), judged first, while the bytes the save wrote still fill the disk,
    against `needed` (the whole save: launcher_core.diskfull.disk_full_of)."""
    from launcher_core.diskfull import disk_full_of

    full = disk_full_of(error, run_dir / "train", needed, WRITING)
    remove_staging(staging, is_main)
    return full


def write_small_files(state: TrainState, staging: Path, run_dir: Path) -> None:
    """Every rank measures the weights being saved (`trained_rms`, a collective); rank 0 writes config.json and
    training_state.pt of the step, and the training data's rendering record the launcher wrote
    (train/training_data.json; eval's mode check reads it from the checkpoint)."""
    state.weights_rms = trained_rms(state.drafter)
    if state.env.is_main:
        import shutil

        from dflash.drafter.checkpoint_files import TRAINING_DATA, write_checkpoint_files

        write_checkpoint_files(staging, None, state.drafter.config, training_state(state))
        record = run_dir / "train" / TRAINING_DATA
        if record.is_file():
            shutil.copyfile(record, staging / TRAINING_DATA)


def remove_staging(staging: Path, is_main: bool) -> None:
    """Rank 0: a save cut short (a full disk, a kill) leaves no staging directory behind."""
    if is_main:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


@dataclass
class PendingSave:
    """A save whose shards are still being written by DCP's thread."""

    step: int
    staging: Path
    done: Future
    started: float              # time.monotonic() when the ranks went on training
    needed: Optional[int]       # bytes the save writes (save_bytes)


@dataclass(frozen=True)
class Published:
    """A checkpoint rank 0 has put in place."""

    step: int
    path: Path
    seconds: float              # from the save's start to its publication
    trained_steps: int          # steps the ranks trained while its shards were written

    def line(self) -> str:
        return (f"checkpoint {self.path} in place after {self.seconds:.1f} s; the ranks trained "
                f"{self.trained_steps} step(s) while its shards were written (train.async_save)")


class AsyncCheckpointer:
    """train.async_save: one save at a time, its shards written by a thread while the ranks train on."""

    def __init__(self, run_dir: Path, env: WorkerEnv):
        import torch.distributed as dist

        self.run_dir, self.env = run_dir, env
        self.group = dist.new_group(backend="gloo")        # every rank, in the same order: a collective
        self.pending: PendingSave | None = None

    def start(self, state: TrainState) -> None:
        """Every rank, with no save pending (`wait` first): begin writing this step's shards."""
        import time

        import torch.distributed.checkpoint as dcp

        assert self.pending is None, "one save at a time: wait for the pending one first"
        staging = shared_staging_directory(self.run_dir, state.step, self.env.is_main)
        needed: Optional[int] = None
        try:
            shards = sharded_state(state)
            needed = save_bytes(shards, with_weights=False)
            write_small_files(state, staging, self.run_dir)
            response = dcp.async_save(shards, checkpoint_id=str(staging / DCP_DIR), process_group=self.group)
        except BaseException as error:
            full = abandon_save(error, staging, self.run_dir, self.env.is_main, needed)
            if full is None:
                raise
            raise full from error
        done = cast(Future, getattr(response, "upload_completion", response))    # a Future, or a response holding one
        self.pending = PendingSave(state.step, staging, done, time.monotonic(), needed)

    def poll(self, state: TrainState) -> Published | None:
        """Every rank, between steps: the pending save put in place by rank 0 once its shards are written."""
        if self.pending is None or not self.pending.done.done():
            return None
        return self._finish(state)

    def wait(self, state: TrainState, timeout_s: float | None = None) -> Published | None:
        """Every rank: block until the pending save (if any) is written (TimeoutError after `timeout_s`), then
        put it in place."""
        return self._finish(state, timeout_s) if self.pending is not None else None

    def _finish(self, state: TrainState, timeout_s: float | None = None) -> Published | None:
        import time

        from dflash.drafter.checkpoint_files import publish_checkpoint

        pending, self.pending = self.pending, None
        assert pending is not None
        try:
            pending.done.result(timeout=timeout_s)      # a write that failed (a full disk) raises here, on this rank
            if not self.env.is_main:
                return None
            path = publish_checkpoint(self.run_dir, pending.staging, pending.step)
        except TimeoutError:
            raise                               # still being written: the launcher judges it (remove_partial_saves)
        except BaseException as error:          # the writer thread's error (DCP's CheckpointException), or publishing's
            full = abandon_save(error, pending.staging, self.run_dir, self.env.is_main, pending.needed)
            if full is None:
                raise
            raise full from error
        return Published(pending.step, path, time.monotonic() - pending.started, state.step - pending.step)


def training_state(state: TrainState) -> dict[str, object]:
    """training_state.pt: the schedule and counters a resume restores, and what judges whether the run can train
    from the checkpoint (dflash.train.supervisor.resume.WeightsRecord): the trained weights' RMS, the run's initial
    one and the loss of the checkpoint's step."""
    return {"format": FORMAT, "step": state.step, "scheduler": state.scheduler.state_dict(),
            "micro_batch": state.micro_batch, "total_steps": state.total_steps,
            "world_size": state.env.world_size, "skipped_steps": state.skipped_steps,
            "skipped_in_a_row": state.skipped_in_a_row, "weights_rms": state.weights_rms,
            "initial_weights_rms": state.initial_weights_rms, "loss": state.last_loss}


def note_initial_weights(state: TrainState) -> None:
    """Every rank, before the first step: the trained weights' RMS at the run's start, what each save's is judged
    by; a resumed run keeps the one its checkpoint recorded (one written without it: the weights resumed)."""
    if state.initial_weights_rms is None:
        state.initial_weights_rms = trained_rms(state.drafter)


RMS_CHUNK = 1 << 22       # values squared at a time in float64 (32 MiB), whatever a shard's size


def trained_rms(drafter: torch.nn.Module) -> float:
    """The root mean square of every trained value of the drafter (its parameters that take gradients, over
    all ranks' shards: a collective), summed in float64 (weights near 1e30 do not overflow it): inf or NaN when
    the weights are. One pass over this rank's shards, no data."""
    import torch

    from dflash.train.rank.parallel import all_reduce_tensor, local_tensor

    sums = torch.zeros(2, dtype=torch.float64)
    for parameter in drafter.parameters():
        if parameter.requires_grad:
            values = local_tensor(parameter.detach()).reshape(-1)
            sums[0] += square_sum(values)
            sums[1] += values.numel()
    total = all_reduce_tensor(sums, "SUM")
    return float((total[0] / total[1]).sqrt()) if total[1] > 0 else 0.0


def square_sum(values: torch.Tensor) -> float:
    """The sum of the squares of a flat tensor, in float64, RMS_CHUNK values at a time (a bounded transient)."""
    import torch

    total = 0.0
    for chunk in values.split(RMS_CHUNK):
        wide = chunk.double()
        total += float(torch.dot(wide, wide))
    return total


def shared_staging_directory(run_dir: Path, step: int, is_main: bool) -> Path:
    """Rank 0 makes `.step-N.*.tmp` beside the checkpoints; every rank gets its path."""
    import tempfile

    import torch.distributed as dist

    from dflash.drafter.checkpoint_files import checkpoints_dir
    from dflash.train.rank.parallel import distributed

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

    from dflash.drafter.checkpoint_files import latest_checkpoint, load_training_state

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        if state.env.is_main:
            print(f"no checkpoint under {run_dir}/train/checkpoints; starting from step 0", flush=True)
        return None
    require_sharded(checkpoint)
    profile_lrs = [float(group["initial_lr"]) for group in state.optimizer.param_groups]
    model_state, optimizer_state = get_state_dict(state.drafter, state.optimizer)
    dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(checkpoint / DCP_DIR))
    set_state_dict(state.drafter, state.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    saved = load_training_state(checkpoint)
    state.scheduler.load_state_dict(saved["scheduler"])
    trained_at = apply_profile_lr(state, profile_lrs)
    state.step, state.micro_batch = int(saved["step"]), int(saved.get("micro_batch", state.micro_batch))
    state.skipped_steps, state.skipped_in_a_row = int(saved.get("skipped_steps", 0)), int(saved.get("skipped_in_a_row", 0))
    initial = saved.get("initial_weights_rms")
    state.initial_weights_rms = float(initial) if initial is not None else None
    if state.env.is_main:
        written_by = int(saved.get("world_size", state.env.world_size))
        moved = f" (written by {written_by} rank(s), resharded to {state.env.world_size})" \
            if written_by != state.env.world_size else ""
        print(f"resumed from {checkpoint} (step {state.step}){moved}", flush=True)
        if trained_at != profile_lrs[0]:
            print(f"train.lr = {profile_lrs[0]:g} from step {state.step + 1} on (the checkpoint was trained at "
                  f"{trained_at:g}; the schedule's warmup and cosine go on from its step)", flush=True)
    return checkpoint


def apply_profile_lr(state: TrainState, profile_lrs: list[float]) -> float:
    """The profile's train.lr over the restored schedule: the checkpoint's scheduler and AdamW states carry the
    lr the run was trained at, which would otherwise stay (a run resumed with a lower train.lr after a loss that
    diverged diverged again). Returns the lr the checkpoint was trained at."""
    from torch.optim.lr_scheduler import LambdaLR

    scheduler = state.scheduler
    assert isinstance(scheduler, LambdaLR), "dflash.train.rank.setup.cosine_schedule"
    trained_at = float(scheduler.base_lrs[0])
    scheduler.base_lrs = list(profile_lrs)
    for group, base, factor in zip(state.optimizer.param_groups, profile_lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * factor(scheduler.last_epoch)
    return trained_at


def require_sharded(checkpoint: Path) -> None:
    """A checkpoint written before sharded checkpoints has no dcp/: its weights still serve
    `drafter.init_from`, but its optimizer state cannot be resumed."""
    if not (checkpoint / DCP_DIR / ".metadata").exists():
        raise InputError(f"{checkpoint}: no {DCP_DIR}/.metadata, so no sharded training state to resume "
                         f"(written before sharded checkpoints, or damaged). Start a new run from its weights: "
                         f"drafter.init = \"drafter\", drafter.init_from = \"{checkpoint}\"")
