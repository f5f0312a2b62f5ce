"""A drafter that knows the answer: the target's own greedy continuation, some slots corrupted.

Used where the decoding loop itself is under test (exact tau, rollback after rejected drafts):
the eval tests and the GPU eval test (tests/gpu/test_eval_gpu.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from dflash.eval.specdec import Proposal

if TYPE_CHECKING:
    import torch


@dataclass
class OracleDrafter:
    """Proposes `reference` (the target's greedy continuation after a prompt of `prompt_len`
    tokens). `wrong_every=n` makes every n-th continuation slot wrong (slots n-1, 2n-1, ...);
    1 makes every draft wrong, 0 none."""

    reference: list[int]
    prompt_len: int
    vocab: int
    wrong_every: int = 0
    name: str = "oracle"
    uses_features: bool = False

    def reset(self) -> None:
        pass

    def propose(self, committed: Sequence[int], features: Optional[torch.Tensor], k: int, temperature: float) -> Proposal:
        done = len(committed) - self.prompt_len
        tokens = list(self.reference[done:done + k])
        for slot in range(len(tokens)):
            if self.wrong_every and (done + slot) % self.wrong_every == self.wrong_every - 1:
                tokens[slot] = (tokens[slot] + 1) % self.vocab
        return Proposal(tokens=tokens)
