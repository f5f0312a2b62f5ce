"""The flagship twin on a CUDA GPU: what only a GPU can prove about the Qwen3.5/3.6 paths.

    python -m pytest -m gpu tests/gpu -q          # on a GPU node (about a minute); skipped without CUDA

* the twin loads straight onto the GPU (`load_target`, device_map) in bf16, and its Gated
  DeltaNet layers run there (through flash-linear-attention / causal-conv1d when installed: the
  test reports which path ran);
* online extraction + the drafter in bf16 through compiled flex_attention, forward AND backward,
  against SDPA on the same batch (loss, per-slot accuracy counts, every gradient);
* lossless speculative decoding on the twin on the GPU: oracle drafts wrong every 3rd token and
  EOS mid-block, with every rollback mode, equal token for token to target-only decoding.
"""
from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flagship twin on GPU)")]

PROMPTS = ([785, 6722, 315, 9625, 374, 12095, 13, 785], [9707, 11, 1879, 0], [151644, 872, 198, 3838, 374, 220])


@pytest.fixture(scope="module")
def twin_bf16(flagship_twin_target):
    from dflash.target_model import load_target

    return load_target(flagship_twin_target, device="cuda", dtype="bfloat16")


@pytest.fixture(scope="module")
def twin_fp32(flagship_twin_target):
    """float32 without TF32 (cuDNN convolutions default to it): cached and uncached forwards then
    differ only by summation order."""
    from dflash.target_model import load_target

    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield load_target(flagship_twin_target, device="cuda", dtype="float32")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_twin_loads_onto_the_gpu_and_reports_its_linear_attention_path(twin_bf16, record_property):
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in twin_bf16.parameters())
    kernels = {name: importlib.util.find_spec(module) is not None
               for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))}
    record_property("linear_attention_kernels", kernels)
    print(f"linear-attention kernels importable: {kernels}")
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    with torch.inference_mode():
        logits = twin_bf16(ids).logits
    assert logits.shape == (1, len(PROMPTS[0]), 248320) and torch.isfinite(logits.float()).all()


def _drafter_loss(drafter, target, input_ids, anchors, backend):
    from dflash.drafter.loss import block_loss, block_targets, decay_weights
    from dflash.drafter.network import forward_blocks
    from dflash.drafter.taps import extract_taps

    features = extract_taps(target, input_ids, drafter.target_layer_ids)
    loss_mask = torch.ones_like(input_ids)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = forward_blocks(drafter, input_ids, anchors, features, backend)
        targets = block_targets(input_ids, loss_mask, anchors, valid, drafter.block_size)
        return block_loss(hidden, drafter.logits, targets, decay_weights(drafter.block_size, 7.0).cuda(), 2048)


def test_bf16_flex_forward_and_backward_match_sdpa_on_the_twin(twin_bf16):
    """The flagship's drafter (its shape policy, block 16, taps spaced over the twin's layers) on
    the twin's bf16 features: compiled flex_attention vs SDPA, loss and every gradient."""
    from dflash.drafter.network import DFlashDrafter, drafter_config
    from dflash.drafter.taps import default_target_layer_ids

    layers = default_target_layer_ids(twin_bf16.config.num_hidden_layers, 5)
    config = drafter_config(twin_bf16.config, num_layers=5, block_size=16, target_layer_ids=layers,
                            mask_token_id=248070)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).attach_target(twin_bf16).cuda()
    input_ids = torch.randint(100, 150000, (2, 96), device="cuda")
    anchors = torch.tensor([[3, 20, 41, 70], [0, 15, 33, 60]], device="cuda")
    results = {}
    for backend in ("flex", "sdpa"):
        drafter.zero_grad(set_to_none=True)
        parts = _drafter_loss(drafter, twin_bf16, input_ids, anchors, backend)
        (parts.weighted_ce / parts.weight_sum).backward()
        results[backend] = (parts, {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None})
    (flex, flex_grads), (sdpa, sdpa_grads) = results["flex"], results["sdpa"]
    torch.testing.assert_close(flex.weighted_ce, sdpa.weighted_ce, rtol=2e-2, atol=2e-2)
    assert (flex.correct - sdpa.correct).abs().sum() <= 2      # argmax ties may flip in bf16
    assert flex_grads.keys() == sdpa_grads.keys() and flex_grads
    for name in flex_grads:
        scale = sdpa_grads[name].abs().max().clamp(min=1e-6)
        assert (flex_grads[name] - sdpa_grads[name]).abs().max() / scale < 5e-2, name


def _target_only(model, prompt, count):
    from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode

    return speculative_decode(TargetVerifier(model), NoDrafter(), prompt, DecodeSettings(4, count)).tokens


@pytest.mark.parametrize("rollback", ["snapshot", "snapshot-rerun", "reprefill"])
def test_speculative_decoding_on_the_twin_is_lossless_on_the_gpu(twin_fp32, rollback):
    from dflash.eval.oracle import OracleDrafter
    from dflash.eval.specdec import DecodeSettings, TargetVerifier, speculative_decode

    for prompt in PROMPTS:
        expected = _target_only(twin_fp32, prompt, 32)
        with torch.inference_mode():
            uncached = list(prompt)
            for _ in range(32):
                uncached.append(int(twin_fp32(torch.tensor([uncached], device="cuda")).logits[0, -1].argmax()))
        assert expected == uncached[len(prompt):], "cached target-only decoding differs from the uncached forward"
        for wrong_every, block in ((3, 16), (1, 8), (0, 16)):
            drafter = OracleDrafter(expected, len(prompt), twin_fp32.config.vocab_size, wrong_every=wrong_every)
            verifier = TargetVerifier(twin_fp32, rollback=rollback)
            result = speculative_decode(verifier, drafter, prompt, DecodeSettings(block, 32))
            assert result.tokens == expected, (rollback, wrong_every, block)
        eos = expected[9]
        cut = expected[:expected.index(eos) + 1]
        drafter = OracleDrafter(expected, len(prompt), twin_fp32.config.vocab_size, wrong_every=4)
        result = speculative_decode(TargetVerifier(twin_fp32, rollback=rollback), drafter, prompt,
                                    DecodeSettings(16, 32, eos_ids=(eos,)))
        assert result.tokens == cut


def test_bf16_speculative_decoding_is_reported_against_bf16_target_only_decoding(twin_bf16, record_property):
    """Reported, not required, in bf16: a verify block and one-token steps round differently, so
    greedy argmax ties can flip (the float32 test above is the lossless proof)."""
    from dflash.eval.oracle import OracleDrafter
    from dflash.eval.specdec import DecodeSettings, TargetVerifier, speculative_decode

    prompt = PROMPTS[0]
    expected = _target_only(twin_bf16, prompt, 24)
    drafter = OracleDrafter(expected, len(prompt), twin_bf16.config.vocab_size, wrong_every=3)
    result = speculative_decode(TargetVerifier(twin_bf16), drafter, prompt, DecodeSettings(16, 24))
    matching = next((i for i, (a, b) in enumerate(zip(result.tokens, expected)) if a != b), len(expected))
    print(f"bf16: speculative output matches target-only decoding for {matching} of {len(expected)} tokens")
    record_property("bf16_matching_tokens", matching)
    assert len(result.tokens) == len(expected)
