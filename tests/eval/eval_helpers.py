"""Fixtures for the eval tests: tiny random targets loaded once."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_model(tiny_qwen3_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()


@pytest.fixture(scope="session")
def twin_model(flagship_twin_target):
    from dflash.target_model import load_target

    return load_target(flagship_twin_target)


def small_vocab_model(vocab: int = 8, hidden: int = 32, layers: int = 2, seed: int = 3):
    """A random Qwen3 with a tiny vocabulary, for distribution tests; scaled for peaked logits."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden // 2, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # random init gives near-uniform logits; make them vary
    return model


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Tiny models run fastest on one thread; extra threads spin and stall on a busy machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
