"""flex's BlockMask built from the anchors, on a CUDA device (unproven until it runs on one):
the tables equal `create_block_mask`'s there too; the build's transient (torch's peak allocated
memory above what was allocated before) is within the memory model's figure at the flagship's
shape (512 anchors x 16 over 8,192 tokens), where `create_block_mask` takes GiBs; and compiled
flex_attention through it gives SDPA's output and gradients under the flagship's two layer rules.
(On a CPU the same tables, the measured CPU transient and the compiled forward are
tests/train/test_block_mask.py and tests/memory/test_attention_masks.py.)"""
from __future__ import annotations

from typing import Callable

import pytest

pytestmark = pytest.mark.gpu

SMALL_ALLOCATION_SLACK = 64 * 1024     # the CUDA allocator rounds each small tensor up to 512 bytes


def flagship_rules():
    from launcher_core.layer_attention import LayerAttention

    return [LayerAttention(window=2048, causal=True), LayerAttention()]


def cuda_layout(sequences: int, anchors: int, context: int, block_size: int = 16):
    import torch

    from dflash.drafter.attention import BlockLayout

    generator = torch.Generator().manual_seed(0)
    rows = torch.stack([torch.randperm(context - 1, generator=generator)[:anchors].sort().values
                        for _ in range(sequences)])
    rows[-1, -3:] = 0                                     # padded anchors, as collate_rows pads them
    return BlockLayout(rows.cuda(), context, block_size)


def cuda_transient(build: Callable[[], object]) -> int:
    """torch's peak allocated bytes during `build`, above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = build()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - before


def test_the_tables_equal_create_block_masks_on_cuda(record):
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.drafter.attention import block_mask

    tables = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    different = []
    for sequences, anchors, context in ((4, 64, 1500), (2, 512, 8192)):
        layout = cuda_layout(sequences, anchors, context)
        keys = context + layout.num_queries
        for rule in flagship_rules():
            built = block_mask(layout, rule)
            eager = create_block_mask(layout.mask_mod(rule), sequences, None, layout.num_queries, keys, device="cuda")
            different += [f"{sequences}x{anchors}@{context} {rule} {name}" for name in tables
                          if not getattr(built, name).equal(getattr(eager, name))]
    assert record.check("BlockMask tables == create_block_mask's (CUDA)", not different, ", ".join(different) or "all equal")


def test_the_build_transient_is_within_the_model_on_cuda(record):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.drafter.attention import block_mask
    from dflash.memory.attention_masks import MIB, block_mask_build_bytes

    layout = cuda_layout(1, 512, 8192)
    queries, keys = layout.num_queries, layout.context_len + layout.num_queries
    modelled = block_mask_build_bytes(queries, keys)
    figures, within = {}, True
    for rule in flagship_rules():
        built = cuda_transient(lambda: block_mask(layout, rule))
        eager = cuda_transient(lambda: create_block_mask(layout.mask_mod(rule), 1, None, queries, keys, device="cuda"))
        figures[str(rule)] = {"built_mib": round(built / MIB, 3), "create_block_mask_mib": round(eager / MIB, 1),
                              "model_mib": round(modelled / MIB, 3)}
        within &= built <= modelled + SMALL_ALLOCATION_SLACK
    torch.cuda.empty_cache()
    record.figure(block_mask_transient=figures)
    assert record.check("BlockMask build transient <= the model (CUDA, 512 anchors x 16, 8,192 tokens)", within,
                        str(figures))


def test_compiled_flex_through_the_built_mask_equals_sdpa(record):
    import torch

    from dflash.drafter.attention import make_attend

    layout = cuda_layout(2, 96, 3000)
    keys = layout.context_len + layout.num_queries
    generator = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for rule in flagship_rules():
        q = torch.randn(2, 8, layout.num_queries, 64, device="cuda", generator=generator, requires_grad=True)
        k = torch.randn(2, 2, keys, 64, device="cuda", generator=generator, requires_grad=True)
        v = torch.randn(2, 2, keys, 64, device="cuda", generator=generator, requires_grad=True)
        results = []
        for backend in ("flex", "sdpa"):
            out = make_attend(layout, backend, rule)(q, k, v)
            results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
        for flex, sdpa in zip(*results):
            worst = max(worst, float((flex - sdpa).abs().max()))
    record.figure(flex_vs_sdpa_max_abs=worst)
    assert record.check("compiled flex through the built BlockMask == SDPA (out, dq, dk, dv)", worst <= 2e-3,
                        f"max |flex - sdpa| {worst:.2e} <= 2e-3")
