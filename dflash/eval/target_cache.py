"""The target's cache during speculative decoding: the same operations on every supported
transformers version (`dflash.compat`) and on hybrid targets.

A Qwen3.5/3.6 target mixes full-attention layers (a KV cache, cropped by position) with Gated
DeltaNet linear-attention layers (a recurrent state and a conv state of fixed size, which hold
no positions and cannot be cropped). `snapshot_linear_state` copies those states before a verify
forward and `restore_linear_state` puts them back after a rejection; `crop_attention` crops
only the KV of the attention layers. The verifier (`dflash.eval.specdec.TargetVerifier`) then
feeds the accepted tokens again.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch


def cache_keyword(model: Any) -> str:
    """The keyword the model's forward takes its cache by: `cache` (transformers 5.24) or
    `past_key_values` (5.3, 5.6; a keyword the forward does not name is silently ignored)."""
    parameters = inspect.signature(model.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                    f"not a supported transformers causal LM")


def output_cache(output: Any) -> Any:
    """The cache a forward returned (`output.cache` in 5.24, `output.past_key_values` before)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


@dataclass(frozen=True)
class _Slot:
    """One state tensor inside a cache: `holder[key]` (dicts, lists) or `holder.key` (attributes)."""

    holder: Any
    key: Any
    attribute: bool = False

    def get(self) -> "torch.Tensor":
        return getattr(self.holder, self.key) if self.attribute else self.holder[self.key]

    def set(self, value: "torch.Tensor") -> None:
        if self.attribute:
            setattr(self.holder, self.key, value)
        else:
            self.holder[self.key] = value


def linear_state_slots(cache: Any) -> list[_Slot]:
    """Every conv / recurrent state tensor of the cache's linear-attention layers.

    Layouts: 5.24 `LinearAttentionLayer.conv_states` is a dict (state index -> tensor); 5.6 it is
    a tensor attribute of the layer; 5.3 `Qwen3_5DynamicCache.conv_states` is a list over layers.
    """
    import torch

    layers = getattr(cache, "layers", None)
    if layers is None:
        return [_Slot(states, index) for name in ("conv_states", "recurrent_states")
                for states in [getattr(cache, name, None) or []]
                for index, value in enumerate(states) if isinstance(value, torch.Tensor)]
    slots = []
    for layer in layers:
        for name in ("conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            if isinstance(value, dict):
                slots += [_Slot(value, key) for key, tensor in value.items() if isinstance(tensor, torch.Tensor)]
            elif isinstance(value, torch.Tensor):
                slots.append(_Slot(layer, name, attribute=True))
    return slots


LinearSnapshot = list[tuple[_Slot, "torch.Tensor"]]


def snapshot_linear_state(cache: Any) -> LinearSnapshot:
    """Copies of the linear-attention states (the library updates them in place)."""
    return [(slot, slot.get().clone()) for slot in linear_state_slots(cache)]


def restore_linear_state(snapshot: LinearSnapshot) -> None:
    """Put the states back as they were at the snapshot (in place where the shape is unchanged)."""
    for slot, saved in snapshot:
        current = slot.get()
        if current.shape == saved.shape:
            current.copy_(saved)
        else:
            slot.set(saved)


def crop_attention(cache: Any, length: int) -> None:
    """Keep the first `length` positions of every attention layer's KV; linear layers untouched."""
    layers = getattr(cache, "layers", None)
    if layers is None:   # 5.3 Qwen3_5DynamicCache: lists over layers, no `crop`
        for states in (cache.key_cache, cache.value_cache):
            for index, value in enumerate(states):
                if value is not None and value.dim() == 4 and value.shape[-2] > length:
                    states[index] = value[..., :length, :]
        return
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if keys is None or keys.dim() != 4 or keys.shape[-2] <= length:
            continue
        layer.crop(length - keys.shape[-2])    # negative: remove that many (5.6 and 5.24 alike)


def linear_attention_modules(model: Any) -> list[Any]:
    """The Gated DeltaNet modules of a loaded target (`layer.linear_attn`)."""
    from dflash.drafter.taps import decoder_layers

    return [layer.linear_attn for layer in decoder_layers(model) if hasattr(layer, "linear_attn")]


@contextlib.contextmanager
def sequential_linear_attention(model: Any, enabled: bool) -> Iterator[None]:
    """transformers 5.3-5.6 restart a linear-attention layer's state for any cached forward of more
    than one token; inside this context those layers take such a forward one token at a time
    (their exact single-token path), while attention and MLP layers still see the whole block."""
    modules = linear_attention_modules(model) if enabled else []
    previous = [module.__dict__.get("forward") for module in modules]
    for module in modules:
        module.forward = _token_by_token(module, module.forward)
    try:
        yield
    finally:
        for module, before in zip(modules, previous):
            if before is None:
                del module.forward
            else:
                module.forward = before


def _token_by_token(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def forward(*args: Any, **kwargs: Any) -> Any:
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        cache = kwargs.get("cache_params", kwargs.get("cache"))
        if cache is None or hidden.shape[1] == 1 or not _has_previous_state(cache, module.layer_idx):
            return original(hidden, *rest, **kwargs)
        positions, mask = kwargs.pop("cache_position", None), kwargs.pop("attention_mask", None)
        outputs = []
        for t in range(hidden.shape[1]):
            step = dict(kwargs)
            if positions is not None:
                step["cache_position"] = positions[t:t + 1]
            if mask is not None:
                step["attention_mask"] = mask[:, t:t + 1] if mask.dim() == 2 else mask
            outputs.append(original(hidden[:, t:t + 1], *rest, **step))
        return torch.cat(outputs, dim=1)

    return forward


def _has_previous_state(cache: Any, layer_idx: int) -> bool:
    flag = getattr(cache, "has_previous_state", False)
    return bool(flag(layer_idx)) if callable(flag) else bool(flag)
