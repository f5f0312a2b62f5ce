"""The trained DFlash drafter behind the `Drafter` protocol.

Each step: context = the target's tap features of every committed position before the anchor
(extended by the decoding loop after each verify forward), block = `[anchor, MASK x (B-1)]` at
positions anchor..anchor+B-1; rows 1..B-1 of the drafter's logits are the draft tokens.

With `use_cache` (the default) the drafter keeps each layer's context K/V
(`dflash.drafter.draft_cache`) and projects only the positions committed since the last step,
instead of the whole context every step; the drafts are the same (benchmarks/bench_draft_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, cast

from dflash.eval.specdec import Proposal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from dflash.drafter.draft_cache import DraftContextCache
    from dflash.drafter.model import DFlashDrafter


@dataclass
class DFlashDraft:
    model: DFlashDrafter           # attached to the target
    name: str = "dflash"
    uses_features: bool = True
    generator: Optional["torch.Generator"] = None   # for sampled drafts (temperature > 0)
    use_cache: bool = True                          # keep the context K/V per draft layer between steps
    _cache: Optional[DraftContextCache] = None

    @property
    def block_size(self) -> int:
        return int(self.model.block_size)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.model.target_layer_ids)

    def reset(self) -> None:
        self._cache = None

    def _block_logits(self, features: "torch.Tensor", anchor_id: int) -> "torch.Tensor":
        """Draft logits [B, V] of the block after `features` (the committed positions before the anchor)."""
        import torch

        with torch.no_grad():
            return self.model.logits(self._block_hidden(features, anchor_id))

    def _block_hidden(self, features: "torch.Tensor", anchor_id: int) -> "torch.Tensor":
        """The block's normed hidden states [B, H] (the head's input), with the context cache when used."""
        import torch

        from dflash.drafter.draft_cache import DraftContextCache, extend_cache
        from dflash.drafter.model import draft_hidden_cached

        if not self.use_cache:
            return self.model.draft_hidden(features[None], anchor_id, features.shape[0])
        length = features.shape[0]
        if self._cache is None or not self._cache.crop(length):
            self._cache = DraftContextCache()
        with torch.no_grad():
            extend_cache(self.model, self._cache, features[None, self._cache.length:length])
        return draft_hidden_cached(self.model, self._cache, anchor_id)

    def propose(self, committed: Sequence[int], features: Optional["torch.Tensor"], k: int,
                temperature: float) -> Proposal:
        import torch

        anchor_pos = len(committed) - 1
        assert features is not None and features.shape[0] == anchor_pos, "context features must cover the prefix"
        logits = self._block_logits(features, int(committed[-1]))[1:1 + k].float()
        if temperature <= 0:
            return Proposal(tokens=self.model.token_ids(logits.argmax(dim=-1)).tolist())
        probs = torch.softmax(logits / temperature, dim=-1)
        picked = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return Proposal(tokens=self.model.token_ids(picked).tolist(), probs=self._over_target_vocab(probs))

    def _over_target_vocab(self, probs: "torch.Tensor") -> "torch.Tensor":
        """q over the target's vocabulary: a draft vocabulary's tokens keep their mass, the rest get 0."""
        if not self.model.has_draft_vocab:
            return probs
        import torch

        # nn.Module attributes (a parameter, a buffer) are typed Tensor | Module
        rows = cast("torch.Tensor", self.model.lm_head.weight).shape[0]
        full = torch.zeros(probs.shape[0], rows, dtype=probs.dtype, device=probs.device)
        full[:, cast("torch.Tensor", self.model.draft_vocab)] = probs
        return full


def load_dflash_draft(checkpoint: str, target_model: PreTrainedModel) -> DFlashDraft:
    """The checkpoint's drafter drafting the head's argmax (or samples); a DFlash 2 drafter's selector
    path: dflash.eval.dflash2_drafter.load_draft."""
    from dflash.drafter.checkpoint import load_drafter

    return DFlashDraft(model=load_drafter(checkpoint, target_model))
