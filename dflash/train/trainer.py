"""Online DFlash training, run inside each torchrun rank (see `dflash.train.worker`).

One optimizer step = `accum_steps` micro-batches of `micro_batch` sequences on every rank (a
`BatchPlan`; the same number of forward/backward calls everywhere). The loss of the step is the
weighted cross entropy summed over all ranks' micro-batches divided by the GLOBAL weight sum
(all_reduce SUM before any backward), so gradients do not depend on how the batch is split, and
the micro-batch may change between steps (`run_step` re-runs from the same rows and anchors).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dflash.drafter.anchors import sample_anchors
from dflash.drafter.model import DFlashDrafter, forward_blocks
from dflash.drafter.loss import BlockTargets, LossParts, block_loss, block_targets, per_slot_accuracy, simulated_tau
from core.errors import DataError
from core.schema import Profile

FAIL_RANK_ENV = "DFLASH_FAIL_RANK"       # fault injection for tests: "RANK:STEP" raises on that rank


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> "WorkerEnv":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class BatchPlan:
    """`accum_steps` micro-batches of at most `micro_batch` sequences on one rank."""

    micro_batch: int
    accum_steps: int


def plan_batches(rows_per_rank: int, micro_batch: int) -> BatchPlan:
    micro_batch = max(1, min(micro_batch, rows_per_rank))
    return BatchPlan(micro_batch=micro_batch, accum_steps=math.ceil(rows_per_rank / micro_batch))


@dataclass
class MicroBatch:
    """Right-padded sequences and their anchors (padded anchors: 0, anchor_valid False)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    tokens: int
    rows: tuple[int, ...] = ()          # dataset rows (the feature cache's keys)
    lengths: tuple[int, ...] = ()       # unpadded length of each sequence

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(self.input_ids.to(device), self.loss_mask.to(device), self.anchors.to(device),
                          self.anchor_valid.to(device), self.tokens, self.rows, self.lengths)


@dataclass
class StepStats:
    loss: float
    acc: list[float]
    sim_tau: float
    tokens: int
    weight_sum: float
    seconds: float


class TrainData:
    """The Arrow dataset, the per-epoch order, each rank's rows of a step, and collation."""

    def __init__(self, path: Path, profile: Profile, env: WorkerEnv):
        import datasets

        if not Path(path).exists():
            raise DataError(f"{path}: no dataset; run `launcher.py tokenize --profile {profile.name}` first")
        self.dataset = datasets.load_from_disk(str(path)).with_format(None)
        missing = {"input_ids", "loss_mask"} - set(self.dataset.column_names)
        if missing:
            raise DataError(f"{path}: dataset lacks columns {sorted(missing)}; re-run tokenize")
        self.global_batch, self.env, self.train = profile.train.global_batch, env, profile.train
        self.max_length = profile.data.max_length
        self._check_sizes(path)

    def _check_sizes(self, path: Path) -> None:
        if self.global_batch % self.env.world_size:
            raise DataError(f"train.global_batch {self.global_batch} is not divisible by {self.env.world_size} ranks")
        if len(self.dataset) < self.global_batch:
            raise DataError(f"{path}: {len(self.dataset)} rows, fewer than train.global_batch {self.global_batch}")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch

    @property
    def rows_per_rank(self) -> int:
        return self.global_batch // self.env.world_size

    def step_rows(self, step: int) -> tuple[int, list[int]]:
        """(epoch, this rank's row indices) of global step `step` (0-based); drop-last per epoch."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.train.seed, epoch]).permutation(len(self.dataset))
        chosen = order[index * self.global_batch:(index + 1) * self.global_batch]
        return epoch, [int(row) for row in chosen[self.env.rank::self.env.world_size]]

    def collate(self, rows: list[int], epoch: int) -> MicroBatch:
        records = [self.dataset[row] for row in rows]
        ids = [list(r["input_ids"])[: self.max_length] for r in records]
        masks = [list(r["loss_mask"])[: self.max_length] for r in records]
        return collate_rows(ids, masks, rows, self.train.num_anchors, self.train.seed, epoch)


def collate_rows(ids: list[list[int]], masks: list[list[int]], rows: list[int], num_anchors: int,
                 seed: int, epoch: int) -> MicroBatch:
    """Right-pad sequences into a MicroBatch; anchors sampled per (seed, epoch, dataset row)."""
    anchors = [sample_anchors(m, num_anchors, seed=seed, epoch=epoch, row=row) for m, row in zip(masks, rows)]
    width, count = max(map(len, ids)), max(1, max(map(len, anchors)))
    batch = MicroBatch(torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long),
                       torch.zeros(len(rows), count, dtype=torch.long), torch.zeros(len(rows), count, dtype=torch.bool),
                       tokens=sum(map(len, ids)), rows=tuple(rows), lengths=tuple(map(len, ids)))
    for i, (seq, mask, anchor) in enumerate(zip(ids, masks, anchors)):
        batch.input_ids[i, : len(seq)] = torch.tensor(seq)
        batch.loss_mask[i, : len(mask)] = torch.tensor(mask)
        batch.anchors[i, : len(anchor)] = torch.from_numpy(anchor)
        batch.anchor_valid[i, : len(anchor)] = True
    return batch


@dataclass
class TrainState:
    """Everything a step needs. `model` is the DDP wrapper (or the drafter on one rank)."""

    env: WorkerEnv
    device: torch.device
    target: Any
    drafter: DFlashDrafter
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: TrainData
    layer_ids: list[int]
    decay: torch.Tensor
    backend: str
    grad_clip: float
    chunk_rows: int
    step: int = 0
    micro_batch: int = 1
    autocast: str = "auto"
    extras: dict[str, Any] = field(default_factory=dict)


def step_targets(drafter: DFlashDrafter, batch: MicroBatch) -> BlockTargets:
    """Labels of every block slot, as columns of the drafter's logits; slots whose token is
    outside the draft vocabulary (drafter.draft_vocab_size) carry no loss."""
    targets = block_targets(batch.input_ids, batch.loss_mask, batch.anchors, batch.anchor_valid, drafter.block_size)
    labels, inside = drafter.draft_labels(targets.labels)
    return BlockTargets(labels=labels, label_mask=targets.label_mask * inside)


def micro_weight_sum(state: TrainState, batch: MicroBatch) -> float:
    return float((step_targets(state.drafter, batch).label_mask * state.decay.cpu()).sum())


def forward_micro(state: TrainState, batch: MicroBatch) -> LossParts:
    """Target taps (no grad, truncated forward) -> drafter over all blocks -> loss parts."""
    from dflash.drafter.taps import extract_taps

    batch = batch.to(state.device)
    cache = state.extras.get("feature_cache")
    if cache is None:
        features = extract_taps(state.target, batch.input_ids, state.layer_ids)
    else:
        features = cache.features(batch, lambda ids: extract_taps(state.target, ids, state.layer_ids))
    with _autocast(state.device, state.autocast):
        hidden = forward_blocks(state.model, batch.input_ids, batch.anchors, features, state.backend)
        parts = block_loss(hidden, state.drafter.logits, step_targets(state.drafter, batch), state.decay,
                           state.chunk_rows)
    parts.weighted_ce = parts.weighted_ce + 0.0 * hidden.sum()   # keep every parameter in the graph
    return parts


def _autocast(device: torch.device, setting: str = "auto"):
    """The drafter's forward: bf16 autocast on CUDA ("auto"), on CPU only with train.autocast = "bfloat16"."""
    if setting == "bfloat16" or (setting == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def run_step(state: TrainState, rows: list[int], epoch: int, plan: BatchPlan) -> StepStats:
    """One optimizer step over this rank's `rows`, split as `plan` says. Re-runnable from the same rows.

    Collectives, identical on every rank: all_reduce(SUM) of the step's loss weight; the
    micro-batches' forward/backward (no collective: DDP's hooks are off); one all_reduce(SUM) of
    the gradients; the update. With `extras["autobatch"]` (dflash.train.autobatch.AutoBatch) the
    micro-batch is agreed across ranks and halved on all of them after an out-of-memory error.
    """
    started = time.perf_counter()
    local_weight = micro_weight_sum(state, state.data.collate(rows, epoch))
    global_weight = max(all_reduce_sum_float(local_weight, collective_device(state)), 1e-12)
    totals: dict[str, torch.Tensor] = {}

    def accumulate(micro_batch: int) -> None:
        state.optimizer.zero_grad(set_to_none=True)
        batches = [state.data.collate(rows[i:i + micro_batch], epoch) for i in range(0, len(rows), micro_batch)]
        totals["sums"], totals["tokens"] = _accumulate(state, batches, global_weight), sum(b.tokens for b in batches)

    auto = state.extras.get("autobatch")
    if auto is not None:
        state.micro_batch = auto.run_step(state.step + 1, accumulate, state.optimizer, lambda: _update(state)).micro_batch
    else:
        accumulate(plan.micro_batch)
        sync_gradients(state)
        _update(state)
    return _step_stats(state, totals["sums"], totals["tokens"], time.perf_counter() - started)


def _update(state: TrainState) -> None:
    torch.nn.utils.clip_grad_norm_(state.drafter.parameters(), state.grad_clip)
    state.optimizer.step()
    state.scheduler.step()


def sync_gradients(state: TrainState) -> None:
    from dflash.train.autobatch import sync_gradients as sum_gradients

    sum_gradients([p for p in state.drafter.parameters() if p.requires_grad])


def all_reduce_sum_float(value: float, device: torch.device) -> float:
    return float(all_reduce_sum(torch.tensor([value], dtype=torch.float64, device=device)).item())


def collective_device(state: TrainState) -> torch.device:
    """Where collective tensors live: the GPU for nccl, the CPU for gloo (or no process group)."""
    return state.device if state.device.type == "cuda" else torch.device("cpu")


def _accumulate(state: TrainState, batches: list[MicroBatch], global_weight: float) -> torch.Tensor:
    """Forward/backward of each micro-batch, loss / GLOBAL weight; gradients stay local (summed later)."""
    slots = state.drafter.block_size - 1
    totals = torch.zeros(2 + 2 * slots, dtype=torch.float64)
    no_sync = state.model.no_sync if hasattr(state.model, "no_sync") else contextlib.nullcontext
    for batch in batches:
        auto = state.extras.get("autobatch")
        if auto is not None:
            auto.inject("forward")
        with no_sync():
            parts = forward_micro(state, batch)
            (parts.weighted_ce / global_weight).backward()
        totals += torch.cat([parts.weighted_ce.detach().double().cpu().view(1),
                             parts.weight_sum.detach().double().cpu().view(1),
                             parts.correct.double().cpu(), parts.counted.double().cpu()])
    return totals


def _step_stats(state: TrainState, totals: torch.Tensor, tokens: int, local_seconds: float) -> StepStats:
    slots = state.drafter.block_size - 1
    summed = torch.cat([totals, torch.tensor([float(tokens)], dtype=torch.float64)])
    reduced = all_reduce_sum(summed.to(collective_device(state))).cpu()
    acc = per_slot_accuracy(reduced[2:2 + slots], reduced[2 + slots:2 + 2 * slots])
    weight = float(reduced[1])
    return StepStats(loss=float(reduced[0]) / weight if weight else math.nan, acc=acc,
                     sim_tau=simulated_tau([0.0 if math.isnan(a) else a for a in acc]),
                     tokens=int(reduced[-1]), weight_sum=weight, seconds=local_seconds)


def maybe_inject_failure(env: WorkerEnv, step: int) -> None:
    """Fault injection (tests, docs/train.md): DFLASH_FAIL_RANK=RANK:STEP raises on that rank."""
    spec = os.environ.get(FAIL_RANK_ENV, "")
    if spec and spec.split(":") == [str(env.rank), str(step)]:
        raise RuntimeError(f"injected failure on rank {env.rank} at step {step} ({FAIL_RANK_ENV}={spec})")


# ---- setup: process group, target, drafter, optimizer, schedule, resume -----------------------

def init_process_group(profile: Profile, env: WorkerEnv) -> torch.device:
    if profile.machine.device == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if env.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=profile.machine.backend, device_id=device if device.type == "cuda" else None)
    return device


def close_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather_memory_mib(device: torch.device) -> list[float]:
    """Peak memory of every rank in MiB (device memory on GPU, max RSS on CPU)."""
    if device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        import resource

        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not (dist.is_available() and dist.is_initialized()):
        return [round(mine, 1)]
    gathered = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([mine], device=device, dtype=torch.float32))
    return [round(float(t.item()), 1) for t in gathered]


def load_target(profile: Profile, device: torch.device, keep_layers: int | None = None) -> Any:
    """The frozen target (eval mode, no grads); layers past `keep_layers` are dropped (never run)."""
    from transformers import AutoModelForCausalLM

    from dflash.models import resolve_model_path

    path = resolve_model_path(profile.model.target)
    dtype = getattr(torch, profile.model.dtype)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    target.requires_grad_(False)
    if keep_layers is not None:
        target.model.layers = target.model.layers[:keep_layers]
    return target


def resolve_mask_token_id(profile: Profile, vocab_rows: int) -> int:
    """drafter.mask_token_id, else the tokenizer's mask token; it must be a row of the embedding."""
    mask_id = profile.drafter.mask_token_id
    if mask_id is None:
        mask_id = _tokenizer_mask_id(profile)
    if mask_id is None:
        raise ValueError(f"profile {profile.name}: the tokenizer has no mask token; set [drafter] mask_token_id "
                         f"to an embedding row the data never uses (Qwen3: 151669, a padding row)")
    if not 0 <= mask_id < vocab_rows:
        raise ValueError(f"profile {profile.name}: drafter.mask_token_id {mask_id} is not a row of the "
                         f"target's embedding (0..{vocab_rows - 1})")
    return int(mask_id)


def _tokenizer_mask_id(profile: Profile) -> int | None:
    from transformers import AutoTokenizer

    from dflash.models import resolve_model_path

    path = resolve_model_path(profile.model.tokenizer or profile.model.target)
    return AutoTokenizer.from_pretrained(path, local_files_only=True).mask_token_id


def resolve_layer_ids(profile: Profile, num_target_layers: int) -> list[int]:
    from dflash.drafter.taps import default_target_layer_ids

    ids = list(profile.drafter.target_layer_ids) or default_target_layer_ids(num_target_layers, profile.drafter.num_layers)
    bad = [k for k in ids if not 0 <= k < num_target_layers]
    if bad:
        raise ValueError(f"profile {profile.name}: drafter.target_layer_ids {bad} outside 0..{num_target_layers - 1}")
    return ids


def build_drafter(profile: Profile, target: Any, layer_ids: list[int], num_target_layers: int,
                  draft_vocab: list[int] | None = None) -> DFlashDrafter:
    """The drafter of the profile; `draft_vocab` (from `choose_draft_vocab`) when drafter.draft_vocab_size is set."""
    from dflash.drafter.model import drafter_config, init_from_target

    if profile.drafter.draft_vocab_size and not draft_vocab:
        raise ValueError(f"profile {profile.name}: drafter.draft_vocab_size is set; the drafter needs the "
                         f"draft vocabulary chosen from the dataset (choose_draft_vocab)")
    config = drafter_config(target.config, num_layers=profile.drafter.num_layers, block_size=profile.drafter.block_size,
                            target_layer_ids=layer_ids, mask_token_id=resolve_mask_token_id(profile, target.get_input_embeddings().num_embeddings),
                            draft_vocab_size=len(draft_vocab or []))
    config.num_target_layers = num_target_layers
    torch.manual_seed(profile.train.seed)
    drafter = DFlashDrafter(config).attach_target(target)
    if draft_vocab:
        drafter.set_draft_vocab(torch.tensor(draft_vocab, dtype=torch.long))
    if profile.drafter.init == "target":
        init_from_target(drafter, target, norm_scale=profile.drafter.norm_init)
    else:
        with torch.no_grad():
            drafter.norm.weight.fill_(profile.drafter.norm_init)
    return drafter


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float) -> Any:
    """Linear warmup over ceil(ratio * total) steps, then cosine to 0."""
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(profile: Profile, steps_per_epoch: int) -> int:
    return profile.train.max_steps or profile.train.epochs * steps_per_epoch


def build_state(profile: Profile, run_dir: Path, env: WorkerEnv, *, resume: bool) -> TrainState:
    from dflash.drafter.loss import decay_weights, default_gamma

    device = torch.device("cuda", env.local_rank) if profile.machine.device == "cuda" else torch.device("cpu")
    data = TrainData(_dataset_path(profile), profile, env)
    target = load_target(profile, device)
    num_target_layers = target.config.num_hidden_layers
    layer_ids = resolve_layer_ids(profile, num_target_layers)
    vocab = choose_draft_vocab(profile, data, env) if profile.drafter.draft_vocab_size else None
    drafter = build_drafter(profile, target, layer_ids, num_target_layers, vocab).to(device)
    target.model.layers = target.model.layers[: max(layer_ids) + 1]     # layers past the deepest tap never run
    gamma = default_gamma(profile.drafter.block_size, profile.train.decay_gamma)
    state = assemble_state(profile, env, device, target, drafter, data, layer_ids, decay_weights(drafter.block_size, gamma))
    if profile.train.feature_cache:
        state.extras["feature_cache"] = start_feature_cache(profile, run_dir, data, layer_ids)
    if resume:
        restore_checkpoint(state, run_dir)
    state.model = _wrap_ddp(drafter, device)
    state.extras["autobatch"] = _start_autobatch(state, run_dir)
    state.micro_batch = state.extras["autobatch"].micro_batch
    return state


def choose_draft_vocab(profile: Profile, data: TrainData, env: WorkerEnv) -> list[int]:
    """drafter.draft_vocab_size most frequent loss tokens of the dataset (the same on every rank)."""
    from dflash.drafter.draft_vocab import count_loss_tokens, coverage, draft_vocabulary

    counts = count_loss_tokens(data.dataset, data.max_length)
    vocab = draft_vocabulary(counts, profile.drafter.draft_vocab_size)
    if env.is_main:
        print(f"draft vocabulary: {len(vocab)} tokens (drafter.draft_vocab_size {profile.drafter.draft_vocab_size}; "
              f"{len(counts)} distinct in the data) cover {100 * coverage(counts, vocab):.1f}% of the loss tokens",
              flush=True)
    return vocab


def _start_autobatch(state: TrainState, run_dir: Path) -> Any:
    """Agree on one micro-batch (all_reduce MIN, never above the persisted one on a restart)."""
    from dflash.train.autobatch import AutoBatch, run_state_path

    log = (lambda line: print(line, flush=True)) if state.env.is_main else (lambda line: None)
    return AutoBatch.start(state.micro_batch, run_state_path(run_dir), state.env.rank, log=log)


def _dataset_path(profile: Profile) -> Path:
    from core.profile import expand_path

    return expand_path(profile, profile.paths.dataset)


def assemble_state(profile: Profile, env: WorkerEnv, device: torch.device, target: Any, drafter: DFlashDrafter,
                    data: TrainData, layer_ids: list[int], decay: torch.Tensor) -> TrainState:
    from dflash.drafter.attention import resolve_backend

    optimizer = build_optimizer(profile, [p for p in drafter.parameters() if p.requires_grad])
    steps = total_steps(profile, data.steps_per_epoch)
    return TrainState(env=env, device=device, target=target, drafter=drafter, model=drafter, optimizer=optimizer,
                      scheduler=cosine_schedule(optimizer, steps, profile.train.warmup_ratio), data=data,
                      layer_ids=layer_ids, decay=decay.to(device),
                      backend=resolve_backend(profile.train.attention, device.type), grad_clip=profile.train.grad_clip,
                      chunk_rows=profile.train.loss_chunk_rows, micro_batch=profile.train.max_micro_batch,
                      autocast=profile.train.autocast, extras={"total_steps": steps})


def start_feature_cache(profile: Profile, run_dir: Path, data: TrainData, layer_ids: list[int]) -> Any:
    """train.feature_cache: the run's shared per-row feature files (dflash.train.feature_cache)."""
    from dflash.train.feature_cache import FeatureCache, cache_directory

    key = {"dataset": str(_dataset_path(profile)), "fingerprint": getattr(data.dataset, "_fingerprint", ""),
           "rows": len(data.dataset), "target": profile.model.target, "dtype": profile.model.dtype,
           "layers": list(layer_ids), "max_length": data.max_length}
    return FeatureCache(cache_directory(run_dir, key))


def build_optimizer(profile: Profile, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW; with train.optimizer_sharding = "zero1" on several ranks its states are sharded
    (ZeroRedundancyOptimizer: each rank updates its parameters, then broadcasts them). The caller
    sums the gradients over the ranks before `step`, so every rank holds the full gradient."""
    settings = {"lr": profile.train.lr, "weight_decay": profile.train.weight_decay}
    if not sharded_optimizer_wanted(profile):
        return torch.optim.AdamW(params, **settings)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **settings)


def sharded_optimizer_wanted(profile: Profile) -> bool:
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return profile.train.optimizer_sharding == "zero1" and distributed


def full_optimizer_state(optimizer: torch.optim.Optimizer, to_rank: int = 0) -> dict[str, Any] | None:
    """The complete optimizer state on `to_rank` (None elsewhere). A sharded optimizer first gathers
    every rank's shard to `to_rank`: a collective, so EVERY rank must call this."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=to_rank)
        return optimizer.state_dict() if dist.get_rank() == to_rank else None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return optimizer.state_dict() if rank == to_rank else None


def optimizer_shard_count(optimizer: torch.optim.Optimizer) -> int:
    """Ranks the optimizer's states are sharded over (1: every rank holds them all)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.world_size if isinstance(optimizer, ZeroRedundancyOptimizer) else 1


def restore_checkpoint(state: TrainState, run_dir: Path) -> None:
    """Weights, optimizer, schedule, step and micro-batch from the latest checkpoint (if any)."""
    from safetensors.torch import load_file

    from dflash.drafter.checkpoint import WEIGHTS, latest_checkpoint, load_training_state

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        if state.env.is_main:
            print(f"no checkpoint under {run_dir}/train/checkpoints; starting from step 0", flush=True)
        return
    state.drafter.load_state_dict(load_file(str(checkpoint / WEIGHTS), device=str(state.device)))
    saved = load_training_state(checkpoint)
    state.optimizer.load_state_dict(saved["optimizer"])
    state.scheduler.load_state_dict(saved["scheduler"])
    state.step, state.micro_batch = int(saved["step"]), int(saved.get("micro_batch", state.micro_batch))
    if state.env.is_main:
        print(f"resumed from {checkpoint} (step {state.step})", flush=True)


def _wrap_ddp(drafter: DFlashDrafter, device: torch.device) -> torch.nn.Module:
    if not (dist.is_available() and dist.is_initialized()):
        return drafter
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated")
    # DDP broadcasts the initial weights; gradients are summed explicitly after the micro-batches
    # (run_step), so no collective ever runs inside a forward or backward.
    return DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False)
