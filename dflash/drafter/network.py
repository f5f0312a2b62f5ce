"""The DFlash drafter: L Qwen3-style decoder layers conditioned on the target's tap features.

* Context: the target's hidden states at the tap layers, concatenated -> fc (L*H -> H, no bias)
  -> RMSNorm (`hidden_norm`).
* KV injection: in every layer the queries come from the block tokens only; keys and values are
  projected (same k/v projections, k RMSNorm) from concat(context, block tokens).
* The block `[anchor, MASK x (B-1)]` is embedded with the target's frozen embedding; the output
  goes through the final `norm` and the target's frozen lm_head. Slot k predicts anchor + k.
* Optional draft vocabulary (`drafter.draft_vocab_size`, as EAGLE-3's reduced draft vocabulary):
  only the lm_head rows of the N most frequent training tokens are used, so the drafter proposes
  those tokens only and its logits cost N/V of the full head. The ids are a buffer, `draft_vocab`,
  saved with the weights.

Parameter names follow the reference drafter (`layers.N.self_attn.q_proj`, `fc`, `hidden_norm`,
`norm`), so `model.safetensors` + `config.json` load where the reference format is expected.
The target's embedding and lm_head are attached, not registered: they never train, never go to
the optimizer or FSDP2, and never into the checkpoint.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.drafter.attention import Attend, Backend, BlockLayout, make_layer_attends, position_rule_mask
from dflash.drafter.layers import config_layer_keys, layer_attention
from dflash.drafter.shape import DrafterShape, derive_shape
from launcher_core.layer_attention import LayerAttention

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from dflash.drafter.attention import Backend
    from dflash.drafter.draft_cache import DraftContextCache

ARCHITECTURE = "DFlashDraftModel"
# What makes the training forward's per-layer attention: `make_layer_attends` (flex or SDPA under
# the block mask); the memory trace passes its own (flex's memory on CPU, dflash.measure.fake).
LayerAttendsFactory = Callable[[BlockLayout, Backend, "list[LayerAttention]"], "list[Attend]"]


def drafter_config(target_config: PretrainedConfig, *, num_layers: int, block_size: int,
                   target_layer_ids: Sequence[int], mask_token_id: int, draft_vocab_size: int = 0,
                   shape: DrafterShape = DrafterShape(), layer_types: Sequence[str] = (), sliding_window: int = 0,
                   rope_scaling: Optional[Mapping[str, Any]] = None) -> Qwen3Config:
    """The drafter's config (reference format): the target's hidden size, vocabulary and MLP width,
    the drafter's own attention shape and RoPE (`shape`, derived from the target where 0; scaled by
    `rope_scaling`, e.g. {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    L layers of `layer_types` (empty: all full attention; `sliding_window` for the sliding ones,
    `dflash.drafter.layers`), DFlash keys."""
    own = derive_shape(target_config, shape)
    rope = {"rope_type": "default", **dict(rope_scaling or {}), "rope_theta": own.rope_theta}
    dflash_keys: dict[str, Any] = {         # config.json values the config keeps as extra attributes
        "block_size": block_size, "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids),
                          "block_size": int(block_size),
                          **({"draft_vocab_size": int(draft_vocab_size)} if draft_vocab_size else {})}}
    return Qwen3Config(
        **config_layer_keys(layer_types, num_layers, sliding_window),
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=own.num_attention_heads, num_key_value_heads=own.num_key_value_heads,
        head_dim=own.head_dim, hidden_act=getattr(target_config, "hidden_act", "silu"),
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=target_config.max_position_embeddings, tie_word_embeddings=False,
        architectures=[ARCHITECTURE], **dflash_keys,
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]; cos/sin [b, T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        assert config.head_dim is not None and config.num_key_value_heads is not None, "drafter_config sets both"
        self.head_dim: int = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, int(config.num_key_value_heads)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        return x.view(*x.shape[:2], count, self.head_dim)

    def project_kv(self, keys_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_norm: Optional[nn.Module] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """keys_in [b, K, H] -> keys (k_norm, RoPE at cos/sin [b, K, d]) and values, [b, kv heads, K, d];
        `k_norm` another layer's key norm in place of this layer's (an engine's way, dflash.eval.engines)."""
        k = (k_norm or self.k_norm)(self._heads(self.k_proj(keys_in), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(keys_in), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, block: torch.Tensor, context: Optional[torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                attend: Attend, context_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """block [b, Q, H] (normed), context [b, C, H]; rope covers the C + Q key positions. With
        `context_kv` (the context's keys and values, cached) context is None and rope covers the block."""
        cos, sin = rope
        queries = block.shape[1]
        keys_in = block if context is None else torch.cat([context, block], dim=1)
        q = self.q_norm(self._heads(self.q_proj(block), self.num_heads)).transpose(1, 2)
        k, v = self.project_kv(keys_in, cos, sin)
        if context_kv is not None:
            k, v = torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2)
        q = apply_rope(q, cos[:, -queries:], sin[:, -queries:]).to(v.dtype)   # norms and RoPE give fp32 under autocast
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(*block.shape[:2], -1))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, context: Optional[torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                attend: Attend, context_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                recompute: bool = False) -> torch.Tensor:
        """`recompute`: keep only this layer's inputs for backward and run it again there (activation
        checkpointing, non-reentrant; inside the layer's own call, so under FSDP2 the recomputation
        runs while the layer's gathered weights are there for its backward)."""
        if recompute:
            from torch.utils.checkpoint import checkpoint

            return cast(torch.Tensor, checkpoint(self._forward, hidden, context, rope, attend, context_kv,
                                                 use_reentrant=False))
        return self._forward(hidden, context, rope, attend, context_kv)

    def _forward(self, hidden: torch.Tensor, context: Optional[torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 attend: Attend, context_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope, attend, context_kv)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """Trainable: layers, fc, hidden_norm, norm. Attached (frozen): the target's embedding, lm_head."""

    draft_vocab: torch.Tensor           # a buffer, registered only with a draft vocabulary
    outside_forward: tuple[str, ...] = ()   # parameter-name prefixes the forward never reads (DFlash 2: the selector)
    whole_blocks: bool = False              # the forward needs whole blocks of block_size (DFlash 2's convolutions)

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        hidden = config.hidden_size
        self.layers = nn.ModuleList(self.make_layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.layer_rules: list[LayerAttention] = layer_attention(config)
        self._frozen: tuple[nn.Embedding, nn.Linear] | None = None
        self.checkpoint_layers = False      # train.activation_checkpointing = "layers": recompute each layer in backward
        vocab_size = int(config.dflash_config.get("draft_vocab_size", 0) or 0)
        if vocab_size:      # the target token id of each draft row (saved with the weights)
            self.register_buffer("draft_vocab", torch.zeros(vocab_size, dtype=torch.long))

    def make_layer(self, config: Qwen3Config) -> DraftDecoderLayer:
        """One draft layer (DFlash 2 wraps its sublayers in convolutions: dflash.drafter.dflash2)."""
        return DraftDecoderLayer(config)

    def attach_target(self, target: PreTrainedModel) -> "DFlashDrafter":
        """Use the target's embedding and lm_head (frozen, not registered here). The mask token is
        a row of that embedding (the launch checks refuse a profile where it is not)."""
        embed = cast(nn.Embedding, target.get_input_embeddings())
        lm_head = cast(nn.Linear, target.get_output_embeddings())
        assert 0 <= self.mask_token_id < embed.num_embeddings, "the mask token is a row of the target's embedding"
        for parameter in (*embed.parameters(), *lm_head.parameters()):
            parameter.requires_grad_(False)
        self._frozen = (embed, lm_head)
        return self

    @property
    def embed_tokens(self) -> nn.Embedding:
        assert self._frozen is not None, "call attach_target(target) first"
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Linear:
        assert self._frozen is not None, "call attach_target(target) first"
        return self._frozen[1]

    def block_input_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[..., N] anchor tokens -> [..., N, B] blocks `[anchor, MASK x (B-1)]`."""
        blocks = torch.full((*anchor_ids.shape, self.block_size), self.mask_token_id,
                            dtype=anchor_ids.dtype, device=anchor_ids.device)
        blocks[..., 0] = anchor_ids
        return blocks

    @property
    def decoder_layers(self) -> list[DraftDecoderLayer]:
        """The draft layers, typed (an nn.ModuleList yields plain modules)."""
        return [cast(DraftDecoderLayer, layer) for layer in self.layers]

    def forward(self, block_ids: torch.Tensor, context_features: torch.Tensor,
                key_positions: torch.Tensor, attend: Union[Attend, Sequence[Attend]]) -> torch.Tensor:
        """block_ids [b, Q], context_features [b, C, L*H], key positions [b, C+Q] -> normed hidden [b, Q, H].
        `attend`: one function for every layer, or one per layer (`layer_rules`)."""
        dtype = self.fc.weight.dtype
        hidden = self.embed_tokens(block_ids).to(dtype)
        context = self.project_context(context_features)
        rope = self.rotary_emb(hidden, key_positions)
        attends = list(attend) if isinstance(attend, (list, tuple)) else [attend] * len(self.layers)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer, layer_attend in zip(self.decoder_layers, attends):
            hidden = layer(hidden, context, rope, layer_attend, recompute=recompute)
        return self.norm(hidden)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """Tap features [b, C, L*H] -> the context every layer's keys and values come from, [b, C, H]."""
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    @property
    def has_draft_vocab(self) -> bool:
        return hasattr(self, "draft_vocab")

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Rows of the (frozen) lm_head the drafter may propose: `drafter.draft_vocab_size` ids."""
        if not self.has_draft_vocab or token_ids.shape != self.draft_vocab.shape:
            raise ValueError(f"the drafter was built for a draft vocabulary of "
                             f"{self.draft_vocab.numel() if self.has_draft_vocab else 0} tokens, got {tuple(token_ids.shape)}")
        self.draft_vocab.copy_(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] over the target's vocabulary, or [..., N] over the draft vocabulary."""
        weight = self.lm_head.weight
        if not self.has_draft_vocab:
            return self.lm_head(hidden.to(weight.dtype))
        bias = getattr(self.lm_head, "bias", None)
        rows = self.draft_vocab
        return F.linear(hidden.to(weight.dtype), weight[rows], None if bias is None else bias[rows])

    def token_ids(self, logit_index: torch.Tensor) -> torch.Tensor:
        """Column indices of `logits` -> target token ids."""
        return self.draft_vocab[logit_index] if self.has_draft_vocab else logit_index

    def draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target token ids -> (columns of `logits`, inside the draft vocabulary?)."""
        if not self.has_draft_vocab:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        vocab = self.draft_vocab.to(labels.device)
        column = torch.full((self.lm_head.weight.shape[0],), -1, dtype=torch.long, device=labels.device)
        column[vocab] = torch.arange(vocab.numel(), device=labels.device)
        mapped = column[labels]
        return mapped.clamp(min=0), mapped >= 0

    def inference_block(self, anchor_id: int, length: Optional[int] = None) -> torch.Tensor:
        """[1, length] `[anchor, MASK x (length - 1)]` (length: the block size, or fewer: a shorter draft)."""
        length = self.block_size if length is None else length
        block = torch.full((1, length), self.mask_token_id, dtype=torch.long, device=self.fc.weight.device)
        block[0, 0] = anchor_id
        return block

    @torch.no_grad()
    def draft_logits(self, context_features: torch.Tensor, anchor_id: int, anchor_pos: int,
                     length: Optional[int] = None) -> torch.Tensor:
        """One block at positions anchor_pos..anchor_pos+B-1 after C committed positions -> logits [B, V].

        context_features [1, C, L*H] are the target's tap features of positions 0..C-1 (all
        visible). Row k predicts the token at anchor_pos + k; row 0 is the anchor's own slot.
        `length` < B drafts a shorter block (`[anchor, MASK x (length - 1)]`, as an engine asked for
        fewer speculative tokens does).
        """
        return self.logits(self.draft_hidden(context_features, anchor_id, anchor_pos, length))

    @torch.no_grad()
    def draft_hidden(self, context_features: torch.Tensor, anchor_id: int, anchor_pos: int,
                     length: Optional[int] = None) -> torch.Tensor:
        """`draft_logits` before the head: the block's normed hidden states [length or B, H]."""
        device = context_features.device
        block = self.inference_block(anchor_id, length).to(device)      # [1, B]
        context_positions = torch.arange(context_features.shape[1], device=device)
        block_positions = anchor_pos + torch.arange(block.shape[1], device=device)
        key_positions = torch.cat([context_positions, block_positions])[None]
        attends = [_attend_by_rule(block_positions[None], key_positions, rule) for rule in self.layer_rules]
        return cast(torch.Tensor, self(block, context_features, key_positions, attends))[0]


@torch.no_grad()
def draft_logits_cached(drafter: DFlashDrafter, cache: DraftContextCache, anchor_id: int,
                        length: Optional[int] = None) -> torch.Tensor:
    """`draft_logits` from a `draft_cache.DraftContextCache` of the positions before the anchor
    (anchor position = cache.length): only the block's own tokens go through the projections."""
    return drafter.logits(draft_hidden_cached(drafter, cache, anchor_id, length))


@torch.no_grad()
def draft_hidden_cached(drafter: DFlashDrafter, cache: DraftContextCache, anchor_id: int,
                        length: Optional[int] = None) -> torch.Tensor:
    """`draft_logits_cached` before the head: the block's normed hidden states [length or B, H]."""
    device = drafter.fc.weight.device
    block = drafter.inference_block(anchor_id, length)
    block_positions = (cache.length + torch.arange(block.shape[1], device=device))[None]
    hidden = drafter.embed_tokens(block).to(drafter.fc.weight.dtype)
    rope = drafter.rotary_emb(hidden, block_positions)
    for layer, rule, kv in zip(drafter.layers, drafter.layer_rules, cache.layers):
        if rule.restricts:
            key_positions = torch.cat([kv.positions(), block_positions[0]])[None]
            attend = _attend_by_rule(block_positions, key_positions, rule)
        else:
            attend = _attend_all       # every key visible: no positions to compare
        hidden = layer(hidden, None, rope, attend, (kv.keys, kv.values))
    return cast(torch.Tensor, drafter.norm(hidden))[0]


def forward_blocks(model: nn.Module, input_ids: torch.Tensor, anchors: torch.Tensor,
                   context_features: torch.Tensor, backend: Backend,
                   layer_attends: LayerAttendsFactory = make_layer_attends) -> torch.Tensor:
    """Training forward: every block `[anchor, MASK x (B-1)]` of each sequence at once under the
    block mask -> normed hidden [b, N, B, H]. `model` is the drafter (sharded by FSDP2 in training:
    calling it runs FSDP's hooks) or a wrapper around it (reached through `.module`); `layer_attends`
    makes each layer's attention from the layout, the backend and the layers' rules."""
    drafter = cast(DFlashDrafter, getattr(model, "module", model))
    layout = BlockLayout(anchors, input_ids.shape[1], drafter.block_size)
    block_ids = drafter.block_input_ids(torch.gather(input_ids, 1, anchors)).flatten(1)
    attends = layer_attends(layout, backend, drafter.layer_rules)
    hidden = model(block_ids, context_features, layout.key_positions(), attends)
    return hidden.view(*anchors.shape, drafter.block_size, -1)


def _attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def _attend_by_rule(query_positions: torch.Tensor, key_positions: torch.Tensor, rule: LayerAttention) -> Attend:
    """Inference attention of one block: every key visible, unless the layer's rule narrows it."""
    if not rule.restricts:
        return _attend_all
    mask = position_rule_mask(query_positions, key_positions, rule)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def target_source_layers(drafter: DFlashDrafter, num_target_layers: int,
                         target_config: PretrainedConfig | None = None) -> list[int]:
    """The target layers the drafter's layers start from: those right after the deepest tap.

    With `target_config`, every source is a plain softmax-attention layer a draft layer can hold
    (`taps.unholdable_sources`: not the Gated DeltaNet or gated attention layers of a Qwen3.5/3.6
    target; the launch checks refuse drafter.init = "target" otherwise), never a half-copied drafter.
    """
    from dflash.drafter.taps import source_layer_ids, unholdable_sources

    sources = source_layer_ids(drafter.target_layer_ids, len(drafter.layers), num_target_layers)
    assert target_config is None or not unholdable_sources(sources, target_config), \
        "the launch checks hold drafter.init = \"target\""
    return sources


# A tensor's initial value: the tensor, or a function that reads it (a checkpoint's tensors, one at a time).
InitValue = Union[torch.Tensor, Callable[[], torch.Tensor]]


def resolved(value: InitValue) -> torch.Tensor:
    return value() if callable(value) else value


@torch.no_grad()
def assign_values(module: nn.Module, values: Mapping[str, InitValue]) -> None:
    """Copy each named value into the (whole, unsharded) module's parameter or buffer of that name."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    unknown = sorted(set(values) - set(tensors))
    assert not unknown, f"values for tensors the module does not have: {unknown}"
    for name, value in values.items():
        tensors[name].copy_(resolved(value))


def init_from_target(drafter: DFlashDrafter, target: PreTrainedModel, norm_scale: float = 1.0) -> list[int]:
    """Start the (whole) drafter from the target's own weights (`drafter.init = "target"`,
    `target_init_values`); returns the source layers."""
    sources, values = target_init_values(drafter, target, norm_scale)
    assign_values(drafter, values)
    return sources


@torch.no_grad()
def target_init_values(drafter: DFlashDrafter, target: PreTrainedModel,
                       norm_scale: float = 1.0) -> tuple[list[int], dict[str, InitValue]]:
    """The drafter's start from the target's own weights (`drafter.init = "target"`): the source layers
    and the values by the drafter's tensor names (only names and global shapes of the drafter are read:
    it may be on the meta device, sharded).

    Draft layer i copies target layer (deepest tap + 1 + i): every parameter whose name and shape
    match (q/k/v/o, MLP, norms; q_norm/k_norm too where the target has them). fc starts as the mean
    of the tap features, hidden_norm as the first source layer's input norm (so the context's keys
    and values are what that target layer would compute from the deepest tap), and the final norm
    as the target's final norm times `norm_scale`. The target must have its layers up to the last
    source layer loaded (a target loaded up to the deepest tap only is refused), and the source
    layers must be plain softmax attention (`target_source_layers` refuses the others).
    """
    from dflash.drafter.taps import decoder_layers

    target_layers = decoder_layers(target)
    expected = int(drafter.config.num_target_layers)
    sources = target_source_layers(drafter, expected, getattr(target, "config", None))
    if max(sources) >= len(target_layers):
        raise ValueError(f"drafter.init = \"target\" needs the target's layers up to {max(sources)} (the source "
                         f"layers {sources} of its {expected}), the loaded target has {len(target_layers)} "
                         f"(load them, and truncate the target after initialising the drafter)")
    values: dict[str, InitValue] = {}
    for index, (layer, source) in enumerate(zip(drafter.layers, sources)):
        own = {name: tuple(parameter.shape) for name, parameter in layer.named_parameters()}
        matched = {name: value for name, value in target_layers[source].state_dict().items()
                   if name in own and own[name] == tuple(value.shape)}
        if not any(name.startswith("self_attn.") for name in matched):
            raise ValueError(f"drafter.init = \"target\": target layer {source} "
                             f"({type(target_layers[source]).__name__}) has no attention weights named like "
                             f"the drafter's (self_attn.q_proj ...); use drafter.init = \"random\"")
        values.update({f"layers.{index}.{name}": value for name, value in matched.items()})
    hidden, taps, dtype = drafter.config.hidden_size, len(drafter.target_layer_ids), drafter.fc.weight.dtype
    values["fc.weight"] = lambda: (torch.eye(hidden, dtype=dtype) / taps).repeat(1, taps)
    values["hidden_norm.weight"] = getattr(target_layers[sources[0]], "input_layernorm").weight
    final_norm = getattr(getattr(target, "model", target), "norm")
    values["norm.weight"] = final_norm.weight * norm_scale
    return sources, values


def trainable_parameter_names(drafter: DFlashDrafter) -> list[str]:
    return [name for name, parameter in drafter.named_parameters() if parameter.requires_grad]
