"""The fake-tensor side of the memory trace (dflash.measure.trace): what the traced step needs that the
trainer does not have, and the comparison with the analytic model.

* the target, built from its config with transformers' own classes under FakeTensorMode (27B
  parameters cost nothing; Qwen3.6-27B's published config when its directory is not here), and the
  layers that decide its forward's peak (`LayerSubset`: every tap layer, and for each layer type the
  last one up to the deepest tap with the layer before it; `full_target=True` runs them all);
* torch's FSDPMemTracker, by category and per phase (`phase_tracker`);
* flex attention's memory through SDPA (`FlexMemoryAttention`): flex has no backward on CPU, not even
  on fake tensors;
* the traced figures against the model's (`compare`, `format_comparison`).

On a CPU-only torch the fake tensors are CPU tensors: sizes are what count. Heavy imports happen
inside the functions: `launcher.py plan` without `--trace` never loads torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, cast

from dflash.memory import peak_estimate as memory
from dflash.memory.target_shape import SMOLLM2_135M, shape_from_config, target_shape
from dflash.target_model import QWEN36_27B_TEXT, hybrid_layer_types, local_model_dir
from launcher_core.schema import Profile

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    from dflash.drafter.attention import Attend, Backend, BlockLayout
    from dflash.drafter.network import DFlashDrafter
    from launcher_core.layer_attention import LayerAttention

MIB = memory.MIB
# FSDPMemTracker's reference types (torch.distributed._tools.fsdp2_mem_tracker), and "Target" for the
# frozen target's weights, which are alive throughout and counted beside the tracker
CATEGORIES = ("Target", "Sharded Param", "Unsharded Param", "Buffer", "Sharded Grad", "Unsharded Grad", "Activation",
              "Temp", "All Gather", "Reduce Scatter", "OptState", "Inputs")
GATHERED = ("Unsharded Param", "All Gather")
MemorySnapshot = dict["torch.device", dict[str, int]]     # MemTracker's: device -> reference type -> bytes


@dataclass(frozen=True)
class TracedStep:
    """What one traced step (dflash.measure.trace) allocated, in MiB (one rank: rank 0, the fullest shards)."""

    micro_batch: int
    target_weights: float
    drafter_weights: float          # this rank's float32 parameter shards
    drafter_grads: float            # this rank's float32 gradient shards after the step
    optimizer_states: float
    gathered_weights: float         # all-gathered (unsharded) weights at their most, in a forward/backward
    tap_features: float             # the captured taps of one micro-batch
    target_forward: float           # the target forward's peak above what was live before it, minus the taps
    target_peak: float              # the target forward, with the step's state and gradients alive
    step_peak: float                # peak of the micro-batches' forward/backward (the second one: gradients alive)
    reduction_buffers: float        # the most a gradient reduction allocated above what was live when it began
    reduction_peak: float           # peak of the gradient reductions (inside the backward)
    update_peak: float              # peak of clipping + optimizer.step
    peak: float
    peak_categories: dict[str, float] = field(default_factory=dict)     # by category at the micro-batches' peak
    target_layers_run: int = 0
    target_layers_loaded: int = 0
    seconds: float = 0.0
    world_size: int = 1
    attention: str = "sdpa"


# --- the target ---------------------------------------------------------------------------

def target_config(profile: Profile) -> PretrainedConfig:
    """The profile's target config (transformers object): from its directory, the builtin
    SmolLM2's shape, or the published Qwen3.6-27B text config."""
    from transformers import AutoConfig, LlamaConfig

    from dflash.target_model import SMOLLM2

    directory = local_model_dir(profile.model.target)
    if (directory / "config.json").exists():
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        text: PretrainedConfig = getattr(config, "text_config", None) or config
        return text
    if profile.model.target == SMOLLM2:
        s = SMOLLM2_135M
        return LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                           num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                           vocab_size=s.vocab, tie_word_embeddings=s.tie_embeddings)
    return qwen36_27b_config()


def qwen36_27b_config(**changes: object) -> PretrainedConfig:
    """Qwen3.6-27B's text config (`Qwen3_5TextConfig`); `changes` override fields (tests shrink it)."""
    from transformers import Qwen3_5TextConfig

    values = {**QWEN36_27B_TEXT, **changes}
    interval = values.pop("full_attention_interval")
    layers = values["num_hidden_layers"]
    assert isinstance(layers, int) and isinstance(interval, int)
    values.setdefault("layer_types", hybrid_layer_types(layers, interval))
    return Qwen3_5TextConfig.from_dict(values)


def truncated_config(config: PretrainedConfig, keep_layers: int) -> PretrainedConfig:
    """The config with only the first `keep_layers` layers (the trainer drops the rest)."""
    import copy

    from dflash.target_model import truncate_layers

    truncated = copy.deepcopy(config)
    truncate_layers(truncated, keep_layers)
    truncated._attn_implementation = "sdpa"
    return truncated


def build_target(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The frozen target from its config in `dtype` (under the caller's FakeTensorMode: no memory)."""
    from transformers import AutoModelForCausalLM

    target: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    target.requires_grad_(False)
    unmasked_linear_attention(target)
    return target


def unmasked_linear_attention(target: nn.Module) -> None:
    """Without a padding mask, a hybrid model's linear-attention mask is None (what
    `_update_linear_attn_mask` returns then), decided without reading a tensor. transformers 5.3's
    Qwen3.5 (the cu128 set's pin) first tests `cache_position[0] > 0`, a data-dependent branch no fake
    tensor can take; later versions test the cache object and the mask instead."""
    for module in target.modules():
        update = getattr(module, "_update_linear_attn_mask", None)
        if update is not None:
            def without_mask(attention_mask: object, *args: object, _update: Callable[..., Any] = update,
                             **kwargs: object) -> object:
                return None if attention_mask is None else _update(attention_mask, *args, **kwargs)

            setattr(module, "_update_linear_attn_mask", without_mask)     # nn.Module's __setattr__ types modules only


def module_layer_types(target: nn.Module) -> list[str]:
    """The kind of each decoder layer of a built target (its modules' `layer_type`; "decoder" when
    the layer does not say). `dflash.target_model.layer_types` reads the same from a config."""
    from dflash.drafter.taps import decoder_layers

    return [getattr(layer, "block_type", None) or getattr(layer, "layer_type", None) or "decoder"
            for layer in decoder_layers(target)]


def peak_deciding_layers(types: Sequence[str], taps: Sequence[int]) -> list[int]:
    """The tap layers and, per layer type, its last layer up to the deepest tap and the layer
    before it (so that layer's input is a fresh hidden state, not a held tap), sorted."""
    deepest = max(taps)
    last_of_type = {kind: index for index, kind in enumerate(types[:deepest + 1])}
    before = {index - 1 for index in last_of_type.values() if index > 0}
    return sorted(set(taps) | set(last_of_type.values()) | before)


class LayerSubset:
    """Context manager: the target's forward runs only `indices` of its layers (weights stay)."""

    def __init__(self, target: PreTrainedModel, indices: Sequence[int]):
        base = target.get_submodule("model")
        self.base, self.config, self.indices = base, target.config, list(indices)

    def __enter__(self) -> LayerSubset:
        import torch

        layers = self.base.get_submodule("layers")
        assert isinstance(layers, torch.nn.ModuleList)
        self.saved = (layers, self.config.num_hidden_layers, getattr(self.config, "layer_types", None))
        self.base.layers = torch.nn.ModuleList(layers[i] for i in self.indices)
        self.config.num_hidden_layers = len(self.indices)
        if self.saved[2] is not None:
            self.config.layer_types = [self.saved[2][i] for i in self.indices]
        return self

    def __exit__(self, *exc: object) -> None:
        self.base.layers, self.config.num_hidden_layers, types = self.saved
        if types is not None:
            self.config.layer_types = types


# --- the tracker --------------------------------------------------------------------------

class PhaseTracking(Protocol):
    """What the trace reads of its tracker (`phase_tracker`: torch's FSDPMemTracker)."""

    phase: str
    phase_peaks: dict[str, int]         # the most alive in each phase
    phase_rises: dict[str, int]         # the most a phase allocated above what was alive when it (last) began
    gathered_peak: int

    def live_bytes(self) -> int: ...

    def live_by_category(self) -> dict[str, int]: ...

    def peak_by_category(self, phase: str) -> dict[str, int]: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *args: object) -> None: ...


def phase_tracker(drafter: nn.Module, optimizer: torch.optim.Optimizer, frozen: nn.Module | None = None) -> PhaseTracking:
    """torch's FSDPMemTracker over the sharded drafter and its optimizer (sharded and unsharded
    parameters and gradients, all-gather and reduce-scatter buffers, activations, temporaries,
    optimizer states), keeping the peak of each named phase and the most the gathered weights
    took. `frozen`: a model alive throughout that is no FSDP module (the frozen target): its weights
    are registered first, as "Target", so that a view of one (lm_head's transpose in the loss,
    the embedding's rows) is not taken for a new tensor of that size."""
    from torch.distributed.fsdp import FSDPModule

    from dflash.torch_private import fsdp_mem_tracker

    FSDPMemTracker, _FSDPRefType, _State = fsdp_mem_tracker()

    class PhaseTracker(FSDPMemTracker):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__(drafter, optimizer)
            self._phase = "setup"
            self.phase_peaks: dict[str, int] = {}
            self.phase_starts: dict[str, int] = {}
            self.phase_rises: dict[str, int] = {}
            self.gathered_peak = 0
            self._phase_categories: dict[str, dict[str, int]] = {}
            for tensor in (*frozen.parameters(), *frozen.buffers()) if frozen is not None else ():
                self._update_and_maybe_create_winfos(tensor, _FSDPRefType.INP)     # "Inputs": read back as "Target"

        @property
        def phase(self) -> str:
            return self._phase


        @phase.setter
        def phase(self, name: str) -> None:
            # a phase that allocates nothing peaks at what is live when it starts; a phase entered
            # again (a reduction per unit) keeps the largest rise above its start in `phase_starts`
            live = self.live_bytes()
            self._phase = name
            self.phase_starts[name] = live
            self.phase_peaks[name] = max(self.phase_peaks.get(name, -1), live)

        def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, original: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
            # the drafter called again at the top level (the step's next micro-batch) starts its per-module
            # stats afresh (FSDPMemTracker tracks one iteration); the global figures, all the trace reads, go on
            tracked: Callable[..., Any] = super()._fsdp_state_pre_forward(fsdp_mod, original)

            def again(*args: Any, **kwargs: Any) -> Any:
                if fsdp_mod is drafter and fsdp_mod in self.memory_tracking and not self._mod_tracker.is_bw:
                    self.reset_mod_stats()
                return tracked(*args, **kwargs)

            return again

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Called after every operation. MemTracker's own (not called) walks every module it tracks to
            # keep each one's peak, and then its overall peak: the trace reads neither (each phase's peak
            # below covers the overall one), and the walk is a large share of a trace's CPU (benchmarks/results/test-suite-cpu_cpu-2core_2026-12-06.md).
            live, categories = self.live_bytes(), self.live_by_category()
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, -1), live)
            rise = live - self.phase_starts.get(self.phase, live)
            self.phase_rises[self.phase] = max(self.phase_rises.get(self.phase, 0), rise)
            self.gathered_peak = max(self.gathered_peak, sum(categories.get(k, 0) for k in GATHERED))
            if live > sum(self._phase_categories.get(self.phase, {}).values()):
                self._phase_categories[self.phase] = categories

        def live_bytes(self) -> int:
            return sum(snap["Total"] for snap in self._curr_mem_snap.values())

        def live_by_category(self) -> dict[str, int]:
            categories = by_category(self._curr_mem_snap)
            categories["Target"] = categories.pop("Inputs")
            return categories

        def peak_by_category(self, phase: str) -> dict[str, int]:
            """What was alive, by category, at the peak of one phase."""
            return dict(self._phase_categories.get(phase, {}))

    return cast(PhaseTracking, PhaseTracker())


def frozen_model_tracker() -> Any:
    """torch's plain MemTracker for a frozen model's forward (the target's): it would hook every
    parameter's gradient, which a frozen one cannot take; those hooks only name categories."""
    from dflash.torch_private import mem_tracker

    class FrozenModelTracker(mem_tracker()):  # type: ignore[misc]
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
            trainable = all(p.requires_grad and p.is_leaf for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and trainable)

    return FrozenModelTracker()


def by_category(snapshot: MemorySnapshot) -> dict[str, int]:
    """Bytes per category (MemTracker's reference types), summed over devices."""
    totals = dict.fromkeys(CATEGORIES, 0)
    for device_snap in snapshot.values():
        for key, value in device_snap.items():
            name = getattr(key, "value", key)
            if name in totals:
                totals[name] += value
    return totals


# --- flex's memory on CPU ------------------------------------------------------------------

class FlexMemoryAttention:
    """The trainer's block attention with flex's memory, for the trace: flex_attention has no
    backward on CPU, so the drafter attends through SDPA over the layout's mask, made here before
    tracking (flex's BlockMask is a few KiB) as an additive mask in the attention's dtype (a boolean
    one would be converted, and saved, inside every call), query heads grouped per KV head instead of
    K/V expanded to the query heads (what sdpa's `enable_gqa` does on CPU, and flex does not).
    One mask per distinct layer rule (`drafter.layer_rules`: full, or a sliding window), as flex
    keeps one BlockMask per rule. `make_layer_attends` is the trainer's attention factory
    (`TrainState.layer_attends`, what `forward_blocks` calls)."""

    def __init__(self, drafter: DFlashDrafter, anchors_by_size: dict[int, torch.Tensor], context_len: int,
                 bf16: bool):
        import torch

        from dflash.drafter.attention import BlockLayout

        config = drafter.config
        self.groups = config.num_attention_heads // (config.num_key_value_heads or config.num_attention_heads)
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.masks: dict[tuple[int, LayerAttention], torch.Tensor] = {}
        for size, anchors in anchors_by_size.items():
            layout = BlockLayout(anchors, context_len, drafter.block_size)
            for rule in set(drafter.layer_rules):
                visible = layout.dense_mask(rule).repeat(1, 1, self.groups, 1)
                self.masks[size, rule] = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))

    def make_layer_attends(self, layout: BlockLayout, backend: Backend, rules: list[LayerAttention]) -> list[Attend]:
        return [self.make_attend(self.masks[layout.anchors.shape[0], rule]) for rule in rules]

    def make_attend(self, mask: torch.Tensor) -> Attend:
        import torch.nn.functional as F

        groups = self.groups

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            batch, heads, queries, dim = q.shape
            grouped = q.reshape(batch, k.shape[1], groups * queries, dim)
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
            return out.reshape(batch, heads, queries, dim)

        return attend


def workload_for_config(profile: Profile, config: PretrainedConfig, world_size: int | None = None) -> memory.Workload:
    """The memory model's workload of `profile` with the target shape of `config`; the profile's own
    shape (and its parameter count) when the dimensions are the same."""
    import dataclasses

    shape = shape_from_config(config.to_dict(), type(config).__name__)
    known = target_shape(profile)
    if dataclasses.replace(shape, param_count=known.param_count, source=known.source) == known:
        shape = known
    return memory.workload_from_profile(profile, shape, world_size)


# --- traced vs modelled -------------------------------------------------------------------

@dataclass(frozen=True)
class ComparedFigure:
    """One component (or the peak), traced and modelled, in MiB."""

    name: str
    traced: float
    modelled: float

    @property
    def error(self) -> float:
        """(modelled - traced) / traced: positive when the model over-estimates."""
        return (self.modelled - self.traced) / self.traced if self.traced else 0.0


def compare(traced: TracedStep, workload: memory.Workload) -> list[ComparedFigure]:
    """Each traced figure next to the analytic model's figure for the same thing: the static parts,
    the gathered weights, the step's moments (forward/backward, a gradient reduction's own buffers,
    the update) and, at the micro-batches' peak (the moment the model breaks down), each category (parameters, gradients, optimizer states,
    activations with the loss's temporaries)."""
    e, m = memory.estimate(workload), traced.micro_batch
    line = memory.estimated_peak_model(workload)
    drafter_step = max(moment.at(m) for moment in e.drafter_lines()) + e.accumulated_gradients(m)
    at_peak = traced.peak_categories
    # the reduce input a unit's reduction still holds is "Reduce Scatter" to the tracker once a collective has run on
    # it: on one rank torch 2.13's FSDP2 runs none (a copy: "Temp") and 2.9's does; on one rank the model counts it
    # as working memory, so it is working memory there in either case
    held_reduce = at_peak.get("Reduce Scatter", 0.0)
    one_rank = held_reduce if e.world_size == 1 else 0.0
    working = sum(at_peak.get(name, 0.0) for name in ("Activation", "Temp", "Buffer")) + one_rank
    gathered = sum(at_peak.get(name, 0.0) for name in GATHERED)
    grads = at_peak.get("Sharded Grad", 0.0) + at_peak.get("Unsharded Grad", 0.0) + held_reduce - one_rank
    loss, layer = e.moment_lines()[:2]
    layer_moment = layer.at(m) > loss.at(m)             # which moment of the drafter's step the model says peaks
    gathered_at_peak = e.held_weights + (e.gathered_weights if layer_moment else 0.0)
    # a layer's gradients are "Temp" to the tracker until its reduction takes them: they count as working memory
    # on one rank the model counts the retained reduce input as working memory (above)
    retained = e.retained_reduce_input if layer_moment and e.world_size > 1 else 0.0
    grads_at_peak = retained + e.accumulated_gradients(m)
    autocast_layer = e.autocast_layer if layer_moment else 0.0
    deciding = max(e.drafter_lines(), key=lambda moment: moment.at(m)).moment
    if deciding.startswith("the selector"):             # DFlash 2: the selector's own unit decides the step
        reduction = deciding == "the selector's gradient reduction"
        selector_weights = e.selector_backward if deciding == "the selector's backward" else e.selector_gathered
        gathered_at_peak = e.held_weights + (e.root_gathered if reduction else selector_weights)
        grads_at_peak = e.accumulated_gradients(m) + (e.selector_reduce_held if reduction else 0.0)
        autocast_layer = 0.0
    modelled_working = drafter_step - e.static - gathered_at_peak - grads_at_peak - autocast_layer
    pairs = [("target weights", traced.target_weights, e.target_weights),
             ("drafter weights (fp32 shards)", traced.drafter_weights, e.drafter_weights),
             ("drafter gradients (fp32 shards)", traced.drafter_grads, e.drafter_grads),
             ("AdamW states (shards)", traced.optimizer_states, e.optimizer_states),
             ("gathered weights (most at once)", traced.gathered_weights, e.gathered_most),
             ("tap features", traced.tap_features, m * e.tap_features),
             ("target forward working set", traced.target_forward, m * e.target_activations),
             ("micro-batches' peak (forward/backward)", traced.step_peak, drafter_step),
             ("a gradient reduction's own buffers", traced.reduction_buffers, e.reduction_buffers),
             ("optimizer update's peak", traced.update_peak, e.update_peak),
             ("at the step's peak: parameters", at_peak.get("Target", 0.0) + at_peak.get("Sharded Param", 0.0),
              e.target_weights + e.drafter_weights),
             ("at the step's peak: gathered weights", gathered, gathered_at_peak),
             ("at the step's peak: gradients (+ reduction buffer)", grads, grads_at_peak),
             ("at the step's peak: optimizer states", at_peak.get("OptState", 0.0), e.optimizer_states),
             ("at the step's peak: activations + loss", working, modelled_working),
             ("peak", traced.peak, line.peak_mib(m))]
    return [ComparedFigure(name, traced_mib, modelled) for name, traced_mib, modelled in pairs]


def format_comparison(profile_name: str, traced: TracedStep, figures: list[ComparedFigure]) -> list[str]:
    width = max(len(f.name) for f in figures)
    lines = [f"{profile_name}, micro-batch {traced.micro_batch}, rank 0 of {traced.world_size} (fake process group, FSDP2): "
             f"traced in {traced.seconds:.0f} s (target: {traced.target_layers_run} of {traced.target_layers_loaded} "
             f"loaded layers run; "
             f"drafter attention: {traced.attention} with flex's memory)",
             f"  {'component':<{width}}  {'traced MiB':>11}  {'model MiB':>11}  {'model vs trace':>14}"]
    lines += [f"  {f.name:<{width}}  {f.traced:>11,.0f}  {f.modelled:>11,.0f}  {100 * f.error:>+13.1f}%" for f in figures]
    categories = ", ".join(f"{name} {mib:,.0f}" for name, mib in traced.peak_categories.items() if mib >= 1)
    lines.append(f"  at the micro-batches' peak: {categories}")
    return lines
