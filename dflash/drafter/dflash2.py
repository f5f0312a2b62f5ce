"""The DFlash 2 drafter (`DFlash2DraftModel`, `drafter.kind = "dflash2"`): the DFlash drafter of
dflash.drafter.network plus a grouped dynamic causal convolution around every attention and MLP
sublayer and a candidate selector that picks each slot's token among the target head's top K,
both configured from the checkpoint's `dflash_config`.

Both parts start as the identity (tap 0 = 1, the kernel projection and the successor codebook
zero), so a fresh DFlash 2 drafter computes what its DFlash backbone computes and walks the unary
argmax. The convolution is causal inside a block (a tap before the block's first slot reads zero),
so block b never sees block b - 1 in a training forward. Tensor and config names are PyPI `dflash`
0.1.0's, which vLLM and SGLang (>= 0.5.19) load as they are. Formulas, defaults and names:
docs/drafter.md "DFlash 2".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from dflash.drafter.network import ARCHITECTURE, DFlashDrafter, DraftDecoderLayer

if TYPE_CHECKING:
    from dflash.drafter.attention import Attend
    from launcher_core.schema import DrafterSection

ARCHITECTURE2 = "DFlash2DraftModel"
CONV_KEYS = ("conv_kernel_size", "conv_group_size")
SELECTOR_KEYS = ("selector_rank", "selector_top_k")
INIT_STD = 0.02          # initializer_range of the Qwen3 configs; SpecForge's selector init


@dataclass(frozen=True)
class DFlash2Options:
    """The DFlash 2 keys of `dflash_config` (launcher_core.schema.DFLASH2_DEFAULTS: the published values)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0     # 0: none

    def config_keys(self) -> dict[str, Any]:
        """As written into dflash_config (no softcap key without a softcap, as the published configs)."""
        keys: dict[str, Any] = {"conv_kernel_size": int(self.conv_kernel_size), "conv_group_size": int(self.conv_group_size),
                                "selector_rank": int(self.selector_rank), "selector_top_k": int(self.selector_top_k),
                                "output_multiplier": float(self.output_multiplier)}
        if self.final_logit_softcapping > 0:
            keys["final_logit_softcapping"] = float(self.final_logit_softcapping)
        return keys

    @classmethod
    def of_config(cls, dflash_config: Mapping[str, Any]) -> "DFlash2Options":
        softcap = dflash_config.get("final_logit_softcapping")
        return cls(conv_kernel_size=int(dflash_config["conv_kernel_size"]),
                   conv_group_size=int(dflash_config["conv_group_size"]),
                   selector_rank=int(dflash_config["selector_rank"]), selector_top_k=int(dflash_config["selector_top_k"]),
                   output_multiplier=float(dflash_config.get("output_multiplier", 1.0)),
                   final_logit_softcapping=float(softcap or 0.0))


def profile_dflash2_options(section: DrafterSection) -> Optional[DFlash2Options]:
    """The profile's DFlash 2 keys; None for drafter.kind = "dflash"."""
    if section.kind != "dflash2":
        return None
    return DFlash2Options(conv_kernel_size=section.conv_kernel_size, conv_group_size=section.conv_group_size,
                          selector_rank=section.selector_rank, selector_top_k=section.selector_top_k,
                          output_multiplier=section.output_multiplier,
                          final_logit_softcapping=section.final_logit_softcapping)


def with_dflash2(config: Qwen3Config, options: Optional[DFlash2Options]) -> Qwen3Config:
    """`config` (drafter_config's) made a DFlash 2 config: architecture and dflash_config keys (None: unchanged)."""
    if options is None:
        return config
    config.architectures = [ARCHITECTURE2]
    config.dflash_config = {**config.dflash_config, **options.config_keys()}
    return config


def is_dflash2_config(config: Qwen3Config | Mapping[str, Any]) -> bool:
    architectures = config.get("architectures") if isinstance(config, Mapping) else getattr(config, "architectures", None)
    return ARCHITECTURE2 in (architectures or [])


def drafter_for_config(config: Qwen3Config) -> DFlashDrafter:
    """The drafter a config describes: DFlash 2 for DFlash2DraftModel, else DFlash."""
    if is_dflash2_config(config):
        return DFlash2Drafter(config)
    assert ARCHITECTURE in (config.architectures or [ARCHITECTURE]), "checkpoint._check_supported holds it"
    return DFlashDrafter(config)


# --- the grouped dynamic causal convolution ------------------------------------------------------

def grouped_causal_conv(hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int,
                        block_size: int) -> torch.Tensor:
    """hidden [..., T, H] (T = blocks x block_size, block after block), delta [..., T, k, H / g],
    base [k, H] -> [..., T, H]: out[t, c] = sum_j (base[j, c] + delta[t, j, c // g]) x[t - j, c], with
    x[t - j] = 0 when t - j falls before t's block."""
    *lead, length, width = hidden.shape
    if length % block_size:
        raise ValueError(f"the grouped causal convolution runs over whole blocks: {length} positions are not "
                         f"blocks of {block_size} (draft the whole block, DFlashDrafter.whole_blocks)")
    taps, groups = base.shape[0], width // group_size
    blocks = hidden.reshape(*lead, length // block_size, block_size, groups, group_size)
    deltas = delta.reshape(*lead, length // block_size, block_size, taps, groups, 1)
    out = torch.zeros_like(blocks)
    for tap in range(min(taps, block_size)):
        shifted = blocks if tap == 0 else F.pad(blocks[..., : block_size - tap, :, :], (0, 0, 0, 0, tap, 0))
        coefficient = base[tap].view(groups, group_size).to(hidden.dtype) + deltas[..., tap, :, :]
        out = out + coefficient * shifted
    return out.reshape(hidden.shape)


class GroupedDynamicCausalConv(nn.Module):
    """One sublayer's convolutions: `prepare` (its input) and `finish` (its output), one projection."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        assert hidden_size % group_size == 0, "the launch checks hold conv_group_size | hidden_size"
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Both sides x -> x: tap 0 one, the other taps and the dynamic projection zero."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _convolve(self, hidden: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """Under autograd the products are recomputed in backward (checkpointed): only the inputs are
        kept, not one [T, H] coefficient and one shifted copy per tap."""
        args = (hidden, delta, self.base_kernel[side], self.group_size, self.block_size)
        if torch.is_grad_enabled() and (hidden.requires_grad or delta.requires_grad):
            from torch.utils.checkpoint import checkpoint

            return cast(torch.Tensor, checkpoint(grouped_causal_conv, *args, use_reentrant=False))
        return grouped_causal_conv(*args)

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved, and the output side's dynamic kernel [..., T, k, groups]."""
        delta = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(hidden, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(hidden, delta, 1)


class DFlash2DecoderLayer(DraftDecoderLayer):
    """The DFlash layer with both sublayers wrapped: norm -> conv.prepare -> sublayer -> conv.finish -> residual."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        options = DFlash2Options.of_config(config.dflash_config)
        conv = (config.hidden_size, options.conv_kernel_size, options.conv_group_size, int(config.block_size))
        self.attention_conv = GroupedDynamicCausalConv(*conv)
        self.mlp_conv = GroupedDynamicCausalConv(*conv)

    def _forward(self, hidden: torch.Tensor, context: Optional[torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 attend: Attend, context_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """(DraftDecoderLayer.forward calls this, or recomputes it in the backward: activation checkpointing.)"""
        normed, delta = self.attention_conv.prepare(self.input_layernorm(hidden))
        hidden = hidden + self.attention_conv.finish(self.self_attn(normed, context, rope, attend, context_kv), delta)
        normed, delta = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(normed), delta)


# --- the candidate selector ------------------------------------------------------------------------

@dataclass
class SelectorWalk:
    """One block's walk: the drafted tokens [P], the candidates [P, K] (best unary first), the walked
    candidate index per slot [P], and q [P, K] over the candidates (sampled walks; None when greedy)."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    picked: torch.Tensor
    q: Optional[torch.Tensor] = None


class CandidateSelector(nn.Module):
    """Rank-r transition scores between adjacent slots' candidates (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        with torch.no_grad():
            self.predecessor_codebook.normal_(std=INIT_STD)
            self.hidden_projection.weight.normal_(std=INIT_STD)

    def forward(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], predecessor ids [...], candidate ids [..., K] -> <A[p] * P h, B[c]> [..., K].
        The training loss calls the module (not a method), so a wrapper's hooks (FSDP2's unsharding,
        when the selector is its own `fully_shard` unit) run around it. einsum returns a view of its
        batched product; FSDP2 warns on a unit returning a view (an in-place op on it would skip the
        pre-backward hook), so the [..., K] scores are returned as a tensor of their own."""
        context = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden)
        successors = F.embedding(candidates, self.successor_codebook)
        scores = torch.einsum("...r,...kr->...k", context.to(successors.dtype), successors)
        return scores.clone()

    def transitions(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self(hidden, predecessors, candidates))

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, predecessors: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """Edge scores [..., K]: the candidates' unary logits [..., K] plus their transitions."""
        return unary + self.transitions(hidden, predecessors, candidates).to(unary.dtype)

    @torch.no_grad()
    def walk(self, unary_logits: torch.Tensor, hidden: torch.Tensor, anchor_id: int, temperature: float = 0.0,
             generator: Optional[torch.Generator] = None) -> SelectorWalk:
        """One block's path from the verified anchor: unary logits [P, V], hidden [P, H] of slots 1..P."""
        values, candidates = torch.topk(unary_logits, self.top_k, dim=-1)
        predecessor = torch.tensor(anchor_id, device=candidates.device)
        tokens, picked, q_rows = [], [], []
        for slot in range(candidates.shape[0]):
            scores = self.scores(values[slot], hidden[slot], predecessor, candidates[slot]).float()
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = inverse_cdf(q, torch.rand((), generator=generator, device=q.device))
                q_rows.append(q)
            else:
                index = torch.argmax(scores)
            predecessor = candidates[slot, index]
            tokens.append(predecessor)
            picked.append(index)
        assert tokens, "a block drafts at least one slot"
        return SelectorWalk(torch.stack(tokens), candidates, torch.stack(picked), torch.stack(q_rows) if q_rows else None)


def inverse_cdf(q: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index i whose cumulative mass q[0] + ... + q[i] first exceeds `uniform` (in [0, 1))."""
    return (torch.cumsum(q, dim=-1) <= uniform).sum().clamp(max=q.shape[-1] - 1)


class DFlash2Drafter(DFlashDrafter):
    """DFlashDrafter with DFlash2DecoderLayers, the selector, and the unary logit transform. The selector
    runs after the forward (in the loss, in the walk), on the normed hidden states the forward returns."""

    outside_forward = ("candidate_selector.",)
    whole_blocks = True

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        assert not self.has_draft_vocab, "the profile schema and the checkpoint reader refuse a DFlash 2 draft vocabulary"
        self.options = DFlash2Options.of_config(config.dflash_config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, self.options.selector_rank,
                                                    self.options.selector_top_k)

    def make_layer(self, config: Qwen3Config) -> DraftDecoderLayer:
        return DFlash2DecoderLayer(config)

    @property
    def selector(self) -> CandidateSelector:
        return cast(CandidateSelector, self.candidate_selector)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The unary logits [..., V] (float32): head x output_multiplier, then the tanh softcap if set."""
        logits = super().logits(hidden).float()
        if self.options.output_multiplier != 1.0:
            logits = logits * self.options.output_multiplier
        cap = self.options.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def reset_dflash2_parts(self) -> None:
        """The convolutions back to the identity, the successor codebook to zero: with a DFlash backbone
        loaded, the drafter then drafts exactly what that DFlash drafter drafts."""
        for layer in self.layers:
            cast(DFlash2DecoderLayer, layer).attention_conv.reset_to_identity()
            cast(DFlash2DecoderLayer, layer).mlp_conv.reset_to_identity()
        with torch.no_grad():
            self.selector.successor_codebook.zero_()


def dflash2_parameter_names(drafter: DFlashDrafter) -> list[str]:
    """The parameters DFlash 2 adds to the DFlash drafter (convolutions, selector)."""
    return [name for name, _ in drafter.named_parameters()
            if name.startswith("candidate_selector.") or "_conv." in name]
