"""eval.cpu_matmul = "auto" (dflash.eval.cpu_kernels): every float32 CPU linear layer on the faster
kernel for its row count, giving nn.Linear's outputs; decoding on the patched target stays lossless."""
from __future__ import annotations

import copy

import pytest
import torch

from dflash.eval.cpu_kernels import use_fast_cpu_linears
from dflash.eval.oracle import OracleDrafter
from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode

PROMPTS = ([9707, 11, 1879, 0], [785, 6722, 315, 9625, 374, 12095, 13, 785])


@pytest.mark.parametrize("bias", [True, False])
def test_patched_linears_give_nn_linear_outputs_for_every_row_count(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160, bias=bias).requires_grad_(False)
    inputs = {rows: torch.randn(1, rows, 96) for rows in (0, 1, 2, 3, 4, 8, 17)}
    expected = {rows: layer(x) for rows, x in inputs.items()}
    assert use_fast_cpu_linears(layer) == 1 and use_fast_cpu_linears(layer) == 0      # once only
    for rows, x in inputs.items():
        got = layer(x)
        assert got.shape == expected[rows].shape
        torch.testing.assert_close(got, expected[rows], rtol=1e-5, atol=1e-5)
    assert layer.weight.shape == (160, 96)                # the module and its weight stay as they were


def test_a_wrong_kernel_would_be_caught():
    """Control: the comparison above fails for kernels that do not compute the layer's product;
    here copies taken before its weight changed (the patch is for frozen models only)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160).requires_grad_(False)
    use_fast_cpu_linears(layer)
    with torch.no_grad():
        layer.weight.mul_(1.001)
    for rows in (1, 4):
        x = torch.randn(rows, 96)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                       rtol=1e-5, atol=1e-5)


def test_trainable_or_non_float32_layers_are_left_alone():
    trainable = torch.nn.Linear(8, 8)
    half = torch.nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
    assert use_fast_cpu_linears(torch.nn.Sequential(trainable, half)) == 0
    assert "forward" not in trainable.__dict__ and "forward" not in half.__dict__


def test_decoding_on_the_patched_target_is_lossless(tiny_qwen3_model):
    """Drafted and plain greedy decoding on the patched target give the same tokens (and the same
    as the unpatched target's) for drafters right always, never, or every third token."""
    model = copy.deepcopy(tiny_qwen3_model).requires_grad_(False)     # frozen, as eval loads the target
    assert use_fast_cpu_linears(model) > 4 * model.config.num_hidden_layers
    settings = DecodeSettings(block_size=4, max_new_tokens=20)
    for prompt in PROMPTS:
        reference = speculative_decode(TargetVerifier(tiny_qwen3_model), NoDrafter(), prompt, settings).tokens
        plain = speculative_decode(TargetVerifier(model), NoDrafter(), prompt, settings).tokens
        assert plain == reference
        for wrong_every in (0, 1, 3):
            drafter = OracleDrafter(plain, len(prompt), model.config.vocab_size, wrong_every=wrong_every)
            assert speculative_decode(TargetVerifier(model), drafter, prompt, settings).tokens == plain
