"""Fixtures for the eval tests: tiny random targets loaded once, and test drafters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pytest

from dflash.eval.specdec import Proposal


@pytest.fixture(scope="session")
def tiny_qwen3_model(tiny_qwen3_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()


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


@dataclass
class OracleDrafter:
    """Proposes the target's own greedy continuation (`reference`), optionally corrupting some
    slots: `wrong_every=n` makes every n-th draft slot wrong; 1 makes every draft wrong."""

    reference: list[int]
    prompt_len: int
    vocab: int
    wrong_every: int = 0
    name: str = "oracle"
    uses_features: bool = False

    def reset(self) -> None:
        pass

    def propose(self, committed: Sequence[int], features, k: int, temperature: float) -> Proposal:
        done = len(committed) - self.prompt_len
        tokens = list(self.reference[done:done + k])
        for slot in range(len(tokens)):
            if self.wrong_every and (done + slot) % self.wrong_every == 0:
                tokens[slot] = (tokens[slot] + 1) % self.vocab
        return Proposal(tokens=tokens)


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Tiny models run fastest on one thread; extra threads spin and stall on a busy machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
