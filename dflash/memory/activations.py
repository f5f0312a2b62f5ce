"""What one sequence's activations take in a training step, byte by byte as the code keeps them:
the tap features kept from the target, the target's no-grad working set (one layer's), and the
drafter's saved activations under autocast or bf16 compute. `dflash.memory.peak_estimate` adds them up
(`MemoryEstimate.per_sequence`); `benchmarks/bench_memory_trace.py` holds them to a traced step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.memory.attention_masks import MIB, block_masks_mib, mask_build_peak_mib

if TYPE_CHECKING:
    from dflash.memory.workload import Workload

BF16_BYTES = 2                      # train.compute_dtype = "bfloat16": FSDP2 gathers bf16 weights, the forward runs in bf16
FP32_BYTES = 4                      # the drafter's residual stream, RMSNorm inputs/outputs, q/k norms
LINEAR_ATTENTION_FP32_COPIES = 14   # transformers' PyTorch Gated DeltaNet: fp32 [tokens, value dim] copies (traced)


def tap_features_mib(workload: Workload) -> float:
    """Hidden states of the tap layers kept from the target forward, one sequence."""
    return workload.captured_layers * workload.max_length * workload.target.hidden * workload.dtype_bytes / MIB


def target_activations_mib(workload: Workload) -> float:
    """One target layer's no-grad working set (residual, qkv, attention out, MLP), one sequence; on a
    hybrid target the larger of that and a Gated DeltaNet layer's (PyTorch fallback, float32)."""
    s = workload.target
    elements = 2 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 3 * s.intermediate
    attention = workload.max_length * elements * workload.dtype_bytes
    linear = workload.max_length * LINEAR_ATTENTION_FP32_COPIES * s.linear_value_dim * FP32_BYTES
    return max(attention, linear) / MIB


def drafter_activations_mib(workload: Workload, in_layer_backward: bool = True) -> float:
    """Saved for backward over one sequence, as the drafter's code computes under bf16 autocast:
    bf16 (`lo`) where a projection or the attention ran, float32 where the code keeps float32 (the
    residual stream, RMSNorm inputs and outputs, q/k norms), and one input copy per projection
    (autocast casts the float32 input again for every Linear). With train.compute_dtype = "bfloat16"
    the residual stream is bf16 and every projection reads one shared bf16 input, but each RMSNorm
    (transformers' Qwen3RMSNorm) still keeps its float32 upcast of the input, then a bf16 normalised
    copy and a bf16 output. With train.activation_checkpointing = "layers" each draft layer keeps
    only its input, and one layer's activations exist again while it is recomputed in its backward
    (`in_layer_backward`; not yet in the loss's backward). A layer's backward peaks in its MLP's
    backward (traced: `layers.k.mlp`), where the gradients of the gate and up outputs and of their
    product are alive beside the saved intermediates (`_mlp_backward_bytes`), and by then the final
    norm and the loss's rows have been freed by the loss's backward (`_final_bytes` counts only
    there). Without checkpointing every layer's activations are saved and the traced peak is the
    loss's backward: both moments count the final norm and the loss's rows. Beside them, flex's BlockMasks (one per layer rule, kept through the backward), or the
    moment the last one is built when that is larger (`memory.attention_masks`)."""
    layer = _layer_key_bytes(workload) + _layer_block_bytes(workload)
    if workload.checkpointed:       # each layer keeps its input; one layer's activations exist again in its backward
        layers = workload.drafter_layers * _layer_input_bytes(workload) + (layer if in_layer_backward else 0)
    else:
        layers = workload.drafter_layers * layer
    moment = _mlp_backward_bytes(workload) if in_layer_backward and workload.checkpointed else _final_bytes(workload)
    saved = (_context_bytes(workload) + layers + moment) / MIB
    return max(saved + block_masks_mib(workload), mask_build_peak_mib(workload))


def _mlp_backward_bytes(workload: Workload) -> int:
    """In an MLP's backward, beyond its saved activations: down_proj's input, once used, is freed,
    while the gradient of that product and those of the gate and up outputs exist (three new
    [block tokens x intermediate] tensors for one freed: two more than the layer saved)."""
    return 2 * workload.block_tokens * workload.target.intermediate * _low_bytes(workload)


def _layer_input_bytes(workload: Workload) -> int:
    """What a checkpointed layer keeps for its backward: its input hidden state over the block tokens
    (the residual stream: float32, or bf16 in bf16 compute; the context it also reads is kept once)."""
    residual = BF16_BYTES if _bf16_compute(workload) else FP32_BYTES
    return workload.block_tokens * workload.target.hidden * residual


def _low_bytes(workload: Workload) -> int:
    """Bytes of an element a projection or the attention produced: bf16 in bf16 compute, model.dtype under autocast."""
    if _bf16_compute(workload):
        return BF16_BYTES
    return workload.dtype_bytes if workload.autocast else FP32_BYTES


def _bf16_compute(workload: Workload) -> bool:
    return workload.bf16_compute


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
    return workload.block_tokens * (norms + attention + mlp + 2 * _conv_bytes(workload))


def _conv_bytes(workload: Workload) -> int:
    """DFlash 2: one sublayer's convolutions per block token (0 for DFlash). `prepare` keeps the dynamic
    kernels [2 x k x groups] (the projection's output) and, under autocast, the projection's bf16 copy of
    the normed input; the convolved input is a new [H] tensor the sublayer reads (float32 as the norm's
    output, bf16 in bf16 compute); `finish` keeps the sublayer's output [H] (the residual add saved none).
    The convolutions themselves are checkpointed: only their inputs are kept."""
    parts, s, lo = workload.dflash2, workload.target, _low_bytes(workload)
    if parts is None:
        return 0
    kernels = 2 * parts.conv_kernel_size * (s.hidden // parts.conv_group_size) * lo
    convolved = s.hidden * (lo if _bf16_compute(workload) else FP32_BYTES)
    return kernels + _projection_input_copies(workload, 1) * s.hidden * lo + convolved + s.hidden * lo


def _final_bytes(workload: Workload) -> int:
    """The final norm and the loss's copy of the labelled rows (float32; bf16 in bf16 compute)."""
    s, f = workload.target, FP32_BYTES
    rows = workload.anchors * (workload.block_size - 1)
    row_bytes = _low_bytes(workload) if _bf16_compute(workload) else f
    return workload.block_tokens * s.hidden * _norm_bytes(workload) + rows * s.hidden * row_bytes


def selector_activations_mib(workload: Workload, backward: bool = False) -> float:
    """DFlash 2's selector over one sequence's supervised slots (dflash.drafter.loss.selector_terms), 0 for
    DFlash. In its forward: the successor codebook's rows of K + 1 candidates [rank] each, looked up in the
    compute dtype (and autocast's bf16 copy over float32 ones, for the batched product), the predecessor
    rows, the projected hidden state, their product and its copy [rank]. In its backward (`backward`): the
    product's saved candidate rows and their gradient, in the product's dtype, and the [rank] tensors."""
    parts = workload.dflash2
    if parts is None:
        return 0.0
    compute = BF16_BYTES if _bf16_compute(workload) else FP32_BYTES
    lo = _low_bytes(workload)
    per_candidate = 2 * lo if backward else compute + (lo if compute != lo else 0)
    candidates = (parts.selector_top_k + 1) * parts.selector_rank * per_candidate
    context = parts.selector_rank * (2 * compute + 2 * lo)
    return workload.supervised_slots * (candidates + context) / MIB
