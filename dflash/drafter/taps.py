"""Online extraction of the target's tap features: forward hooks, stop after the deepest tap.

Layer id k means the OUTPUT of decoder layer k (HF `hidden_states[k + 1]`). For training only
the taps are needed, so the hook on the deepest tap layer stops the forward: the remaining
layers and the lm_head (seq x vocab logits) never run. Evaluation needs logits and taps of the
same verify forward: it uses `TapCapture(model, ids, stop_after_deepest=False)` around a full
forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle
    from transformers import PreTrainedModel

    from dflash.drafter.shape import TargetConfig


MIN_SPACED_TARGET_LAYERS = 5     # the spacing from layer 1 to N-3 needs N >= 5 for two or more taps


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Tap layer ids spaced from layer 1 to N-3: `[N // 2]` for one draft layer. (A target too
    shallow for the spacing is the launch checks' to refuse, dflash.train.supervisor.launch_checks.)"""
    n, count = num_target_layers, num_draft_layers
    assert count >= 1, "the profile schema holds drafter.num_layers >= 1"
    if count == 1:
        return [n // 2]
    assert n >= MIN_SPACED_TARGET_LAYERS, f"a target with {n} layers is too shallow for {count} tap layers"
    return [round(1 + i * (n - 4) / (count - 1)) for i in range(count)]


def source_layer_ids(layer_ids: Sequence[int], num_draft_layers: int, num_target_layers: int) -> list[int]:
    """`drafter.init = "target"`: draft layer i starts as target layer (deepest tap + 1 + i), clipped."""
    first = max(layer_ids) + 1
    return [min(first + i, num_target_layers - 1) for i in range(num_draft_layers)]


def target_layers_needed(layer_ids: Sequence[int], num_draft_layers: int, num_target_layers: int,
                         from_target: bool, to_last: bool = False) -> int:
    """The decoder layers a rank loads: up to the deepest tap (the rest never run), and with
    drafter.init = "target" (`from_target`) up to the last layer the draft layers start from; all of
    them when the loss needs the target's own logits (`to_last`: train.loss = "distill")."""
    if to_last:
        return num_target_layers
    deepest = max(layer_ids)
    if from_target:
        deepest = max(deepest, *source_layer_ids(layer_ids, num_draft_layers, num_target_layers))
    return deepest + 1


def unholdable_sources(sources: Sequence[int], target_config: TargetConfig) -> str:
    """Why the draft layers cannot start as these target layers ("" when they can).

    A draft layer holds plain softmax attention. A linear-attention (Gated DeltaNet) layer of a
    hybrid target such as Qwen3.5/3.6 has no q/k/v/o projections at all; a gated full-attention
    layer (`attn_output_gate`: q_proj holds queries and gates, (1 + weight) RMSNorms) has weights
    that mean something else in a draft layer. `target_config` is a config object or config.json.
    """
    from dflash.target_model import attention_is_gated, layer_types

    kinds = layer_types(target_config)
    linear = [s for s in sources if s < len(kinds) and kinds[s] != "full_attention"]
    if linear:
        return (f"the draft layers would start as target layers {list(sources)}, and {linear} are "
                f"{kinds[linear[0]]} (Gated DeltaNet) layers, which have no attention weights a draft layer "
                f"can hold; use drafter.init = \"random\" (the default)")
    if attention_is_gated(target_config):
        return (f"target layers {list(sources)} use gated attention (attn_output_gate: q_proj holds queries "
                f"and gates) and (1 + weight) norms, which do not mean the same in a draft layer; use "
                f"drafter.init = \"random\" (the default)")
    return ""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers causal LM (`model.model.layers`)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no `model.layers`; not a supported decoder-only target")
    return layers


class StopForward(Exception):
    """Raised by the deepest tap's hook to end the target forward early."""


class TapCapture:
    """Context manager: forward hooks on the tap layers collect their outputs.

    `features()` concatenates the captured outputs in `layer_ids` order -> [B, S, L*H].
    With `stop_after_deepest`, the deepest tap's hook raises `StopForward`.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], stop_after_deepest: bool = False):
        layers = decoder_layers(model)
        bad = [k for k in layer_ids if not 0 <= k < len(layers)]
        if bad or not layer_ids:
            raise ValueError(f"tap layer ids {list(layer_ids)} must be in 0..{len(layers) - 1}")
        self.layer_ids = list(layer_ids)
        self.stop_after_deepest = stop_after_deepest
        self._layers = layers
        self._captured: dict[int, "torch.Tensor"] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> "TapCapture":
        deepest = max(self.layer_ids)
        for k in sorted(set(self.layer_ids)):
            self._handles.append(self._layers[k].register_forward_hook(self._hook(k, k == deepest)))
        return self

    def __exit__(self, *exc: object) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return exc[0] is StopForward

    def _hook(self, layer_id: int, is_deepest: bool) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(_module: nn.Module, _inputs: tuple[object, ...], output: object) -> None:
            captured = output[0] if isinstance(output, tuple) else output
            self._captured[layer_id] = cast("torch.Tensor", captured)
            if is_deepest and self.stop_after_deepest:
                raise StopForward()
        return hook

    def features(self) -> "torch.Tensor":
        """The captured outputs in `layer_ids` order, concatenated -> [B, S, len(layer_ids) * H]."""
        import torch

        missing = [k for k in self.layer_ids if k not in self._captured]
        assert not missing, f"tap layers {missing} did not run"
        return torch.cat([self._captured[k] for k in self.layer_ids], dim=-1)


def extract_taps(model: PreTrainedModel, input_ids: "torch.Tensor", layer_ids: Sequence[int]) -> "torch.Tensor":
    """Tap features [B, S, L*H] of a frozen target; layers past the deepest tap never run."""
    import torch

    with torch.no_grad():
        with TapCapture(model, layer_ids, stop_after_deepest=True) as capture:
            model.model(input_ids=input_ids, use_cache=False)
    return capture.features()


def extract_taps_and_last(model: PreTrainedModel, input_ids: "torch.Tensor", layer_ids: Sequence[int]) -> "torch.Tensor":
    """Tap features and the last decoder layer's output (before the final norm) as one tensor
    [B, S, (L + 1) * H], the last H columns the latter (`split_last`); the forward stops there, so the
    final norm and the lm_head run only on the rows the loss asks for (train.loss = "distill")."""
    import torch

    last = len(decoder_layers(model)) - 1
    with torch.no_grad():
        with TapCapture(model, [*layer_ids, last], stop_after_deepest=True) as capture:
            model.model(input_ids=input_ids, use_cache=False)
    return capture.features()


def split_last(features_and_last: "torch.Tensor", hidden_size: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """`extract_taps_and_last`'s tensor -> (tap features [B, S, L * H], last layer's output [B, S, H]): views."""
    return features_and_last[..., :-hidden_size], features_and_last[..., -hidden_size:]
