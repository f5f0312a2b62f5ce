"""The flagship twin itself, and what speculative decoding needs from a hybrid target: the
linear-attention state restored exactly after a rejection, on every supported transformers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.eval.oracle import OracleDrafter
from dflash.eval.specdec import ROLLBACKS, DecodeSettings, TargetVerifier, speculative_decode

PROMPT = [785, 6722, 315, 9625, 374, 12095, 13, 785]


def reference(model, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding without any cache (the whole sequence every token), on one thread."""
    ids, threads = list(prompt), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for _ in range(count):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    finally:
        torch.set_num_threads(threads)
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def expected(twin_model) -> list[int]:
    return reference(twin_model, PROMPT, 20)


def test_twin_has_the_flagship_architecture(flagship_twin_target, twin_model):
    from safetensors import safe_open

    config = json.loads((flagship_twin_target / "config.json").read_text(encoding="utf-8"))
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert text["full_attention_interval"] == 4 and text["attn_output_gate"] and text["mtp_num_hidden_layers"] == 1
    assert text["num_attention_heads"] // text["num_key_value_heads"] == 24 // 4
    rope = text["rope_parameters"]
    assert rope["partial_rotary_factor"] == 0.25 and rope["rope_theta"] == 1e7 and rope["mrope_interleaved"]
    assert sum(rope["mrope_section"]) * 2 == text["head_dim"] * rope["partial_rotary_factor"]
    with safe_open(str(flagship_twin_target / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("mtp.layers.0.") for n in names)
    assert type(twin_model).__name__ == "Qwen3_5ForCausalLM"          # text only: no vision tower, no MTP
    assert not any("visual" in n or n.startswith("mtp") for n, _ in twin_model.named_parameters())
    assert twin_model.get_input_embeddings().num_embeddings == 248320 > 248070


def test_load_target_places_weights_through_device_map(flagship_twin_target, monkeypatch):
    """Straight onto the device: `device_map`, never `from_pretrained(...).to(device)`; every
    weight in the asked dtype (transformers 5.6 drops `dtype` for a composite checkpoint unless
    the config is passed)."""
    from transformers import AutoModelForCausalLM

    from dflash.drafter.taps import extract_taps
    from dflash.target_model import load_target

    calls = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    model = load_target(flagship_twin_target, device="cpu", dtype="bfloat16", keep_layers=4)
    assert calls[0]["device_map"] == "cpu" and calls[0]["dtype"] == torch.bfloat16
    assert len(model.model.layers) == 4 and not model.training
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    text = calls[0]["config"].text_config          # cut before loading: the layers past 4 are never read
    assert text.num_hidden_layers == 4 and text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    whole = load_target(flagship_twin_target, device="cpu", dtype="bfloat16")
    assert len(whole.model.layers) == 8
    ids = torch.tensor([[11, 12, 13, 14, 15, 16]])
    assert torch.equal(extract_taps(model, ids, [1, 3]), extract_taps(whole, ids, [1, 3]))


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_every_rollback_mode_is_lossless(twin_model, expected, rollback):
    settings = DecodeSettings(block_size=6, max_new_tokens=20)
    for wrong_every in (1, 2, 5):
        drafter = OracleDrafter(expected, len(PROMPT), twin_model.config.vocab_size, wrong_every=wrong_every)
        result = speculative_decode(TargetVerifier(twin_model, rollback=rollback), drafter, PROMPT, settings)
        assert result.tokens == expected, (rollback, wrong_every)


def test_cropping_without_restoring_the_linear_state_is_not_lossless(twin_model, expected, monkeypatch):
    """What the library's crop does (5.6 keeps the state, 5.24 raises): the test above has teeth."""
    import dflash.eval.target_cache as target_cache

    monkeypatch.setattr(target_cache, "restore_linear_state", lambda snapshot: None)
    drafter = OracleDrafter(expected, len(PROMPT), twin_model.config.vocab_size, wrong_every=2)
    result = speculative_decode(TargetVerifier(twin_model), drafter, PROMPT, DecodeSettings(6, 20))
    assert result.tokens != expected


def test_restore_puts_back_every_linear_state_bit_for_bit(twin_model):
    from dflash.eval.target_cache import linear_state_slots

    verifier = TargetVerifier(twin_model)
    verifier.reset()
    verifier.forward(PROMPT)
    before = [slot.get().clone() for slot in linear_state_slots(verifier.cache)]
    assert len(before) == 2 * 6                   # a conv and a recurrent state per Gated DeltaNet layer
    verifier.forward([11, 12, 13])
    assert not all(torch.equal(a, slot.get()) for a, slot in zip(before, linear_state_slots(verifier.cache)))
    verifier.rollback(len(PROMPT))
    assert all(torch.equal(a, slot.get()) for a, slot in zip(before, linear_state_slots(verifier.cache)))


def test_token_by_token_linear_layers_are_lossless_too(twin_model, expected):
    """The path transformers 5.3-5.6 need (their multi-token cached forward restarts the linear
    state), forced on here so it is tested under every version."""
    verifier = TargetVerifier(twin_model)
    verifier.sequential_linear = True
    drafter = OracleDrafter(expected, len(PROMPT), twin_model.config.vocab_size, wrong_every=3)
    result = speculative_decode(verifier, drafter, PROMPT, DecodeSettings(6, 20))
    assert result.tokens == expected
    assert all("forward" not in module.__dict__ for module in twin_model.model.layers[0].children())


def test_the_accepted_tokens_fed_again_do_not_pile_up(twin_model, expected):
    """"snapshot": after a rejection the next verify forward is [anchor, accepted..., new block]
    and the state is kept right before the new block, so what is fed again never exceeds a block
    (a snapshot taken before the whole forward would re-feed every earlier step's tokens)."""
    verifier = TargetVerifier(twin_model)
    fed: list[int] = []
    original = verifier._run
    verifier._run = lambda tokens, taps: fed.append(len(tokens)) or original(tokens, taps)
    drafter = OracleDrafter(expected, len(PROMPT), twin_model.config.vocab_size, wrong_every=3)
    result = speculative_decode(verifier, drafter, PROMPT, DecodeSettings(6, 20))
    assert result.tokens == expected
    assert fed[0] == len(PROMPT) and max(fed[1:]) <= 6 + 3       # a block + at most the accepted tokens + anchor


def test_the_verifier_uses_the_cache_keyword_of_the_installed_transformers(twin_model, tiny_qwen3_model):
    import inspect

    from dflash.compat import transformers_version, version_tuple

    for model in (twin_model, tiny_qwen3_model):
        keyword = TargetVerifier(model).cache_keyword
        assert keyword in inspect.signature(model.forward).parameters
        assert keyword == ("cache" if version_tuple(transformers_version()) >= (5, 24, 0) else "past_key_values")


def test_an_unsupported_transformers_is_refused_naming_it():
    from dflash.compat import check_transformers, linear_state_continues
    from launcher_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"transformers 4\.57\.1 is not supported.*>= 5\.3\.0"):
        check_transformers("4.57.1")
    assert check_transformers("5.3.0") == "5.3.0"
    assert not linear_state_continues("5.6.0") and linear_state_continues("5.7.0") and linear_state_continues("5.24.0")


@pytest.mark.parametrize("keep_layers", [None, 2])
def test_a_target_missing_weights_is_refused_naming_them(tmp_path, tiny_qwen3_target, capsys, keep_layers):
    """A weight the target's files lack would train and evaluate at its random init: load_target refuses the
    model and names it (whole or its first layers). With keep_layers the layers not kept are not reported
    as unexpected (transformers' own report, which would list them, is silenced)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash.target_model import load_target
    from launcher_core.errors import InputError

    assert len(load_target(tiny_qwen3_target, keep_layers=keep_layers).model.layers) == (keep_layers or 4)
    assert "unexpected" not in capsys.readouterr().err
    damaged = Path(shutil.copytree(tiny_qwen3_target, tmp_path / "target"))
    tensors = load_file(str(damaged / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError) as refused:
        load_target(damaged, keep_layers=keep_layers)
    assert str(refused.value).startswith(f"{damaged}: 1 target weight(s) missing from its *.safetensors files: "
                                         "model.layers.0.mlp.up_proj.weight;")
