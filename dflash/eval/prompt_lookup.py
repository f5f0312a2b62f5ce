"""Prompt-lookup (n-gram) drafting: the baseline beside the DFlash drafter.

The last n committed tokens (n from `max_ngram` down to `min_ngram`) are searched for earlier in
the sequence (prompt and output so far), most recent occurrence first; the tokens that followed
that occurrence are the draft. No match: no draft (the step then commits the target's token alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from dflash.eval.specdec import Proposal

if TYPE_CHECKING:
    import torch


@dataclass
class PromptLookupDrafter:
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "prompt_lookup"
    uses_features: bool = False

    def reset(self) -> None:
        pass

    def propose(self, committed: Sequence[int], features: Optional[torch.Tensor], k: int,
                temperature: float) -> Proposal:
        return Proposal(tokens=lookup_continuation(committed, k, self.max_ngram, self.min_ngram))


def lookup_continuation(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
    tokens = list(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
