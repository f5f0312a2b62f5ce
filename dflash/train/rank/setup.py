"""The training state of one rank, and the one entry point that builds it (`build_state`):
dataset, frozen target (loaded up to its deepest tap), the drafter sharded by FSDP2
(dflash.train.rank.parallel), optimizer and schedule, feature cache, resume from the latest sharded
checkpoint (dflash.train.rank.sharded_checkpoints) and the agreed micro-batch.

Every rank builds the same drafter (the same seed, the same target) on the meta device, shards it,
and then materialises only its shard of each parameter (dflash.train.rank.materialize, torchtitan's
order): nothing needs to be broadcast, each shard has one owner, and no rank holds the whole drafter.

Tests, benchmarks and the GPU checks build their state through `build_state` too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from dflash.drafter.attention import make_layer_attends
from dflash.drafter.loss import LossObjective, SelectorObjective
from dflash.drafter.network import DFlashDrafter, InitValue, LayerAttendsFactory
from dflash.train.rank.data import StepData, TrainData
from dflash.train.rank.parallel import WorkerEnv
from dflash.train.supervisor.heartbeat import RankProgress
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedModel, Qwen3Config

    from dflash.drafter.attention import Backend
    from dflash.train.rank.autobatch import AutoBatch
    from dflash.train.rank.feature_cache import FeatureCache, FeatureSource


@dataclass
class TrainState:
    """Everything a step needs. `drafter` is sharded by FSDP2: its forward and backward gather and
    reduce across the ranks, so every rank runs the same number of them."""

    env: WorkerEnv
    device: torch.device
    target: PreTrainedModel
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    data: StepData
    layer_ids: list[int]
    decay: torch.Tensor
    backend: Backend
    grad_clip: float
    chunk_rows: int
    total_steps: int
    step: int = 0
    micro_batch: int = 1
    autocast: str = "auto"
    compute_dtype: str = "float32"                  # train.compute_dtype (FSDP2's param_dtype for the forward)
    gradient_sync: str = "every_micro_batch"        # train.gradient_sync (dflash.train.rank.step.accumulate_micro_batches)
    autobatch: AutoBatch | None = None              # agreed micro-batch, OOM recovery (set by build_state)
    feature_cache: FeatureSource | None = None      # train.feature_cache
    last_loss: float | None = None                  # of the last step (for the run manifest)
    skipped_steps: int = 0                          # steps skipped without a supervised position, whole run (loss_check)
    skipped_in_a_row: int = 0                       # ... since the last step that trained (train.max_skipped_steps bounds it)
    weights_rms: float | None = None                # the trained weights' RMS at the last save (sharded_checkpoints.trained_rms)
    initial_weights_rms: float | None = None        # ... at the run's start (restored on resume): what a save is judged by
    mem_mib: list[float] = field(default_factory=list)   # every rank's peak memory at the last logged step
    predicted_peak_mib: float | None = None         # the memory plan's peak at the agreed micro-batch
    layer_attends: LayerAttendsFactory = make_layer_attends   # the forward's attention (the memory trace passes its own)
    selector: SelectorObjective = field(default_factory=SelectorObjective)   # DFlash 2: train.selector_* (dflash.drafter.loss)
    loss: LossObjective = field(default_factory=LossObjective)   # train.loss, train.dpace_alpha (dflash.drafter.loss)
    progress: RankProgress = field(default_factory=RankProgress)   # the phase marks the heartbeat reports


def resolve_mask_token_id(profile: Profile, vocab_rows: int) -> int:
    """drafter.mask_token_id, else the tokenizer's mask token (a row of the embedding: the launch
    checks, dflash.train.supervisor.launch_checks, refuse a profile where it is missing or out of range)."""
    mask_id = profile.drafter.mask_token_id
    if mask_id is None:
        mask_id = _tokenizer_mask_id(profile)
    assert mask_id is not None and 0 <= mask_id < vocab_rows, "the launch checks hold drafter.mask_token_id"
    return int(mask_id)


def _tokenizer_mask_id(profile: Profile) -> int | None:
    """The tokenizer's mask token, read from its files (the reader the launch checks use)."""
    from dflash.tokenizer import tokenizer_dir_for, tokenizer_mask_token_id

    return tokenizer_mask_token_id(tokenizer_dir_for(profile))


def resolve_layer_ids(profile: Profile, num_target_layers: int) -> list[int]:
    """drafter.target_layer_ids, else the default spacing (inside the target: the launch checks)."""
    from dflash.drafter.taps import default_target_layer_ids

    ids = list(profile.drafter.target_layer_ids) or default_target_layer_ids(num_target_layers, profile.drafter.num_layers)
    assert all(0 <= k < num_target_layers for k in ids), "the launch checks hold drafter.target_layer_ids"
    return ids


def build_drafter(profile: Profile, target: PreTrainedModel, layer_ids: list[int], num_target_layers: int,
                  draft_vocab: list[int] | None = None) -> DFlashDrafter:
    """The whole drafter, unsharded, on the host (tests, benchmarks, the one-process tools; the ranks
    build theirs sharded, `build_sharded_drafter`, to the same values): the profile's shape, seeded by
    train.seed, started as drafter.init says (`initial_values`), with its draft vocabulary."""
    from dflash.drafter.dflash2 import drafter_for_config
    from dflash.drafter.network import assign_values

    config = drafter_config_for(profile, target, layer_ids, num_target_layers, draft_vocab)
    torch.manual_seed(profile.train.seed)
    drafter = drafter_for_config(config).attach_target(target)
    assign_values(drafter, initial_values(profile, drafter, target, draft_vocab))
    return drafter


def build_sharded_drafter(profile: Profile, target: PreTrainedModel, layer_ids: list[int], num_target_layers: int,
                          draft_vocab: list[int] | None, device: torch.device, mesh: DeviceMesh) -> DFlashDrafter:
    """The rank's drafter in torchtitan's order: built on the meta device, sharded by FSDP2 over `mesh`
    (dflash.train.rank.parallel), then given memory on `device` and its values one init unit at a time
    (dflash.train.rank.materialize): the global parameters are `build_drafter`'s for the same seed, and the
    rank never holds the whole drafter."""
    from dflash.drafter.dflash2 import drafter_for_config
    from dflash.train.rank.materialize import materialize
    from dflash.train.rank.parallel import shard_drafter

    config = drafter_config_for(profile, target, layer_ids, num_target_layers, draft_vocab)
    with torch.device("meta"):
        drafter = drafter_for_config(config)
    drafter.attach_target(target)
    shard_drafter(drafter, mesh, compute_dtype=profile.train.compute_dtype,
                  reshard_after_forward=profile.train.reshard_after_forward)
    values = initial_values(profile, drafter, target, draft_vocab)
    torch.manual_seed(profile.train.seed)
    materialize(drafter, device, values)
    return drafter


def drafter_config_for(profile: Profile, target: PreTrainedModel, layer_ids: list[int], num_target_layers: int,
                       draft_vocab: list[int] | None) -> Qwen3Config:
    """The profile's drafter config around the target (`draft_vocab` from `choose_draft_vocab` when
    drafter.draft_vocab_size is set)."""
    from dflash.drafter.dflash2 import profile_dflash2_options, with_dflash2
    from dflash.drafter.layers import profile_layer_options
    from dflash.drafter.network import drafter_config
    from dflash.drafter.shape import profile_shape

    if profile.drafter.draft_vocab_size and not draft_vocab:
        raise ValueError(f"profile {profile.name}: drafter.draft_vocab_size is set; the drafter needs the "
                         f"draft vocabulary chosen from the dataset (choose_draft_vocab)")
    mask_id = resolve_mask_token_id(profile, embedding_rows(target))
    config = drafter_config(target.config, num_layers=profile.drafter.num_layers, block_size=profile.drafter.block_size,
                            target_layer_ids=layer_ids, mask_token_id=mask_id, draft_vocab_size=len(draft_vocab or []),
                            shape=profile_shape(profile.drafter), **profile_layer_options(profile.drafter))
    config.num_target_layers = num_target_layers
    return with_dflash2(config, profile_dflash2_options(profile.drafter))      # drafter.kind = "dflash2"


def initial_values(profile: Profile, drafter: DFlashDrafter, target: PreTrainedModel,
                   draft_vocab: list[int] | None) -> dict[str, InitValue]:
    """What drafter.init sets over the seeded random start, by tensor name: the draft vocabulary, then
    the target's weights ("target"), a drafter directory's ("drafter", its draft vocabulary included),
    or the final norm filled with drafter.norm_init (the default)."""
    from dflash.drafter.checkpoint_files import drafter_init_values
    from dflash.drafter.network import target_init_values

    values: dict[str, InitValue] = {}
    if draft_vocab:
        if not drafter.has_draft_vocab or drafter.draft_vocab.numel() != len(draft_vocab):
            raise ValueError(f"the drafter was built for a draft vocabulary of "
                             f"{drafter.draft_vocab.numel() if drafter.has_draft_vocab else 0} tokens, got {len(draft_vocab)}")
        values["draft_vocab"] = torch.tensor(draft_vocab, dtype=torch.long)
    if profile.drafter.init == "target":
        values.update(target_init_values(drafter, target, norm_scale=profile.drafter.norm_init)[1])
    elif profile.drafter.init == "drafter":
        values.update(drafter_init_values(drafter, profile.drafter.init_from)[1])
    else:
        values["norm.weight"] = torch.full(tuple(drafter.norm.weight.shape), float(profile.drafter.norm_init))
    return values


def embedding_rows(target: PreTrainedModel) -> int:
    """Rows of the target's input embedding (transformers types it as any module)."""
    return cast("nn.Embedding", target.get_input_embeddings()).num_embeddings


def load_rank_target(profile: Profile, device: torch.device, keep_layers: int | None = None) -> PreTrainedModel:
    """The profile's frozen target, straight onto this rank's device (dflash.target_model.load_target): its
    first `keep_layers` decoder layers only (None: all), with its embedding, final norm and lm_head."""
    from dflash.target_model import load_target, resolve_model_path

    return cast("PreTrainedModel", load_target(resolve_model_path(profile.model.target), device, profile.model.dtype,
                                               keep_layers=keep_layers))


def target_layers_to_load(profile: Profile, layer_ids: list[int], num_target_layers: int) -> int:
    """The profile's decoder layers a rank loads (dflash.drafter.taps.target_layers_needed; the source layers of
    drafter.init = "target" are dropped after the init; train.loss = "distill" runs every layer)."""
    from dflash.drafter.taps import target_layers_needed

    return target_layers_needed(layer_ids, profile.drafter.num_layers, num_target_layers, profile.drafter.init == "target",
                                to_last=loss_objective(profile).needs_teacher)


def loss_objective(profile: Profile) -> LossObjective:
    return LossObjective(profile.train.loss, profile.train.dpace_alpha)


def build_state(profile: Profile, run_dir: Path, env: WorkerEnv, *, resume: bool,
                planned_micro_batch: int | None = None) -> TrainState:
    """The rank's whole training state. The micro-batch starts from `planned_micro_batch` (the
    memory plan's), else train.max_micro_batch; the ranks then agree on the smallest. The target
    loads only the layers the rank runs (and those drafter.init = "target" copies)."""
    from dflash.target_model import resolve_model_path, target_layer_count

    device = torch.device("cuda", env.local_rank) if profile.machine.device == "cuda" else torch.device("cpu")
    data = TrainData(dataset_path(profile), profile, env)
    num_target_layers = target_layer_count(resolve_model_path(profile.model.target))
    keep = target_layers_to_load(profile, resolve_layer_ids(profile, num_target_layers), num_target_layers)
    state = state_from_target(profile, env, device, load_rank_target(profile, device, keep), data,
                              num_target_layers=num_target_layers)
    if profile.train.feature_cache:
        state.feature_cache = start_feature_cache(profile, run_dir, data, state.layer_ids)
    if resume:
        from dflash.train.rank.sharded_checkpoints import restore_checkpoint

        restore_checkpoint(state, run_dir)
    state.micro_batch = min(state.micro_batch, planned_micro_batch or profile.train.max_micro_batch)
    state.autobatch = start_autobatch(state, run_dir)
    state.micro_batch = state.autobatch.micro_batch
    return state


def state_from_target(profile: Profile, env: WorkerEnv, device: torch.device, target: PreTrainedModel,
                      data: StepData, mesh: DeviceMesh | None = None, num_target_layers: int | None = None) -> TrainState:
    """The state around a loaded target: tap layers, draft vocabulary, the drafter built sharded over
    `mesh` (default: every rank of the process group; `build_sharded_drafter`), the target truncated
    after its deepest tap, loss decay, optimizer and schedule. `num_target_layers`: the target's depth
    when it was loaded with fewer layers (default: its config's). `build_state` calls it with the real
    target and dataset; the memory trace (dflash.measure.trace) with fake ones and the fake process
    group's mesh."""
    from dflash.drafter.decay import default_gamma
    from dflash.drafter.loss import decay_weights
    from dflash.train.rank.parallel import drafter_mesh

    num_target_layers = num_target_layers or target.config.num_hidden_layers
    layer_ids = resolve_layer_ids(profile, num_target_layers)
    vocab = choose_draft_vocab(profile, data, env) if profile.drafter.draft_vocab_size else None
    mesh = mesh if mesh is not None else drafter_mesh(device, profile.machine.backend)
    drafter = build_sharded_drafter(profile, target, layer_ids, num_target_layers, vocab, device, mesh)
    drafter.checkpoint_layers = profile.train.activation_checkpointing == "layers"
    if not loss_objective(profile).needs_teacher:
        target.model.layers = target.model.layers[: max(layer_ids) + 1]     # layers past the deepest tap never run
    gamma = default_gamma(profile.drafter.block_size, profile.train.decay_gamma)
    return assemble_state(profile, env, device, target, drafter, data, layer_ids, decay_weights(drafter.block_size, gamma))


def choose_draft_vocab(profile: Profile, data: StepData, env: WorkerEnv) -> list[int]:
    """drafter.draft_vocab_size most frequent loss tokens of the dataset (the same on every rank)."""
    from dflash.drafter.draft_vocab import count_loss_tokens, coverage, draft_vocabulary

    counts = count_loss_tokens(data.dataset, data.max_length)
    vocab = draft_vocabulary(counts, profile.drafter.draft_vocab_size)
    if env.is_main:
        print(f"draft vocabulary: {len(vocab)} tokens (drafter.draft_vocab_size {profile.drafter.draft_vocab_size}; "
              f"{len(counts)} distinct in the data) cover {100 * coverage(counts, vocab):.1f}% of the loss tokens",
              flush=True)
    return vocab


def start_autobatch(state: TrainState, run_dir: Path) -> AutoBatch:
    """Agree on one micro-batch (all_reduce MIN, never above the persisted one on a restart)."""
    from dflash.train.rank.autobatch import AutoBatch

    log = (lambda line: print(line, flush=True)) if state.env.is_main else (lambda line: None)
    return AutoBatch.start(state.micro_batch, run_dir, state.env.rank, log=log)


def dataset_path(profile: Profile) -> Path:
    from launcher_core.profile import expand_path

    return expand_path(profile, profile.paths.dataset)


def assemble_state(profile: Profile, env: WorkerEnv, device: torch.device, target: PreTrainedModel,
                   drafter: DFlashDrafter, data: StepData, layer_ids: list[int], decay: torch.Tensor) -> TrainState:
    from dflash.drafter.attention import resolve_backend

    optimizer = build_optimizer(profile, [p for p in drafter.parameters() if p.requires_grad])
    steps = total_steps(profile, data.steps_per_epoch)
    return TrainState(env=env, device=device, target=target, drafter=drafter, optimizer=optimizer,
                      scheduler=cosine_schedule(optimizer, steps, profile.train.warmup_ratio), data=data,
                      layer_ids=layer_ids, decay=decay.to(device),
                      backend=resolve_backend(profile.train.attention, device.type), grad_clip=profile.train.grad_clip,
                      chunk_rows=profile.train.loss_chunk_rows, total_steps=steps,
                      micro_batch=profile.train.max_micro_batch, autocast=profile.train.autocast,
                      compute_dtype=profile.train.compute_dtype, gradient_sync=profile.train.gradient_sync,
                      selector=SelectorObjective(profile.train.selector_loss_alpha, profile.train.selector_stop_gradient),
                      loss=loss_objective(profile))


def start_feature_cache(profile: Profile, run_dir: Path, data: TrainData, layer_ids: list[int]) -> FeatureCache:
    """train.feature_cache: the run's shared per-row feature files (dflash.train.rank.feature_cache)."""
    from dflash.train.rank.feature_cache import FeatureCache, cache_directory

    key = {"dataset": str(dataset_path(profile)), "fingerprint": getattr(data.dataset, "_fingerprint", ""),
           "rows": len(data.dataset), "target": profile.model.target, "dtype": profile.model.dtype,
           "layers": list(layer_ids), "max_length": data.max_length}
    return FeatureCache(cache_directory(run_dir, key))


# --- the optimizer and schedule: AdamW over the drafter's parameter shards, warmup then cosine ---

def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float) -> LRScheduler:
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


def build_optimizer(profile: Profile, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over the drafter's trainable parameters: under FSDP2 (dflash.train.rank.parallel) these are
    this rank's float32 shards, so its states are sharded too (about 8 bytes per parameter / N)."""
    # foreach on every device: torch picks it by default on CUDA only, and the memory model and the
    # CPU tests count its one temporary over the parameters (the update's peak) as on the GPU
    return torch.optim.AdamW(params, lr=profile.train.lr, weight_decay=profile.train.weight_decay, foreach=True)
