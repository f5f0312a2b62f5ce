"""Memory model of online DFlash training on one rank, and its calibration.

Every rank holds a full frozen target and a replica of the drafter (data parallel). What one rank
allocates through torch is modelled as

    peak(m) = intercept + slope * m            (m = micro-batch, sequences per forward)

* intercept = static memory + one logits chunk. Static: the target's weights in model.dtype
  (embedding, lm_head and the layers up to the deepest tap: the trainer drops the rest), and
  the drafter's trainable parameters in float32 (its layers take the target's hidden and MLP
  widths and their own attention shape, `dflash.drafter.shape`; mixed precision: master weights and gradients,
  8 bytes per parameter, plus autocast's bf16 weight copies) and the two float32 AdamW states
  (8 bytes per parameter) -- all of them on every rank with `train.optimizer_sharding = "none"`,
  only this rank's shard with "zero1" (ZeroRedundancyOptimizer: parameters are assigned whole,
  largest first, to the least-loaded rank; the largest shard is what counts). Logits are
  computed `train.loss_chunk_rows` block tokens at a time under checkpointing: bf16 logits,
  their fp32 upcast and fp32 gradient;
* slope = memory per sequence of the WORST micro-batch the data allows: every sequence at
  `data.max_length` with the full anchor count (`train.num_anchors` x `drafter.block_size` block
  tokens). Per sequence: the tap features kept from the target, plus the larger of the target's
  transient no-grad activations (one layer's working set; the forward stops after the deepest
  tap) and the drafter's saved activations (the concatenated taps kept for the fc backward, the
  context keys/values of every draft layer, and each draft layer's saved activations over
  anchors x block tokens).

Between steps two more moments can be the peak of a rank (`MemoryEstimate.between_steps`): the
optimizer update (static + one float32 temporary over this rank's parameters: foreach AdamW's
sqrt(exp_avg_sq)), and a checkpoint save (gradients already dropped; under zero1 every rank's
shard is gathered to rank 0 by broadcasts: the serialized shard and its deserialized copy are on
the device of every rank at once before rank 0 moves them to host memory); and on several ranks the
gradient sum (all gradients plus its one staging buffer of at most `train.grad_bucket_mib`: float32
gradients below the bucket, packed; larger ones are summed in place). `PeakModel.peak_mib(m)`
is the larger of the step's line and that figure.

The analytic figures are an estimate; a short measured probe on a real GPU (peak allocated at two
micro-batch sizes, `dflash.memory.measure`) replaces intercept and slope with measured ones
(`dflash.memory.calibration`, stored with the baseline). Non-torch memory (CUDA context, NCCL,
cuBLAS workspace) is not part of this model: `dflash.memory.plan` subtracts it from the free memory.

The target's shape comes from `dflash.memory.target`, the per-sequence activations byte by byte
from `dflash.memory.activations`. No torch import here: `plan` runs in the launcher process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence, TypeVar

from dflash.drafter.shape import DrafterShape, derive_shape, profile_shape
from dflash.drafter.taps import default_target_layer_ids
from dflash.memory.activations import drafter_activations_mib, tap_features_mib, target_activations_mib
from dflash.memory.attention_masks import MIB
from dflash.memory.target import DTYPE_BYTES, TargetShape, target_shape
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.memory.calibration import Calibration

LOGITS_CHUNK_TOKENS = 2048          # block tokens whose logits exist at once (train.loss_chunk_rows)
DRAFTER_MASTER_BYTES = 4            # trainable drafter parameters are float32 (autocast to bf16)
LOGITS_BYTES_PER_ELEMENT = 2 + 2 + 4 + 4  # bf16 logits and their gradient, fp32 upcast and its gradient
ADAMW_STATES = 2                    # exp_avg and exp_avg_sq, in the parameter dtype
ADAMW_UPDATE_TEMPORARIES = 1        # foreach AdamW: one float32 tensor per parameter during step()
GATHER_COPIES = 2                   # zero1 checkpoint: a shard's serialized bytes + its loaded copy
GRAD_BUCKET_MIB = 64.0              # train.grad_bucket_mib default: the gradient sum's staging buffer cap


class Sized(Protocol):
    """A tensor (or parameter) as the ZeRO-1 partition sees it."""

    def numel(self) -> int: ...


SizedT = TypeVar("SizedT", bound=Sized)


@dataclass(frozen=True)
class Workload:
    """What one training step processes, in its worst case."""

    target: TargetShape
    dtype: str
    drafter_layers: int
    drafter_shape: DrafterShape         # the drafter's own attention (derived: no zero field)
    block_size: int
    num_anchors: int
    max_length: int
    tap_layers: tuple[int, ...]
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS
    optimizer_shards: int = 1           # ranks the AdamW states are sharded over (1: replicated)
    world_size: int = 1                 # ranks summing gradients (1: no gradient sum)
    grad_bucket_mib: float = GRAD_BUCKET_MIB   # train.grad_bucket_mib
    sliding_layers: int = 0             # drafter layers with a sliding window (memory.attention_masks)
    sliding_window: int = 0
    rank_share: int = 1                 # sequences per rank per optimizer step (train.global_batch / world)
    compute_dtype: str = "float32"      # train.compute_dtype: the drafter's residual stream and norms

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def autocast(self) -> bool:
        """Mixed precision: fp32 drafter weights, activations in model.dtype."""
        return self.dtype != "float32"

    @property
    def loaded_target_layers(self) -> int:
        return max(self.tap_layers) + 1

    @property
    def anchors(self) -> int:
        return max(1, min(self.num_anchors, self.max_length - 1))

    @property
    def block_tokens(self) -> int:
        return self.anchors * self.block_size

    def key(self) -> str:
        """Identifies the workload a calibration was measured on."""
        facts = dataclasses.asdict(self)
        facts["target"].pop("source")               # the same shape read from another path is the same workload
        for between_steps_only in ("world_size", "grad_bucket_mib", "rank_share"):   # the sum's buffer and the
            facts.pop(between_steps_only)               # accumulated gradients: a calibrated model takes them from the estimate
        if facts["compute_dtype"] == "float32":     # the key of every workload before the setting existed
            facts.pop("compute_dtype")
        for key in ("sliding_layers", "sliding_window"):   # all-full drafters keep the keys they had
            if not facts[key]:
                facts.pop(key)
        text = json.dumps(facts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MemoryEstimate:
    """The analytic model's figures, in MiB (per rank)."""

    target_weights: float
    drafter_weights: float
    drafter_grads: float
    optimizer_states: float
    autocast_weights: float
    logits_chunk: float
    tap_features: float
    target_activations: float
    drafter_activations: float
    optimizer_shards: int = 1
    update_temporaries: float = 0.0     # during optimizer.step, on top of static
    checkpoint_gather: float = 0.0      # during a zero1 checkpoint save, on top of static - grads
    logits_per_sequence: float = 0.0    # a loss chunk holds rows of several sequences when one has fewer
    grad_sum_staging: float = 0.0       # the gradient sum's staging buffer, on top of static (dflash.train.dist)
    rank_share: int = 1                 # sequences per rank per step: below it, micro-batches accumulate

    @property
    def static(self) -> float:
        return (self.target_weights + self.drafter_weights + self.drafter_grads + self.optimizer_states
                + self.autocast_weights)

    @property
    def step_static(self) -> float:
        """What a forward/backward's peak stands on: the loss's backward, the step's peak, comes
        before any drafter gradient exists (they were dropped by zero_grad(set_to_none=True))."""
        return self.static - self.drafter_grads

    @property
    def per_sequence(self) -> float:
        return self.tap_features + max(self.target_activations, self.drafter_activations) + self.logits_per_sequence

    @property
    def update_peak(self) -> float:
        """Autocast's bf16 weight copies live only inside the forward/backward: not here."""
        return self.static - self.autocast_weights + self.update_temporaries

    @property
    def checkpoint_peak(self) -> float:
        return self.static - self.autocast_weights - self.drafter_grads + self.checkpoint_gather

    @property
    def grad_sum_peak(self) -> float:
        """The gradient sum, after backward: all gradients and the sum's one staging buffer."""
        return self.static - self.autocast_weights + self.grad_sum_staging

    @property
    def between_steps(self) -> float:
        """The peak outside forward/backward: the gradient sum, the optimizer update or a checkpoint save."""
        return max(self.update_peak, self.checkpoint_peak, self.grad_sum_peak)

    def accumulated_gradients(self, micro_batch: int) -> float:
        """Gradients alive in a forward/backward: those of the step's earlier micro-batches (none
        when one micro-batch is the whole step: zero_grad(set_to_none=True) dropped them)."""
        return self.drafter_grads if micro_batch < self.rank_share else 0.0


@dataclass(frozen=True)
class PeakModel:
    """peak(m) = intercept + slope * m, in MiB of torch-allocated memory."""

    intercept_mib: float
    slope_mib: float
    static_mib: float
    source: str                     # "estimate" or "calibration"
    between_steps_mib: float = 0.0  # gradient sum / optimizer update / checkpoint save (independent of m)
    accumulation_mib: float = 0.0   # gradients alive from earlier micro-batches when m < rank_share
    rank_share: int = 1

    def step_mib(self, micro_batch: int) -> float:
        """The forward/backward's peak at `micro_batch` (from the second micro-batch of a step on, the
        gradients of the earlier ones are alive)."""
        accumulated = self.accumulation_mib if micro_batch < self.rank_share else 0.0
        return self.intercept_mib + self.slope_mib * micro_batch + accumulated

    def peak_mib(self, micro_batch: int) -> float:
        return max(self.step_mib(micro_batch), self.between_steps_mib)

    def largest_fitting(self, budget_mib: float, ceiling: int) -> int:
        """The largest micro-batch in 0..ceiling whose peak fits the budget (0: not even one)."""
        if self.between_steps_mib > budget_mib:
            return 0
        if budget_mib == float("inf"):
            return ceiling
        return max([0] + [m for m in range(1, ceiling + 1) if self.peak_mib(m) <= budget_mib])



def optimizer_shards(profile: Profile, world_size: int | None = None) -> int:
    """Ranks the AdamW states are spread over: the world size under zero1, else 1."""
    world = world_size or profile.machine.nproc_per_node * profile.machine.nnodes
    return world if profile.train.optimizer_sharding == "zero1" and world > 1 else 1


def workload_from_profile(profile: Profile, shape: TargetShape | None = None,
                          world_size: int | None = None) -> Workload:
    shape = shape or target_shape(profile)
    world = world_size or profile.machine.nproc_per_node * profile.machine.nnodes
    taps = profile.drafter.target_layer_ids or tuple(default_target_layer_ids(shape.num_layers, profile.drafter.num_layers))
    return Workload(target=shape, dtype=profile.model.dtype, drafter_layers=profile.drafter.num_layers,
                    drafter_shape=derive_shape(shape.attention_config(), profile_shape(profile.drafter)),
                    block_size=profile.drafter.block_size, num_anchors=profile.train.num_anchors,
                    max_length=profile.data.max_length, tap_layers=tuple(taps),
                    logits_chunk_tokens=profile.train.loss_chunk_rows,
                    optimizer_shards=optimizer_shards(profile, world_size), world_size=world,
                    grad_bucket_mib=profile.train.grad_bucket_mib,
                    rank_share=max(1, profile.train.global_batch // world), compute_dtype=profile.train.compute_dtype,
                    sliding_layers=list(profile.drafter.layer_types).count("sliding_attention"),
                    sliding_window=profile.drafter.sliding_window)


# --- the analytic estimate ----------------------------------------------------------------

def drafter_params(workload: Workload) -> int:
    """Draft layers (the target's hidden and MLP widths, the drafter's own attention), the fc over
    the concatenated taps, two norms."""
    return sum(drafter_param_sizes(workload))


def drafter_layer_sizes(workload: Workload) -> list[int]:
    """Element counts of one draft layer's tensors: q/k/v/o, the MLP, q/k norms, two RMSNorms."""
    s, own = workload.target, workload.drafter_shape
    return [s.hidden * own.q_dim, s.hidden * own.kv_dim, s.hidden * own.kv_dim, own.q_dim * s.hidden,
            *([s.hidden * s.intermediate] * 3), own.head_dim, own.head_dim, s.hidden, s.hidden]


def drafter_param_sizes(workload: Workload) -> list[int]:
    """Element counts of the drafter's trainable tensors (as `drafter_params` sums them)."""
    s = workload.target
    fc = len(workload.tap_layers) * s.hidden * s.hidden
    return drafter_layer_sizes(workload) * workload.drafter_layers + [fc, s.hidden, s.hidden]


def zero1_partition(sizes: Sequence[int], shards: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition: largest tensor first, each to the least-loaded rank
    (the first such rank on a tie). Returns the indices of `sizes` each rank holds."""
    loads = [0] * shards
    owned: list[list[int]] = [[] for _ in range(shards)]
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = loads.index(min(loads))
        loads[rank] += sizes[index]
        owned[rank].append(index)
    return owned


def zero_shard_sizes(sizes: Sequence[int], shards: int) -> list[int]:
    """The parameters per rank of the ZeRO-1 partition."""
    return [sum(sizes[i] for i in indices) for indices in zero1_partition(sizes, shards)]


def fullest_zero1_shard(params: Sequence[SizedT], shards: int) -> list[SizedT]:
    """The parameters (anything with `numel()`) that the ZeRO-1 partition gives its fullest rank."""
    sizes = [p.numel() for p in params]
    owned = zero1_partition(sizes, shards)
    fullest = max(owned, key=lambda indices: sum(sizes[i] for i in indices))
    return [params[i] for i in fullest]


def largest_shard_params(workload: Workload) -> int:
    return max(zero_shard_sizes(drafter_param_sizes(workload), workload.optimizer_shards))


def target_params_loaded(workload: Workload) -> int:
    """The target's parameters kept on the GPU: all but the layers after the deepest tap."""
    shape = workload.target
    dropped = max(0, shape.num_layers - workload.loaded_target_layers)
    return shape.total_params() - dropped * shape.layer_params()


def estimate(workload: Workload) -> MemoryEstimate:
    params = drafter_params(workload)
    drafter = params * DRAFTER_MASTER_BYTES / MIB
    shard = largest_shard_params(workload) * DRAFTER_MASTER_BYTES / MIB
    sharded = workload.optimizer_shards > 1
    return MemoryEstimate(
        target_weights=target_params_loaded(workload) * workload.dtype_bytes / MIB,
        drafter_weights=drafter, drafter_grads=drafter, optimizer_states=ADAMW_STATES * shard,
        autocast_weights=params * workload.dtype_bytes / MIB if workload.autocast else 0.0,
        logits_chunk=_logits_chunk_mib(workload), logits_per_sequence=_logits_per_sequence_mib(workload),
        tap_features=tap_features_mib(workload),
        target_activations=target_activations_mib(workload),
        drafter_activations=drafter_activations_mib(workload), optimizer_shards=workload.optimizer_shards,
        update_temporaries=ADAMW_UPDATE_TEMPORARIES * shard, grad_sum_staging=_grad_sum_staging_mib(workload),
        checkpoint_gather=GATHER_COPIES * ADAMW_STATES * shard if sharded else 0.0, rank_share=workload.rank_share)


def _grad_sum_staging_mib(workload: Workload) -> float:
    """The sum's staging buffer (dflash.train.dist.staging_bytes): float32 gradients below the
    bucket are packed through one buffer of min(bucket, their bytes); larger ones are summed in
    place. None on one rank (nothing to sum)."""
    if workload.world_size <= 1:
        return 0.0
    bucket = int(workload.grad_bucket_mib * MIB)
    packed = sum(size * DRAFTER_MASTER_BYTES for size in drafter_param_sizes(workload)
                 if size * DRAFTER_MASTER_BYTES < bucket)
    return min(bucket, packed) / MIB


def _label_rows(workload: Workload) -> int:
    """Rows of one sequence whose logits the loss computes: slots 1..B-1 of every anchor."""
    return workload.anchors * (workload.block_size - 1)


def _logits_chunk_mib(workload: Workload) -> float:
    """One full chunk, when one sequence fills it (else the chunk grows with the micro-batch)."""
    if _label_rows(workload) < workload.logits_chunk_tokens:
        return 0.0
    return workload.logits_chunk_tokens * workload.target.vocab * LOGITS_BYTES_PER_ELEMENT / MIB


def _logits_per_sequence_mib(workload: Workload) -> float:
    """A sequence with fewer label rows than a chunk: the chunk holds that many rows per sequence
    (exact while the micro-batch's rows fit one chunk, above the truth beyond)."""
    if _label_rows(workload) >= workload.logits_chunk_tokens:
        return 0.0
    return _label_rows(workload) * workload.target.vocab * LOGITS_BYTES_PER_ELEMENT / MIB


# --- the peak model --------------------------------------------------------------------

def estimated_peak_model(workload: Workload) -> PeakModel:
    figures = estimate(workload)
    return PeakModel(intercept_mib=figures.step_static + figures.logits_chunk, slope_mib=figures.per_sequence,
                     static_mib=figures.static, source="estimate", between_steps_mib=figures.between_steps,
                     accumulation_mib=figures.drafter_grads, rank_share=figures.rank_share)


def peak_model(workload: Workload, calibration: Calibration | None = None) -> PeakModel:
    """The calibrated model when a calibration of this very workload exists, else the estimate."""
    estimated = estimated_peak_model(workload)
    if calibration is None or calibration.workload_key != workload.key():
        return estimated
    logits_chunk = estimated.intercept_mib - estimated.static_mib    # the measured intercept includes it
    # between steps: as far above/below the one-sequence step as the estimate says, from the measured one
    step_of_one = calibration.intercept_mib + calibration.slope_mib
    between = step_of_one + estimated.between_steps_mib - (estimated.intercept_mib + estimated.slope_mib)
    return PeakModel(intercept_mib=calibration.intercept_mib, slope_mib=calibration.slope_mib,
                     static_mib=max(0.0, calibration.intercept_mib - logits_chunk), source="calibration",
                     between_steps_mib=max(0.0, between))

