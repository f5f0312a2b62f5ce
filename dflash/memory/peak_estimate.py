"""Memory model of online DFlash training on one rank: what torch allocates at a step's worst moment.

Every rank holds the frozen target up to its deepest tap (replicated) and 1/N of the drafter: FSDP2
shards each draft layer and the root over the N ranks (dflash.train.rank.parallel). The peak is a line
in the micro-batch m, `PeakModel`: intercept + slope x m, plus the earlier micro-batches' gradients
while a step accumulates, and never below what the update and a checkpoint save hold between steps.
The intercept counts the static state (target weights, this rank's float32 shards with their gradients
and AdamW states) and what a forward/backward adds (the units FSDP2 gathers in the compute dtype, one
logits chunk, the gradient reduction's buffers); the slope is one sequence of the worst micro-batch
the data allows (`dflash.memory.activations`).

The figures are an estimate: a calibration measured on a GPU corrects them (`peak_model`). Non-torch
memory (CUDA context, NCCL, cuBLAS) is the plan's (`dflash.memory.budget`). No torch import: `plan`
runs in the launcher process. Each moment and why it counts what it does: docs/memory-model.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash.memory.activations import drafter_activations_mib, selector_activations_mib, tap_features_mib, target_activations_mib
from dflash.memory.attention_masks import MIB
from dflash.memory.workload import LOGITS_CHUNK_TOKENS, Workload, workload_from_profile

if TYPE_CHECKING:
    from dflash.memory.calibration_record import Calibration

__all__ = ["LOGITS_CHUNK_TOKENS", "MIB", "MemoryEstimate", "PeakLine", "PeakModel", "Workload", "estimate",
           "estimated_peak_model", "peak_model", "workload_from_profile"]

MASTER_BYTES = 4                    # the drafter's parameter shards, gradients and AdamW states: float32
REDUCE_BYTES = 4                    # FSDP2 reduces gradients in float32 (MixedPrecisionPolicy.reduce_dtype)
LOGITS_BYTES_PER_ELEMENT = 2 + 2 + 4 + 4  # bf16 logits and their gradient, fp32 upcast and its gradient
DISTILL_LOGITS_BYTES_PER_ELEMENT = 4 + 4 + 4  # train.loss = "distill": the drafter's log-softmax, the target's
                                              # log-probabilities and the KL's elementwise terms (float32)
ADAMW_STATES = 2                    # exp_avg and exp_avg_sq, like the parameter shards
ADAMW_UPDATE_TEMPORARIES = 1        # foreach AdamW: one float32 tensor per parameter shard during step()
PREFETCHED_LAYERS = 2               # a layer in its backward and the next one's all-gather, prefetched

Tensor = tuple[int, int]            # (dim 0, the other dims' product): how FSDP2 shards a parameter


@dataclass(frozen=True)
class MemoryEstimate:
    """The analytic model's figures, in MiB (one rank: the fullest, rank 0)."""

    target_weights: float
    drafter_weights: float              # this rank's float32 parameter shards
    drafter_grads: float                # this rank's float32 gradient shards (after a reduction)
    optimizer_states: float             # AdamW's two states over the shards
    gathered_weights: float             # gathered units in the compute dtype in a draft layer's backward
    autocast_weights: float             # autocast's bf16 weight copies kept for backward (float32 weights under autocast;
                                        # with recomputed layers only the root's, + `autocast_layer` in a layer's backward)
    unit_grads: float                   # a draft layer's unsharded gradients in its backward (compute dtype;
                                        # on one rank in bf16 compute with their float32 copy's half, traced)
    reduction_buffers: float            # what a reduction allocates: the reduce-scatter's float32 input (and, on one
                                        # rank, its output and the unit's gradients still held)
    retained_reduce_input: float        # the last reduction's input, kept until the next one
    logits_chunk: float
    tap_features: float
    target_activations: float
    drafter_activations: float          # per sequence, in a draft layer's backward (the most)
    held_weights: float = 0.0           # gathered units held from forward to backward (train.reshard_after_forward off)
    autocast_layer: float = 0.0         # the recomputed layer's bf16 weight copies (recomputation under autocast)
    gathered_most: float = 0.0          # the most gathered at once (a forward's copy-out: one more all-gather buffer)
    logits_per_sequence: float = 0.0    # a loss chunk holds rows of several sequences when one has fewer
    drafter_activations_at_loss: float = -1.0   # per sequence, in the loss's backward (-1: as in a layer's)
    update_temporaries: float = 0.0     # during optimizer.step, on top of static + gradient shards
    checkpoint_gather: float = 0.0      # during a checkpoint save: the largest tensor, gathered whole
    accumulated: float = 0.0            # gradients alive in a later micro-batch's forward/backward
    selector_gathered: float = 0.0      # DFlash 2: beside static in the selector's forward (0: no selector)
    selector_backward: float = 0.0      # DFlash 2: beside static in the selector's backward (gathered again)
    selector_reduction: float = 0.0     # DFlash 2: beside static in the selector's gradient reduction
    selector_activations: float = 0.0   # DFlash 2: the selector's own tensors in its forward, per sequence
    selector_backward_activations: float = 0.0  # DFlash 2: its saved tensors and their gradients, per sequence
    selector_reduce_held: float = 0.0   # DFlash 2: of `selector_reduction`, what a tracker calls gradients (the
                                        # reduce-scatter input; on one rank the codebook gradient still held)
    root_gathered: float = 0.0          # the root unit gathered beside DFlash 2's selector (several ranks)
    rank_share: int = 1                 # sequences per rank per step: below it, micro-batches accumulate
    world_size: int = 1

    @property
    def static(self) -> float:
        """Alive through the run: the target, this rank's parameter shards and their AdamW states."""
        return self.target_weights + self.drafter_weights + self.optimizer_states

    @property
    def loss_moment(self) -> float:
        """Beside the activations in the loss's backward: one logits chunk and its gradients (nothing
        gathered, unless held)."""
        return self.logits_chunk

    @property
    def layer_moment(self) -> float:
        """Beside the activations in a draft layer's backward: the root and that layer gathered, the
        next layer's all-gather prefetched, the layer's unsharded gradients, and the previous
        reduction's input buffer (FSDP2 keeps it until the next reduce-scatter)."""
        return self.gathered_weights + self.unit_grads + self.retained_reduce_input + self.autocast_layer

    @property
    def step_static(self) -> float:
        """What every moment of a forward/backward stands on (the first micro-batch: no gradient yet)."""
        return self.static + self.autocast_weights + self.held_weights

    def moment_lines(self) -> tuple[PeakLine, ...]:
        """The moments that can be a micro-batch's peak, each a line in the micro-batch: the loss's
        backward, a draft layer's backward, the target's forward (and DFlash 2's selector)."""
        lines = (PeakLine("the loss's backward", self.step_static + self.loss_moment, self.per_sequence_at_loss),
                 PeakLine("a draft layer's backward", self.step_static + self.layer_moment, self.per_sequence_in_layer),
                 PeakLine("the target's forward", self.static + self.held_weights, self.per_sequence_in_target))
        if self.selector_gathered <= 0:
            return lines
        before = self.per_sequence_at_selector - self.selector_activations     # the drafter's, beside the selector's
        return lines + (PeakLine("the selector's forward", self.step_static + self.selector_gathered,
                                 self.per_sequence_at_selector),
                        PeakLine("the selector's backward", self.step_static + self.selector_backward,
                                 before + self.selector_backward_activations),
                        PeakLine("the selector's gradient reduction", self.step_static + self.selector_reduction, before))

    def drafter_lines(self) -> tuple[PeakLine, ...]:
        """The moments of the drafter's forward/backward (all but the target's forward)."""
        return tuple(line for line in self.moment_lines() if line.moment != "the target's forward")

    @property
    def per_sequence_at_selector(self) -> float:
        """The selector's forward/backward: every drafter activation the loss's backward finds, and the
        selector's own; the logits chunks do not exist yet (the head's chunks are recomputed after)."""
        drafter = self.drafter_activations if self.drafter_activations_at_loss < 0 else self.drafter_activations_at_loss
        return self.tap_features + drafter + self.selector_activations

    def step_mib(self, micro_batch: int) -> float:
        return max(line.at(micro_batch) for line in self.moment_lines()) + self.accumulated_gradients(micro_batch)

    @property
    def per_sequence(self) -> float:
        """Per sequence at the most (the target's forward, the loss's backward, a draft layer's backward)."""
        return max(self.per_sequence_in_target, self.per_sequence_at_loss, self.per_sequence_in_layer)

    @property
    def per_sequence_in_target(self) -> float:
        """The target's no-grad forward of a micro-batch: its taps and its working set (the micro-batch's
        drafter activations do not exist yet)."""
        return self.tap_features + self.target_activations

    @property
    def per_sequence_at_loss(self) -> float:
        drafter = self.drafter_activations if self.drafter_activations_at_loss < 0 else self.drafter_activations_at_loss
        return self.tap_features + drafter + self.logits_per_sequence

    @property
    def per_sequence_in_layer(self) -> float:
        return self.tap_features + self.drafter_activations

    @property
    def update_peak(self) -> float:
        """Static, the gradient shards and AdamW's temporary."""
        return self.static + self.drafter_grads + self.update_temporaries

    @property
    def checkpoint_peak(self) -> float:
        return self.static + self.checkpoint_gather

    @property
    def between_steps(self) -> float:
        """The peak outside forward/backward: the optimizer update or a checkpoint save."""
        return max(self.update_peak, self.checkpoint_peak)

    def accumulated_gradients(self, micro_batch: int) -> float:
        """Gradients alive in a forward/backward: those of the step's earlier micro-batches (none
        when one micro-batch is the whole step: zero_grad(set_to_none=True) dropped them)."""
        return self.accumulated if micro_batch < self.rank_share else 0.0


@dataclass(frozen=True)
class PeakLine:
    """One moment of a forward/backward: intercept + slope x micro-batch, in MiB."""

    moment: str
    intercept_mib: float
    slope_mib: float

    def at(self, micro_batch: int) -> float:
        return self.intercept_mib + self.slope_mib * micro_batch

    def shifted(self, intercept_mib: float, slope_mib: float) -> "PeakLine":
        return PeakLine(self.moment, self.intercept_mib + intercept_mib, self.slope_mib + slope_mib)


@dataclass(frozen=True)
class PeakModel:
    """peak(m) = the highest of the step's moment lines at m (+ the accumulated gradients while
    micro-batches accumulate), never below the peak between steps; MiB of torch-allocated memory."""

    lines: tuple[PeakLine, ...]
    static_mib: float
    source: str                     # "estimate" or "calibration"
    between_steps_mib: float = 0.0  # optimizer update / checkpoint save (independent of m)
    accumulation_mib: float = 0.0   # gradients alive from earlier micro-batches when m < rank_share
    rank_share: int = 1

    def deciding_line(self, micro_batch: int) -> PeakLine:
        """The moment that peaks at `micro_batch`."""
        return max(self.lines, key=lambda line: line.at(micro_batch))

    @property
    def intercept_mib(self) -> float:
        return self.deciding_line(1).intercept_mib

    @property
    def slope_mib(self) -> float:
        return self.deciding_line(1).slope_mib

    def step_mib(self, micro_batch: int) -> float:
        """The forward/backward's peak at `micro_batch` (from the second micro-batch of a step on, the
        gradients of the earlier ones are alive)."""
        accumulated = self.accumulation_mib if micro_batch < self.rank_share else 0.0
        return self.deciding_line(micro_batch).at(micro_batch) + accumulated

    def peak_mib(self, micro_batch: int) -> float:
        return max(self.step_mib(micro_batch), self.between_steps_mib)

    def largest_fitting(self, budget_mib: float, ceiling: int) -> int:
        """The largest micro-batch in 0..ceiling whose peak fits the budget (0: not even one)."""
        if self.between_steps_mib > budget_mib:
            return 0
        if budget_mib == float("inf"):
            return ceiling
        return max([0] + [m for m in range(1, ceiling + 1) if self.peak_mib(m) <= budget_mib])


# --- the drafter's tensors and how FSDP2 shards them ----------------------------------------

def layer_tensors(workload: Workload) -> list[Tensor]:
    """One draft layer's parameters as (dim 0, rest): q/k/v/o, the MLP, q/k norms, two RMSNorms (and
    DFlash 2's two convolutions)."""
    h, own, i = workload.target.hidden, workload.drafter_shape, workload.target.intermediate
    return [(own.q_dim, h), (own.kv_dim, h), (own.kv_dim, h), (h, own.q_dim), (i, h), (i, h), (h, i),
            (own.head_dim, 1), (own.head_dim, 1), (h, 1), (h, 1)] + conv_tensors(workload)


def conv_tensors(workload: Workload) -> list[Tensor]:
    """DFlash 2's convolutions of one draft layer (attention_conv, mlp_conv): each a static `base_kernel`
    [2, k, H] and a `kernel_projection` H -> 2 x k x H / g (dflash.drafter.dflash2.GroupedDynamicCausalConv)."""
    parts, h = workload.dflash2, workload.target.hidden
    if parts is None:
        return []
    k, groups = parts.conv_kernel_size, h // parts.conv_group_size
    return [(2, k * h), (2 * k * groups, h)] * 2


def selector_tensors(workload: Workload) -> list[Tensor]:
    """DFlash 2's candidate selector, its own FSDP2 unit (dflash.train.rank.parallel): the predecessor and
    successor codebooks [vocab, rank] and the hidden projection H -> rank."""
    parts = workload.dflash2
    if parts is None:
        return []
    rank, vocab = parts.selector_rank, workload.target.vocab
    return [(vocab, rank), (vocab, rank), (rank, workload.target.hidden)]


def dflash2_parameter_counts(workload: Workload) -> dict[str, int]:
    """The parameters DFlash 2 adds: the convolutions (every layer), the codebooks, the selector's projection."""
    convolutions = workload.drafter_layers * sum(rows * rest for rows, rest in conv_tensors(workload))
    selector = selector_tensors(workload)
    return {"convolutions": convolutions, "codebooks": sum(rows * rest for rows, rest in selector[:2]),
            "projection": sum(rows * rest for rows, rest in selector[2:])}


def root_tensors(workload: Workload) -> list[Tensor]:
    """The root unit's parameters: fc over the concatenated taps, hidden_norm, the final norm."""
    h = workload.target.hidden
    return [(h, len(workload.tap_layers) * h), (h, 1), (h, 1)]


def drafter_tensors(workload: Workload) -> list[Tensor]:
    return layer_tensors(workload) * workload.drafter_layers + root_tensors(workload) + selector_tensors(workload)


def drafter_params(workload: Workload) -> int:
    return sum(rows * rest for rows, rest in drafter_tensors(workload))


def shard_numel(tensors: list[Tensor], world: int) -> int:
    """Elements of the fullest rank's shards (rank 0: ceil(dim 0 / N) rows of every tensor)."""
    return sum(math.ceil(rows / world) * rest for rows, rest in tensors)


def gathered_numel(tensors: list[Tensor], world: int) -> int:
    """Elements of a unit gathered whole (every rank's padded shard)."""
    return world * shard_numel(tensors, world)


def target_params_loaded(workload: Workload, layers: int | None = None) -> int:
    """The target's parameters with its first `layers` decoder layers (default: up to the deepest tap, what
    stays on the GPU)."""
    shape = workload.target
    dropped = max(0, shape.num_layers - (workload.loaded_target_layers if layers is None else layers))
    return shape.total_params() - dropped * shape.layer_params()


# --- the analytic estimate ----------------------------------------------------------------

def estimate(workload: Workload) -> MemoryEstimate:
    world, shard = workload.world_size, shard_numel(drafter_tensors(workload), workload.world_size)
    master = shard * MASTER_BYTES / MIB
    return MemoryEstimate(
        target_weights=target_params_loaded(workload) * workload.dtype_bytes / MIB,
        drafter_weights=master, drafter_grads=master, optimizer_states=ADAMW_STATES * master,
        gathered_weights=_gathered_mib(workload, layers=_layers_in_backward(workload)),
        gathered_most=_gathered_most_mib(workload),
        held_weights=0.0 if workload.reshard_after_forward else _gathered_mib(workload, layers=workload.drafter_layers),
        autocast_weights=_autocast_weights_mib(workload), autocast_layer=_autocast_layer_mib(workload),
        unit_grads=_layer_mib(workload) * (2 if world == 1 and workload.bf16_compute else 1),
        reduction_buffers=_reduction_mib(workload), retained_reduce_input=_largest_unit(workload) * REDUCE_BYTES / MIB,
        logits_chunk=_logits_chunk_mib(workload), logits_per_sequence=_logits_per_sequence_mib(workload),
        tap_features=tap_features_mib(workload), target_activations=target_activations_mib(workload),
        drafter_activations=drafter_activations_mib(workload),
        drafter_activations_at_loss=drafter_activations_mib(workload, in_layer_backward=False),
        update_temporaries=ADAMW_UPDATE_TEMPORARIES * master,
        checkpoint_gather=max(rows * rest for rows, rest in drafter_tensors(workload)) * MASTER_BYTES / MIB,
        accumulated=_accumulated_mib(workload, master), rank_share=workload.rank_share, world_size=world,
        selector_gathered=_selector_gathered_mib(workload), selector_backward=_selector_gathered_mib(workload, copies=1),
        selector_reduction=_selector_reduction_mib(workload), selector_activations=selector_activations_mib(workload),
        selector_backward_activations=selector_activations_mib(workload, backward=True), selector_reduce_held=_selector_reduce_held_mib(workload),
        root_gathered=_root_beside_selector_mib(workload))


def _selector_unit(workload: Workload) -> int:
    """Elements of DFlash 2's selector unit gathered whole (0 without one)."""
    return gathered_numel(selector_tensors(workload), workload.world_size)


def _root_beside_selector_mib(workload: Workload) -> float:
    """The root unit gathered in the compute dtype while the selector runs: on several ranks it stays
    gathered from its forward to the end of the backward; on one rank none is traced beside the selector."""
    if workload.world_size == 1:
        return 0.0
    return gathered_numel(root_tensors(workload), workload.world_size) * _compute_bytes(workload) / MIB


def _selector_gathered_mib(workload: Workload, copies: int = 2) -> float:
    """DFlash 2's selector, its own unit, called by the loss after the drafter's forward (the root still
    gathered): in its forward FSDP2's all-gather buffer and, on several ranks, the unsharded copy out
    of it (`copies`, traced); gathered again in its backward, the copy alone (copies=1); 0 without a selector."""
    unit = _selector_unit(workload)
    if not unit:
        return 0.0
    root = _root_beside_selector_mib(workload)
    return root + unit * _compute_bytes(workload) / MIB * (copies if workload.world_size > 1 else 1)


def _selector_reduce_held_mib(workload: Workload) -> float:
    """Of the selector's reduction (`_selector_reduction_mib`), the reduce-scatter's input on several ranks,
    the codebook gradient still held on one."""
    unit = _selector_unit(workload)
    if workload.world_size == 1:
        return unit * _compute_bytes(workload) // 2 / MIB
    return unit * REDUCE_BYTES / MIB


def _selector_reduction_mib(workload: Workload) -> float:
    """The selector's gradient reduction (its weights resharded, its saved tensors freed, the root still
    gathered), as traced: on several ranks the codebooks' dense gradients in the compute dtype, four
    [vocab, rank] tensors (twice the gradients), beside the reduce-scatter's float32 input (FSDP2 frees the
    gradients once copied in, before it allocates the output: `foreach_reduce`); on one rank, where no
    collective runs, the input and its float32 copy as output with one codebook's gradient still held."""
    unit = _selector_unit(workload)
    if not unit:
        return 0.0
    world, compute = workload.world_size, _compute_bytes(workload)
    root = _root_beside_selector_mib(workload)
    if world == 1:
        return root + (2 * unit * REDUCE_BYTES + unit * compute // 2) / MIB
    return root + (2 * unit * compute + unit * REDUCE_BYTES) / MIB


def _compute_bytes(workload: Workload) -> int:
    """The gathered weights' dtype: FSDP2's param_dtype (bf16 with train.compute_dtype = "bfloat16")."""
    return 2 if workload.bf16_compute else MASTER_BYTES


def _layers_in_backward(workload: Workload) -> int:
    """Draft layers gathered in a layer's backward: itself and the next one's prefetched all-gather
    (kept until the next all-gather); on one rank there is no all-gather, only the layer's cast weights."""
    return PREFETCHED_LAYERS if workload.world_size > 1 else 1


def _reduction_mib(workload: Workload) -> float:
    """What one unit's gradient reduction allocates above what was alive: its float32 input (the
    unit gathered whole) and output (this rank's shard; on one rank as large as the input), with
    the unit's gradients still held (measured on 2 real gloo ranks, tests/measure/test_measured_memory.py;
    on one rank in bf16 compute also a float32 copy of half their size, traced). The largest of the
    draft layers', the root's and DFlash 2's selector's (on one rank with one codebook's gradient in
    the compute dtype still held, traced)."""
    world = workload.world_size
    backbone = max(gathered_numel(layer_tensors(workload), world), gathered_numel(root_tensors(workload), world))
    selector = _selector_unit(workload)
    codebook = selector_tensors(workload)[0] if selector else (0, 0)
    held = codebook[0] * codebook[1] * _compute_bytes(workload) / MIB if world == 1 else 0.0
    selector_mib = _unit_reduction_mib(workload, selector) + held if selector else 0.0
    return max(_unit_reduction_mib(workload, backbone), selector_mib)


def _unit_reduction_mib(workload: Workload, unit_numel: int) -> float:
    """A reduction's buffers for a unit of `unit_numel` elements gathered whole (`_reduction_mib`)."""
    unit = unit_numel * REDUCE_BYTES / MIB
    output = unit / workload.world_size
    extra = unit_numel * _compute_bytes(workload) / MIB if workload.world_size == 1 and workload.bf16_compute else 0.0
    return unit + output + extra


def _gathered_most_mib(workload: Workload) -> float:
    """The most gathered at once: in a forward's copy-out, the root, the layer, the previous all-gather's
    kept buffer and the new one (every layer and a buffer when layers stay gathered to their backward);
    or DFlash 2's selector gathered beside the root."""
    if workload.world_size == 1:
        layers = _gathered_mib(workload, layers=1)
    elif not workload.reshard_after_forward:
        layers = _gathered_mib(workload, layers=workload.drafter_layers + 2)
    else:
        layers = _gathered_mib(workload, layers=PREFETCHED_LAYERS + 1)
    return max(layers, _selector_gathered_mib(workload))


def _gathered_mib(workload: Workload, layers: int) -> float:
    """The root unit and `layers` draft layers gathered whole in the compute dtype (FSDP2 keeps the
    latest all-gather's buffer until the next one: a layer's backward holds itself and the next
    layer's prefetched all-gather; a forward's copy-out one more)."""
    world = workload.world_size
    numel = gathered_numel(root_tensors(workload), world) + layers * gathered_numel(layer_tensors(workload), world)
    return numel * _compute_bytes(workload) / MIB


def _layer_mib(workload: Workload) -> float:
    """A draft layer gathered whole in the compute dtype (its unsharded gradients are as large)."""
    return gathered_numel(layer_tensors(workload), workload.world_size) * _compute_bytes(workload) / MIB


def _autocast_weights_mib(workload: Workload) -> float:
    """bf16 autocast over float32 weights: every weight's bf16 copy, kept by its matmul for backward
    (with activation checkpointing only the root's and the recomputed layer's)."""
    if workload.bf16_compute or not workload.autocast:
        return 0.0
    projection = sum(rows * rest for rows, rest in selector_tensors(workload)[2:])    # the codebooks are looked up, not cast
    if workload.checkpointed:
        return (sum(rows * rest for rows, rest in root_tensors(workload)) + projection) * workload.dtype_bytes / MIB
    layers = sum(rows * rest for rows, rest in layer_tensors(workload)) * workload.drafter_layers
    return (layers + sum(rows * rest for rows, rest in root_tensors(workload)) + projection) * workload.dtype_bytes / MIB


def _autocast_layer_mib(workload: Workload) -> float:
    """A recomputed layer's bf16 weight copies, alive in its backward (recomputation under autocast)."""
    if workload.bf16_compute or not workload.autocast or not workload.checkpointed:
        return 0.0
    return sum(rows * rest for rows, rest in layer_tensors(workload)) * workload.dtype_bytes / MIB


def _largest_unit(workload: Workload) -> int:
    """Elements of the largest unit gathered whole (a draft layer, the root with fc, or DFlash 2's selector:
    on several ranks its reduce-scatter input is what the next draft layer's backward finds retained; on
    one rank no collective runs and none is traced)."""
    world = workload.world_size
    selector = _selector_unit(workload) if world > 1 else 0
    return max(gathered_numel(layer_tensors(workload), world), gathered_numel(root_tensors(workload), world), selector)


def _accumulated_mib(workload: Workload, master_mib: float) -> float:
    """Gradients alive from a step's earlier micro-batches: this rank's shards, or every unsharded one."""
    if workload.gradient_sync == "last_micro_batch":
        return drafter_params(workload) * REDUCE_BYTES / MIB
    return master_mib


def _label_rows(workload: Workload) -> int:
    """Rows of one sequence whose logits the loss computes: slots 1..B-1 of every anchor."""
    return workload.supervised_slots


def _logits_chunk_mib(workload: Workload) -> float:
    """One full chunk, when one sequence fills it (else the chunk grows with the micro-batch)."""
    if _label_rows(workload) < workload.logits_chunk_tokens:
        return 0.0
    return workload.logits_chunk_tokens * workload.target.vocab * _logits_bytes(workload) / MIB


def _logits_bytes(workload: Workload) -> int:
    """Bytes per logits element alive in the loss's backward."""
    return LOGITS_BYTES_PER_ELEMENT + (DISTILL_LOGITS_BYTES_PER_ELEMENT if workload.distill else 0)


def _logits_per_sequence_mib(workload: Workload) -> float:
    """A sequence with fewer label rows than a chunk: the chunk holds that many rows per sequence
    (exact while the micro-batch's rows fit one chunk, above the truth beyond)."""
    if _label_rows(workload) >= workload.logits_chunk_tokens:
        return 0.0
    return _label_rows(workload) * workload.target.vocab * _logits_bytes(workload) / MIB


# --- the peak model --------------------------------------------------------------------

def estimated_peak_model(workload: Workload) -> PeakModel:
    figures = estimate(workload)
    return PeakModel(lines=figures.moment_lines(), static_mib=figures.static, source="estimate",
                     between_steps_mib=figures.between_steps, accumulation_mib=figures.accumulated,
                     rank_share=figures.rank_share)


def peak_model(workload: Workload, calibration: Calibration | None = None) -> PeakModel:
    """The estimate corrected by a calibration of this very workload (measured at any world size),
    else the estimate. The calibration measured steps of two micro-batches each on its own number
    of ranks: the estimate of THAT (its shards, its accumulated gradients) is subtracted from the
    measured line, and the difference -- what the model misses -- is added to the estimate for the
    profile's ranks. So accumulated gradients, the shard share and the reduction's buffers are in a
    calibrated plan exactly as in the estimate, and fed the estimate's own line it is the estimate."""
    estimated = estimated_peak_model(workload)
    if calibration is None or calibration.workload_key != workload.key():
        return estimated
    measured_on = estimated_peak_model(dataclasses.replace(workload, world_size=calibration.world_size,
                                                           rank_share=calibration.micro_batches[-1] + 1))
    (m1, m2), (p1, p2) = calibration.micro_batches, calibration.peaks_mib
    miss1, miss2 = p1 - measured_on.step_mib(m1), p2 - measured_on.step_mib(m2)
    slope_miss = (miss2 - miss1) / (m2 - m1)
    intercept_miss = miss1 - slope_miss * m1
    return dataclasses.replace(estimated, lines=tuple(line.shifted(intercept_miss, slope_miss) for line in estimated.lines),
                               source="calibration",
                               between_steps_mib=max(0.0, estimated.between_steps_mib + intercept_miss + slope_miss))
