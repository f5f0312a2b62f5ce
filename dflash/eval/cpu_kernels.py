"""Faster linear layers for in-process decoding on a CPU (`eval.cpu_matmul = "auto"`, float32).

Decoding a small model on a CPU core streams every weight matrix from memory once per forward,
and how fast depends on the kernel torch picks for `F.linear(x, W)` with W stored [out, in]:

* one row (plain decoding, a draft's single new position): MKL's transposed gemv reads W at
  about 60% of the speed of a plain gemv over a transposed copy `x @ W.T` (benchmarks/bench_step_cost.py);
* a few rows (a verify forward of k + 1 tokens, the drafter's block): MKL's small-M gemm repacks
  W on every call, so 4 or 8 rows cost ~1.5x one row; oneDNN's matmul on a weight packed once
  (`torch.ops.mkldnn._reorder_linear_weight`) costs about what one row does.

`use_fast_cpu_linears(module)` gives every `nn.Linear` inside `module` a forward that picks the
faster kernel for the row count, keeping the module (and its `weight`, which the drafter reads as
the target's lm_head) as it is: an instance attribute `forward` shadows the class's. The copies
cost one transposed and one packed weight per layer (about twice the float32 weights). Plain
decoding and speculative decoding run on the same patched model, so the speedup's baseline is as
fast as the verify (the eval and the benchmark compare both with transformers' `generate` on it).
The kernels round differently from torch's default (relative differences ~1e-6): the lossless
checks compare outputs decoded with them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch
    from torch import nn

PACKED_ROWS = 4            # the row count oneDNN packs the weights for (a verify block's size at cpu-demo's draft)


def use_fast_cpu_linears(module: nn.Module) -> int:
    """Patch every float32 CPU `nn.Linear` under `module`; returns how many were patched (0: none
    qualified, e.g. a GPU or bf16 model)."""
    import torch

    count = 0
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and _qualifies(layer) and "forward" not in layer.__dict__:
            setattr(layer, "forward", _fast_forward(layer))      # an instance attribute shadows nn.Linear.forward
            count += 1
    return count


def _qualifies(layer: nn.Linear) -> bool:
    import torch

    weight = layer.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and not weight.requires_grad


def _fast_forward(layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch

    transposed = layer.weight.detach().t().contiguous()            # [in, out]: a plain gemv for one row
    packed = _packed(layer.weight.detach())
    bias = None if layer.bias is None else layer.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] == 1 or packed is None or x.requires_grad:
            out = flat @ transposed if bias is None else torch.addmm(bias, flat, transposed)
        elif flat.shape[0] == 0:
            out = flat.new_zeros(0, transposed.shape[1])
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], transposed.shape[1])

    return forward


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of `weight` for a few rows, or None where oneDNN is not available."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS)
    except (RuntimeError, AttributeError):
        return None
    return packed
