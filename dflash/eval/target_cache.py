"""The target's cache during speculative decoding: the same operations on every supported
transformers version (`dflash.compat`) and on hybrid targets.

A Qwen3.5/3.6 target mixes full-attention layers (a KV cache, cropped by position) with Gated
DeltaNet linear-attention layers (a recurrent state and a conv state of fixed size, which hold
no positions and cannot be cropped). `snapshot_linear_state` copies those states,
`restore_linear_state` puts them back after a rejection, `crop_attention` crops only the KV of
the attention layers. `linear_attention_plan` lets one forward do two more things inside the
linear layers, while attention and MLP layers still see all fed tokens at once:

* split at a position: each linear layer takes the tokens before it, has its state copied, then
  takes the rest; the verifier feeds the accepted tokens of the previous step in front of the
  next block this way and still gets the state right before the block;
* token by token (transformers 5.3-5.6, whose linear layers restart their state for a cached
  forward of more than one token): their exact single-token path, one token at a time.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, MutableMapping, MutableSequence, Optional, Union, cast

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import Cache


def cache_keyword(model: nn.Module) -> str:
    """The keyword the model's forward takes its cache by: `cache` (transformers 5.24) or
    `past_key_values` (5.3, 5.6; a keyword the forward does not name is silently ignored)."""
    parameters = inspect.signature(model.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                    f"not a supported transformers causal LM")


def output_cache(output: object) -> Optional[Cache]:
    """The cache a forward returned (`output.cache` in 5.24, `output.past_key_values` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


@dataclass(frozen=True)
class _ItemSlot:
    """One state tensor inside a cache's dict (state index -> tensor) or list (over layers)."""

    holder: Union[MutableMapping[int, torch.Tensor], MutableSequence[torch.Tensor]]
    key: int

    def get(self) -> torch.Tensor:
        return self.holder[self.key]

    def set(self, value: torch.Tensor) -> None:
        self.holder[self.key] = value


@dataclass(frozen=True)
class _AttributeSlot:
    """One state tensor held as an attribute of a cache layer (transformers 5.6)."""

    holder: object
    name: str

    def get(self) -> torch.Tensor:
        value: torch.Tensor = getattr(self.holder, self.name)
        return value

    def set(self, value: torch.Tensor) -> None:
        setattr(self.holder, self.name, value)


_Slot = Union[_ItemSlot, _AttributeSlot]


def linear_state_slots(cache: Cache, layer_idx: Optional[int] = None) -> list[_Slot]:
    """Every conv / recurrent state tensor of the cache's linear-attention layers (or of one).

    Layouts: 5.24 `LinearAttentionLayer.conv_states` is a dict (state index -> tensor); 5.6 it is
    a tensor attribute of the layer; 5.3 `Qwen3_5DynamicCache.conv_states` is a list over layers.
    """
    import torch

    layers = getattr(cache, "layers", None)
    if layers is None:
        lists = [getattr(cache, name, None) or [] for name in ("conv_states", "recurrent_states")]
        return [_ItemSlot(states, index) for states in lists for index, value in enumerate(states)
                if isinstance(value, torch.Tensor) and layer_idx in (None, index)]
    slots: list[_Slot] = []
    for index, layer in enumerate(layers):
        if layer_idx not in (None, index):
            continue
        for name in ("conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            if isinstance(value, dict):
                slots += [_ItemSlot(value, key) for key, tensor in value.items() if isinstance(tensor, torch.Tensor)]
            elif isinstance(value, torch.Tensor):
                slots.append(_AttributeSlot(layer, name))
    return slots


LinearSnapshot = list[tuple[_Slot, "torch.Tensor"]]


def snapshot_linear_state(cache: Cache, layer_idx: Optional[int] = None) -> LinearSnapshot:
    """Copies of the linear-attention states (the library updates them in place)."""
    return [(slot, slot.get().clone()) for slot in linear_state_slots(cache, layer_idx)]


def restore_linear_state(snapshot: LinearSnapshot) -> None:
    """Put the states back as they were at the snapshot (in place where the shape is unchanged)."""
    for slot, saved in snapshot:
        current = slot.get()
        if current.shape == saved.shape:
            current.copy_(saved)
        else:
            slot.set(saved)


def crop_attention(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every attention layer's KV; linear layers untouched."""
    layers = getattr(cache, "layers", None)
    if layers is None:   # 5.3 Qwen3_5DynamicCache: lists over layers, no `crop`
        for states in (getattr(cache, "key_cache"), getattr(cache, "value_cache")):
            for index, value in enumerate(states):
                if value is not None and value.dim() == 4 and value.shape[-2] > length:
                    states[index] = value[..., :length, :]
        return
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.dim() != 4 or keys.shape[-2] <= length:
            continue
        layer.crop(length - keys.shape[-2])    # negative: remove that many (5.6 and 5.24 alike)


def linear_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet modules of a loaded target (`layer.linear_attn`)."""
    from dflash.drafter.taps import decoder_layers

    return [cast("nn.Module", layer.linear_attn) for layer in decoder_layers(model) if hasattr(layer, "linear_attn")]


@dataclass
class LinearPlan:
    """What the linear-attention layers do inside one forward (`linear_attention_plan`).

    `split_at` > 0: take tokens [0, split_at) first, copy the layer's state into `saved`, then
    the rest. `token_by_token`: feed a cached multi-token input one token at a time.
    """

    split_at: int = 0
    token_by_token: bool = False
    saved: dict[int, LinearSnapshot] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.split_at > 0 or self.token_by_token

    def snapshot(self) -> LinearSnapshot:
        """The states at the split, every linear layer's, in layer order."""
        return [entry for index in sorted(self.saved) for entry in self.saved[index]]

    def pieces(self, length: int, continues: bool) -> list[tuple[int, int]]:
        if self.token_by_token and continues:
            return [(t, t + 1) for t in range(length)]
        cuts = [0, self.split_at, length] if 0 < self.split_at < length else [0, length]
        return list(zip(cuts, cuts[1:]))


@contextlib.contextmanager
def linear_attention_plan(model: nn.Module, plan: LinearPlan) -> Iterator[LinearPlan]:
    """Run the model's linear-attention layers as `plan` says for the forwards inside this context."""
    modules = linear_attention_modules(model) if plan.active else []
    previous = [module.__dict__.get("forward") for module in modules]
    for module in modules:
        setattr(module, "forward", _planned(module, module.forward, plan))   # an instance attribute shadows the method
    try:
        yield plan
    finally:
        for module, before in zip(modules, previous):
            if before is None:
                delattr(module, "forward")
            else:
                setattr(module, "forward", before)


def _planned(module: nn.Module, original: Callable[..., torch.Tensor], plan: LinearPlan) -> Callable[..., torch.Tensor]:
    import torch

    layer_idx = int(getattr(module, "layer_idx"))

    # the wrapped forward is transformers' (its arguments as that version passes them)
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        cache = kwargs.get("cache_params", kwargs.get("cache"))
        if cache is None:
            return original(hidden, *rest, **kwargs)
        continues = hidden.shape[1] > 1 and _has_previous_state(cache, layer_idx)
        positions, mask = kwargs.pop("cache_position", None), kwargs.pop("attention_mask", None)
        outputs = []
        for begin, end in plan.pieces(hidden.shape[1], continues):
            if begin == plan.split_at and begin > 0:
                plan.saved[layer_idx] = snapshot_linear_state(cache, layer_idx)
            step = dict(kwargs)
            if positions is not None:
                step["cache_position"] = positions[begin:end]
            if mask is not None:
                step["attention_mask"] = mask[:, begin:end] if mask.dim() == 2 else mask
            outputs.append(original(hidden[:, begin:end], *rest, **step))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    return forward


def _has_previous_state(cache: object, layer_idx: int) -> bool:
    flag = getattr(cache, "has_previous_state", False)
    return bool(flag(layer_idx)) if callable(flag) else bool(flag)
