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
micro-batch sizes) replaces intercept and slope with measured ones (`Calibration`), which are
stored with the baseline under the key `memory_calibration`. Non-torch memory (CUDA context, NCCL,
cuBLAS workspace) is not part of this model: `dflash.memory.plan` subtracts it from the free memory.

Target shapes come from the target's `config.json` when the directory exists (a nested
`text_config` is used for multimodal configs; the parameter count from the safetensors index when
there is one), else from built-in shapes: SmolLM2-135M for the builtin target, and a
Qwen3.6-27B-like shape (hidden 5120, 64 layers, 27B parameters) for anything else.
No torch import here: `plan` runs in the launcher process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from dflash.drafter.shape import DrafterShape, derive_shape, profile_shape, target_rope_theta
from dflash.drafter.taps import default_target_layer_ids
from launcher_core.errors import InputError
from launcher_core.schema import Profile

MIB = 1024 * 1024
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
LOGITS_CHUNK_TOKENS = 2048          # block tokens whose logits exist at once (train.loss_chunk_rows)
DRAFTER_MASTER_BYTES = 4            # trainable drafter parameters are float32 (autocast to bf16)
LOGITS_BYTES_PER_ELEMENT = 2 + 2 + 4 + 4  # bf16 logits and their gradient, fp32 upcast and its gradient
FP32_BYTES = 4                      # the drafter's residual stream, RMSNorm inputs/outputs, q/k norms
LINEAR_ATTENTION_FP32_COPIES = 14   # transformers' PyTorch Gated DeltaNet: fp32 [tokens, value dim] copies (traced)
ADAMW_STATES = 2                    # exp_avg and exp_avg_sq, in the parameter dtype
ADAMW_UPDATE_TEMPORARIES = 1        # foreach AdamW: one float32 tensor per parameter during step()
GATHER_COPIES = 2                   # zero1 checkpoint: a shard's serialized bytes + its loaded copy
GRAD_BUCKET_MIB = 64.0              # train.grad_bucket_mib default: the gradient sum's staging buffer cap
CALIBRATION_KEY = "memory_calibration"


@dataclass(frozen=True)
class TargetShape:
    """The target's dimensions (those that decide memory)."""

    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    param_count: int = 0            # 0: computed from the dimensions
    source: str = "defaults"
    linear_value_dim: int = 0       # Gated DeltaNet value heads x head dim (hybrid targets; 0: none)
    rope_theta: float = 0.0         # RoPE base (a derived drafter shape takes it; 0: the default)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim) + 2 * self.head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def attention_config(self) -> dict[str, Any]:
        """The attention keys of the target's config.json: what `derive_shape` reads."""
        return {"hidden_size": self.hidden, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                **({"rope_theta": self.rope_theta} if self.rope_theta else {})}

    def total_params(self) -> int:
        if self.param_count:
            return self.param_count
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return embeddings + self.num_layers * self.layer_params() + self.hidden


# Qwen3.6-27B-like: hidden 5120, 64 layers, GQA 24/4 heads of 256, 248K vocabulary, 27B parameters.
QWEN36_27B_LIKE = TargetShape(hidden=5120, num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256,
                              intermediate=17408, vocab=248320, param_count=27_000_000_000,
                              source="Qwen3.6-27B-like defaults", linear_value_dim=48 * 128,
                              rope_theta=10_000_000.0)
# SmolLM2-135M-Instruct (the builtin target) before its first conversion exists on disk.
SMOLLM2_135M = TargetShape(hidden=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           intermediate=1536, vocab=49152, tie_embeddings=True,
                           source="SmolLM2-135M defaults", rope_theta=100_000.0)


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


@dataclass(frozen=True)
class Calibration:
    """Peak allocated memory measured at two micro-batch sizes on one workload."""

    micro_batches: tuple[int, int]
    peaks_mib: tuple[float, float]
    workload_key: str
    device_name: str = ""
    torch_version: str = ""
    measured_at: str = ""
    gradient_sum: str = ""          # "measured": 2+ ranks summed for real; "model": one process ("" before it was recorded)

    @property
    def slope_mib(self) -> float:
        (m1, m2), (p1, p2) = self.micro_batches, self.peaks_mib
        return (p2 - p1) / (m2 - m1)

    @property
    def intercept_mib(self) -> float:
        return self.peaks_mib[0] - self.slope_mib * self.micro_batches[0]


# --- target shape -------------------------------------------------------------------------

def shape_from_config(config: Mapping[str, Any], source: str, param_count: int = 0) -> TargetShape:
    """A HF config.json (dict) -> TargetShape; multimodal configs use their `text_config`."""
    text = config.get("text_config") or config
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return TargetShape(
            hidden=hidden, num_layers=int(text["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate=int(text["intermediate_size"]), vocab=int(text["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            param_count=param_count, source=source, linear_value_dim=_linear_value_dim(text),
            rope_theta=target_rope_theta(text))
    except KeyError as error:
        raise InputError(f"{source}: config has no {error.args[0]!r}; is this a causal LM config?") from None


def _linear_value_dim(text: Mapping[str, Any]) -> int:
    """Gated DeltaNet's value width when the config has linear-attention layers (Qwen3.5), else 0."""
    if "linear_attention" not in (text.get("layer_types") or []):
        return 0
    return int(text.get("linear_num_value_heads", 0)) * int(text.get("linear_value_head_dim", 0))


def shape_from_directory(directory: Path, dtype_bytes: int) -> TargetShape:
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return shape_from_config(config, str(config_path), _param_count_on_disk(directory, dtype_bytes))


def _param_count_on_disk(directory: Path, dtype_bytes: int) -> int:
    """Parameters from the safetensors index's total_size (0 when unknown)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size", 0)
        return int(total) // dtype_bytes
    return 0


def target_shape(profile: Profile) -> TargetShape:
    """The profile's target shape, read from disk when possible (never converts or downloads)."""
    from dflash.models import SMOLLM2
    from launcher_core.paths import cache_dir

    spec = profile.model.target
    dtype_bytes = DTYPE_BYTES[profile.model.dtype]
    if spec == SMOLLM2:
        cached = cache_dir() / "smollm2-135m-instruct"
        return shape_from_directory(cached, dtype_bytes) if (cached / "config.json").exists() else SMOLLM2_135M
    directory = Path(spec).expanduser()
    if (directory / "config.json").exists():
        return shape_from_directory(directory, dtype_bytes)
    return QWEN36_27B_LIKE


def optimizer_shards(profile: Profile, world_size: int | None = None) -> int:
    """Ranks the AdamW states are spread over: the world size under zero1, else 1."""
    world = world_size or profile.machine.nproc_per_node * profile.machine.nnodes
    return world if profile.train.optimizer_sharding == "zero1" and world > 1 else 1


def workload_from_profile(profile: Profile, shape: TargetShape | None = None,
                          world_size: int | None = None) -> Workload:
    shape = shape or target_shape(profile)
    world = world_size or profile.machine.nproc_per_node * profile.machine.nnodes
    taps = profile.drafter.target_layer_ids or tuple(default_target_layer_ids(shape.num_layers, profile.drafter.num_layers))
    chunk = getattr(profile.train, "loss_chunk_rows", LOGITS_CHUNK_TOKENS) or LOGITS_CHUNK_TOKENS
    return Workload(target=shape, dtype=profile.model.dtype, drafter_layers=profile.drafter.num_layers,
                    drafter_shape=derive_shape(shape.attention_config(), profile_shape(profile.drafter)),
                    block_size=profile.drafter.block_size, num_anchors=profile.train.num_anchors,
                    max_length=profile.data.max_length, tap_layers=tuple(taps), logits_chunk_tokens=chunk,
                    optimizer_shards=optimizer_shards(profile, world_size), world_size=world,
                    grad_bucket_mib=getattr(profile.train, "grad_bucket_mib", GRAD_BUCKET_MIB),
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
    loads, owned = [0] * shards, [[] for _ in range(shards)]
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = loads.index(min(loads))
        loads[rank] += sizes[index]
        owned[rank].append(index)
    return owned


def zero_shard_sizes(sizes: Sequence[int], shards: int) -> list[int]:
    """The parameters per rank of the ZeRO-1 partition."""
    return [sum(sizes[i] for i in indices) for indices in zero1_partition(sizes, shards)]


def fullest_zero1_shard(params: Sequence[Any], shards: int) -> list[Any]:
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
        tap_features=_tap_features_mib(workload),
        target_activations=_target_activations_mib(workload),
        drafter_activations=_drafter_activations_mib(workload), optimizer_shards=workload.optimizer_shards,
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


def _tap_features_mib(workload: Workload) -> float:
    """Hidden states of the tap layers kept from the target forward, one sequence."""
    return len(workload.tap_layers) * workload.max_length * workload.target.hidden * workload.dtype_bytes / MIB


def _target_activations_mib(workload: Workload) -> float:
    """One target layer's no-grad working set (residual, qkv, attention out, MLP), one sequence; on a
    hybrid target the larger of that and a Gated DeltaNet layer's (PyTorch fallback, float32)."""
    s = workload.target
    elements = 2 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 3 * s.intermediate
    attention = workload.max_length * elements * workload.dtype_bytes
    linear = workload.max_length * LINEAR_ATTENTION_FP32_COPIES * s.linear_value_dim * FP32_BYTES
    return max(attention, linear) / MIB


def _drafter_activations_mib(workload: Workload) -> float:
    """Saved for backward over one sequence, as the drafter's code computes under bf16 autocast:
    bf16 (`lo`) where a projection or the attention ran, float32 where the code keeps float32 (the
    residual stream, RMSNorm inputs and outputs, q/k norms), and one input copy per projection
    (autocast casts the float32 input again for every Linear). With train.compute_dtype = "bfloat16"
    the residual stream is bf16 and every projection reads one shared bf16 input, but each RMSNorm
    (transformers' Qwen3RMSNorm) still keeps its float32 upcast of the input, then a bf16 normalised
    copy and a bf16 output."""
    from dflash.memory.attention_masks import extra_block_mask_mib

    return (_context_bytes(workload) + workload.drafter_layers * (_layer_key_bytes(workload) + _layer_block_bytes(workload))
            + _final_bytes(workload)) / MIB + extra_block_mask_mib(workload)


def _low_bytes(workload: Workload) -> int:
    return workload.dtype_bytes if workload.autocast or _bf16_compute(workload) else FP32_BYTES


def _bf16_compute(workload: Workload) -> bool:
    return workload.compute_dtype == "bfloat16"


def _norm_bytes(workload: Workload) -> int:
    """One RMSNorm per element: float32 normalised + the projection's bf16 copy (float32 compute), or
    float32 upcast + bf16 normalised + bf16 output (bf16 compute)."""
    lo, f = _low_bytes(workload), FP32_BYTES
    return f + lo + lo if _bf16_compute(workload) else f + lo


def _projection_input_copies(workload: Workload, projections: int) -> int:
    """Autocast's bf16 copies of a float32 input, one per projection reading it (none in bf16 compute)."""
    return 0 if _bf16_compute(workload) else projections


def _context_bytes(workload: Workload) -> int:
    """Once: the taps' bf16 copy for fc (bf16 compute: fc reads the taps themselves), hidden_norm."""
    s, lo, f = workload.target, _low_bytes(workload), FP32_BYTES
    taps = len(workload.tap_layers) * s.hidden * lo * _projection_input_copies(workload, 1)
    norm = s.hidden * (f + _norm_bytes(workload)) if not _bf16_compute(workload) else s.hidden * _norm_bytes(workload)
    return workload.max_length * (taps + norm)


def _layer_key_bytes(workload: Workload) -> int:
    """Per layer over context + block keys: k/v projections' input copies (bf16 compute: one shared input),
    k_norm, k and v for attention (the drafter's KV width)."""
    s, kv_dim, lo, f = workload.target, workload.drafter_shape.kv_dim, _low_bytes(workload), FP32_BYTES
    keys = workload.max_length + workload.block_tokens
    inputs = _projection_input_copies(workload, 2) or 1
    return keys * (inputs * s.hidden * lo + kv_dim * (f + lo) + 2 * kv_dim * lo)


def _layer_block_bytes(workload: Workload) -> int:
    """Per layer over the block tokens: input norm, q projection + q_norm, attention out, o_proj input,
    post-attention norm, the MLP's input copies and four intermediates (the drafter's query width)."""
    s, q_dim, lo, f = workload.target, workload.drafter_shape.q_dim, _low_bytes(workload), FP32_BYTES
    norms = 2 * s.hidden * _norm_bytes(workload)
    attention = _projection_input_copies(workload, 1) * s.hidden * lo + q_dim * (f + lo + lo) + 2 * q_dim * lo
    mlp = _projection_input_copies(workload, 2) * s.hidden * lo + 4 * s.intermediate * lo
    return workload.block_tokens * (norms + attention + mlp)


def _final_bytes(workload: Workload) -> int:
    """The final norm and the loss's copy of the labelled rows (float32; bf16 in bf16 compute)."""
    s, f = workload.target, FP32_BYTES
    rows = workload.anchors * (workload.block_size - 1)
    row_bytes = _low_bytes(workload) if _bf16_compute(workload) else f
    return workload.block_tokens * s.hidden * _norm_bytes(workload) + rows * s.hidden * row_bytes


# --- peak model and calibration -----------------------------------------------------------

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


def fit_calibration(peaks_by_micro_batch: Mapping[int, float], workload: Workload, **facts: str) -> Calibration:
    """Two measured (micro-batch, peak MiB) points -> Calibration (the line through them)."""
    if len(peaks_by_micro_batch) != 2:
        raise ValueError(f"calibration needs exactly two micro-batch sizes, got {sorted(peaks_by_micro_batch)}")
    (m1, p1), (m2, p2) = sorted(peaks_by_micro_batch.items())
    return Calibration(micro_batches=(m1, m2), peaks_mib=(float(p1), float(p2)),
                       workload_key=workload.key(), **facts)


def measure_peaks(run_step: Callable[[int], None], micro_batches: tuple[int, ...] = (1, 2)) -> dict[int, float]:
    """Run one worst-case training step per micro-batch size on the current CUDA device and
    return torch's peak allocated memory (MiB) for each. GPU only."""
    import torch

    peaks = {}
    for micro_batch in micro_batches:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run_step(micro_batch)
        torch.cuda.synchronize()
        peaks[micro_batch] = torch.cuda.max_memory_allocated() / MIB
    return peaks


def calibration_as_dict(calibration: Calibration) -> dict[str, Any]:
    return {**dataclasses.asdict(calibration), "slope_mib": calibration.slope_mib,
            "intercept_mib": calibration.intercept_mib}


def calibration_from_dict(document: Mapping[str, Any], where: str) -> Calibration:
    try:
        return Calibration(micro_batches=tuple(document["micro_batches"]), peaks_mib=tuple(document["peaks_mib"]),
                           workload_key=str(document["workload_key"]),
                           device_name=str(document.get("device_name", "")),
                           torch_version=str(document.get("torch_version", "")),
                           measured_at=str(document.get("measured_at", "")),
                           gradient_sum=str(document.get("gradient_sum", "")))
    except (KeyError, TypeError) as error:
        raise InputError(f"{where}: key {CALIBRATION_KEY!r} is malformed ({error}); re-run the calibration") from None


def save_calibration(baseline_path: str | Path, calibration: Calibration) -> Path:
    """Store the calibration inside the baseline JSON (atomically), next to the facts it was measured on."""
    from launcher_core.fileio import read_json, write_json_atomic

    path = Path(baseline_path)
    document = read_json(path) if path.exists() else {}
    document[CALIBRATION_KEY] = calibration_as_dict(calibration)
    return write_json_atomic(path, document)


def load_calibration(document: Mapping[str, Any] | None, where: str) -> Calibration | None:
    """The calibration stored in a baseline (or snapshot) document, if any."""
    if not document or CALIBRATION_KEY not in document:
        return None
    return calibration_from_dict(document[CALIBRATION_KEY], where)


# --- offline storage, for comparison ------------------------------------------------------

SEEDS_SAMPLES = 902_087             # the seeds' tokenized completions
SEEDS_AVG_TOKENS = 2000             # their average length


@dataclass(frozen=True)
class OfflineStorage:
    """What storing the tap hidden states on disk (the offline alternative) would take."""

    samples: int
    avg_tokens: int
    layers: int
    hidden: int
    dtype_bytes: int

    @property
    def bytes(self) -> int:
        return self.samples * self.avg_tokens * self.layers * self.hidden * self.dtype_bytes


def offline_storage(workload: Workload, samples: int = SEEDS_SAMPLES, avg_tokens: int = SEEDS_AVG_TOKENS) -> OfflineStorage:
    return OfflineStorage(samples=samples, avg_tokens=avg_tokens, layers=len(workload.tap_layers),
                          hidden=workload.target.hidden, dtype_bytes=workload.dtype_bytes)
