"""The trained DFlash drafter behind the `Drafter` protocol.

Each step: context = the target's tap features of every committed position before the anchor
(extended by the decoding loop after each verify forward), block = `[anchor, MASK x (B-1)]` at
positions anchor..anchor+B-1; rows 1..B-1 of the drafter's logits are the draft tokens.

With `use_cache` (the default) the drafter keeps each layer's context K/V
(`dflash.drafter.draft_cache`) and projects only the positions committed since the last step,
instead of the whole context every step; the drafts are the same (benchmarks/bench_draft_cache.py).

`draft_tokens` k (eval.draft_tokens; 0: B - 1) drafts the shorter block `[anchor, MASK x k]` and
proposes its k tokens, as vLLM does with `num_speculative_tokens` k (its DFlash proposer's queries
are the bonus token and k masks): the target then verifies k + 1 tokens a step. On a CPU a verify
forward costs more with every token it takes (benchmarks/bench_step_cost.py) while the drafter's
acceptance is almost all at the first slots, so fewer draft tokens make a step cheaper for about
the same tau.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, cast

from dflash.eval.specdec import Proposal

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from dflash.drafter.draft_cache import DraftContextCache
    from dflash.drafter.network import DFlashDrafter


@dataclass
class DFlashDraft:
    model: DFlashDrafter           # attached to the target
    name: str = "dflash"
    uses_features: bool = True
    generator: Optional["torch.Generator"] = None   # for sampled drafts (temperature > 0)
    use_cache: bool = True                          # keep the context K/V per draft layer between steps
    draft_tokens: int = 0                           # tokens proposed a step (block [anchor, MASK x k]); 0: B - 1
    context_k_norm_layer: Optional[int] = None      # context keys normed with this layer's k_norm in every layer, as
    #                                                 an engine computes them (dflash.eval.engines.EngineDeviation)
    _cache: Optional[DraftContextCache] = None
    _head_rows: Optional["torch.nn.Linear"] = None

    @property
    def block_size(self) -> int:
        return int(self.model.block_size)

    @property
    def proposed(self) -> int:
        """Draft tokens a step proposes: draft_tokens, at most (and by default) B - 1."""
        return min(self.draft_tokens or self.block_size - 1, self.block_size - 1)

    @property
    def drafted_length(self) -> int:
        """Tokens of the block the drafter runs: `[anchor, MASK x proposed]`; a drafter whose forward
        needs whole blocks (DFlash 2's convolutions) drafts the whole block and proposes its first
        `proposed` tokens."""
        return self.block_size if self.model.whole_blocks else self.proposed + 1

    @property
    def layer_ids(self) -> list[int]:
        return list(self.model.target_layer_ids)

    def reset(self) -> None:
        self._cache = None

    def _block_hidden(self, features: "torch.Tensor", anchor_id: int) -> "torch.Tensor":
        """The block's normed hidden states [`drafted_length`, H] (the head's input) after
        `features` (the committed positions before the anchor), through the context K/V cache
        (extended with the positions it lacks) when `use_cache`."""
        import torch

        from dflash.drafter.draft_cache import DraftContextCache, extend_cache
        from dflash.drafter.network import draft_hidden_cached

        if not self.use_cache:
            if self.context_k_norm_layer is not None:
                raise ValueError("context_k_norm_layer needs the context K/V cache (use_cache)")
            return self.model.draft_hidden(features[None], anchor_id, features.shape[0], self.drafted_length)
        length = features.shape[0]
        if self._cache is None or not self._cache.crop(length):
            self._cache = DraftContextCache()
        with torch.no_grad():
            extend_cache(self.model, self._cache, features[None, self._cache.length:length], self.context_k_norm_layer)
            return draft_hidden_cached(self.model, self._cache, anchor_id, self.drafted_length)

    def _block_logits(self, features: "torch.Tensor", anchor_id: int) -> "torch.Tensor":
        """Draft logits [`drafted_length`, V] of the block after `features` (the committed positions before the anchor)."""
        import torch

        with torch.no_grad():
            return self.model.logits(self._block_hidden(features, anchor_id))

    def _slot_logits(self, features: "torch.Tensor", anchor_id: int, k: int) -> "torch.Tensor":
        """Draft logits [k, V] of block slots 1..k: with the cache only those slots go through the
        head (its draft-vocabulary rows gathered once)."""
        import torch

        if not self.use_cache:
            return self._block_logits(features, anchor_id)[1:1 + k]
        hidden = self._block_hidden(features, anchor_id)[1:1 + k]
        head = self.head()
        with torch.no_grad():
            return cast("torch.Tensor", head(hidden.to(head.weight.dtype)))

    def head(self) -> "torch.nn.Linear":
        """The lm_head's rows the drafter proposes from (its draft vocabulary's, gathered once into
        a frozen Linear of their own: the head is the target's, frozen), with their bias."""
        if self._head_rows is None:
            import torch

            weight = cast("torch.Tensor", self.model.lm_head.weight)
            bias = cast(Optional["torch.Tensor"], getattr(self.model.lm_head, "bias", None))
            if self.model.has_draft_vocab:
                rows = cast("torch.Tensor", self.model.draft_vocab)
                weight, bias = weight[rows], None if bias is None else bias[rows]
            head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                   device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                head.weight.copy_(weight)
                if bias is not None:
                    head.bias.copy_(bias)
            self._head_rows = head.requires_grad_(False)
        return self._head_rows

    def propose(self, committed: Sequence[int], features: Optional["torch.Tensor"], k: int,
                temperature: float) -> Proposal:
        import torch

        anchor_pos = len(committed) - 1
        assert features is not None and features.shape[0] == anchor_pos, "context features must cover the prefix"
        logits = self._slot_logits(features, int(committed[-1]), min(k, self.proposed)).float()
        if temperature <= 0:
            vocab = cast("torch.Tensor", self.model.draft_vocab) if self.model.has_draft_vocab else None
            return Proposal(tokens=self.model.token_ids(logits.argmax(dim=-1)).tolist(), logits=logits, vocab=vocab)
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


def load_dflash_draft(checkpoint: str, target_model: PreTrainedModel, draft_tokens: int = 0) -> DFlashDraft:
    """The checkpoint's drafter drafting the head's argmax (or samples), `draft_tokens` a step; a
    DFlash 2 drafter's selector path: dflash.eval.dflash2_drafter.load_draft."""
    from dflash.drafter.checkpoint_files import load_drafter

    return DFlashDraft(model=load_drafter(checkpoint, target_model), draft_tokens=draft_tokens)
