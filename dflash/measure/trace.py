"""One training step of the trainer's own code, traced on fake tensors at the profile's world size.

Nothing is allocated. The state is the trainer's (`state_from_target`: the drafter sharded by FSDP2
over N fake ranks, AdamW over the shards) and the step is `dflash.train.rank.step.plain_step`, run
under FakeTensorMode and torch's fake process group (as torchtitan's memory estimation runs it);
FSDPMemTracker (dflash.measure.fake.phase_tracker) counts every storage by category and the peak of
each phase, the gradient reduction marked through the trainer's own observer
(dflash.train.rank.parallel.observe_reductions). The traced rank is rank 0, the fullest shards.

Where it differs from a GPU run, each a stand-in for what cannot run here: the target's forward is
traced on its own after the step, over the layers that decide its peak, and the drafter reads fresh
fake tap features through the feature-cache path (`FakeFeatures`); attention goes through SDPA with
flex's memory; the label selection `rows[keep]` keeps every row (`KeepEveryRow`, the worst case); two
micro-batches stand for all of them (the second runs with the first's gradients alive); the AdamW
states exist before tracking (a step after the first).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypedDict, cast

from dflash.measure import fake
from dflash.memory import peak_estimate as memory
from launcher_core.schema import Profile

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

    from dflash.train.rank.data import MicroBatch
    from dflash.train.rank.setup import TrainState

MIB = memory.MIB


@dataclass
class WorstCaseData:
    """The trainer's data interface at the profile's worst case: every sequence `data.max_length`
    tokens, a loss on every token (so the full `train.num_anchors` anchors), collated by the
    trainer's own `collate_rows`; batches are real (small) tensors made before tracking."""

    profile: Profile
    vocab: int

    def __post_init__(self) -> None:
        self.max_length = self.profile.data.max_length
        self._batches: dict[int, MicroBatch] = {}
        self.dataset = {"input_ids": [[(7 * i + r) % self.vocab for i in range(self.max_length)] for r in range(2)],
                        "loss_mask": [[1] * self.max_length for _ in range(2)]}
        self.steps_per_epoch = 1

    def collate(self, rows: list[int], epoch: int) -> MicroBatch:
        return self._batches[len(rows)]

    def prepare(self, sizes: set[int]) -> None:
        from dflash.train.rank.data import collate_rows

        for size in sizes:
            ids = [self.dataset["input_ids"][r % 2] for r in range(size)]
            masks = [self.dataset["loss_mask"][r % 2] for r in range(size)]
            self._batches[size] = collate_rows(ids, masks, list(range(size)), self.profile.train.num_anchors,
                                               self.profile.train.seed, 0)


class FakeFeatures:
    """The feature-cache path of `forward_micro`: a fresh fake tensor of the taps' shape per micro-batch."""

    def __init__(self, width: int, dtype: torch.dtype):
        self.width, self.dtype = width, dtype

    def features(self, batch: MicroBatch, extract: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.empty(*batch.input_ids.shape, self.width, dtype=self.dtype)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[DeviceMesh]:
    """torch's fake process group (collectives on fake tensors, no peers) and its device mesh, made
    before any FakeTensorMode (FSDP2 shards the drafter over it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dflash.torch_private import register_fake_backend

    if dist.is_initialized():
        raise RuntimeError("the memory trace needs its own (fake) process group; one is already initialised")
    dist.init_process_group(register_fake_backend(), store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def trace_step(profile: Profile, micro_batch: int, *, config: PretrainedConfig | None = None, full_target: bool = False,
               world_size: int | None = None) -> fake.TracedStep:
    """One training step of `profile` at `micro_batch` sequences per forward, traced on fake tensors
    on rank 0 (the fullest shards: FSDP2 gives rank 0 the first, largest chunk of every tensor)."""
    from dflash.memory.budget import batch_plan, world_size_of
    from dflash.torch_private import fake_tensor_mode

    started = time.perf_counter()
    config = config if config is not None else fake.target_config(profile)
    world = world_size or world_size_of(profile)
    workload = fake.workload_for_config(profile, config, world)
    plan = batch_plan(profile.train.global_batch, world, micro_batch)
    rows = list(range(min(plan.rank_share, 2 * plan.micro_batch)))      # two micro-batches stand for all
    data = WorstCaseData(profile, config.vocab_size)
    data.prepare({len(rows[i:i + plan.micro_batch]) for i in range(0, len(rows), plan.micro_batch)})
    with fake_process_group(world) as mesh, fake_tensor_mode()(allow_non_fake_inputs=True), KeepEveryRow():
        state = traced_state(profile, config, data, world, mesh)
        figures, tracker = _traced(state, profile, workload, rows, plan.micro_batch, full_target)
    peak = tracker.peak_by_category("micro-batches")       # the moment the model breaks down by category
    return fake.TracedStep(micro_batch=micro_batch, peak_categories={k: v / MIB for k, v in peak.items() if v},
                           seconds=time.perf_counter() - started, world_size=world, **figures)


def traced_state(profile: Profile, config: PretrainedConfig, data: WorstCaseData, world: int,
                 mesh: DeviceMesh) -> TrainState:
    """The trainer's state (`state_from_target`, the drafter sharded over the fake ranks) around a
    fake target, its optimizer states allocated."""
    import torch

    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import state_from_target
    from dflash.train.rank.step import autocast_wanted

    target = fake.build_target(config, getattr(torch, profile.model.dtype))
    state = state_from_target(profile, WorkerEnv(0, world, 0), torch.device("cpu"), target, data, mesh=mesh)
    state.autocast = "bfloat16" if autocast_wanted(profile.machine.device, profile.train.autocast) else "off"
    columns = len(state.layer_ids) + (1 if state.loss.needs_teacher else 0)   # train.loss = "distill": the last layer's too
    state.feature_cache = FakeFeatures(columns * config.hidden_size, getattr(torch, profile.model.dtype))
    allocate_optimizer_states(state)
    return state


def allocate_optimizer_states(state: TrainState) -> None:
    """One update on zero gradients (the trainer's `update`): AdamW allocates its states at its
    first step; the trace is of a later one."""
    import torch

    from dflash.train.rank.step import update

    for param in state.drafter.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    update(state)
    state.optimizer.zero_grad(set_to_none=True)


class TracedFigures(TypedDict):
    """The `fake.TracedStep` fields a traced step measures (MiB, and the target layers run / loaded)."""

    target_weights: float
    drafter_weights: float
    drafter_grads: float
    optimizer_states: float
    gathered_weights: float
    tap_features: float
    target_forward: float
    target_peak: float
    step_peak: float
    reduction_buffers: float
    reduction_peak: float
    update_peak: float
    peak: float
    target_layers_run: int
    target_layers_loaded: int


def _traced(state: TrainState, profile: Profile, workload: memory.Workload, rows: list[int], micro_batch: int,
            full_target: bool) -> tuple[TracedFigures, fake.PhaseTracking]:
    from dflash.train.rank.parallel import observe_reductions
    from dflash.train.rank.step import plain_step

    data = state.data
    assert isinstance(data, WorstCaseData), "the trace's state reads the worst case (traced_state)"
    attend = fake.FlexMemoryAttention(state.drafter, {size: b.anchors for size, b in data._batches.items()},
                                      profile.data.max_length, state.autocast == "bfloat16")
    state.layer_attends = attend.make_layer_attends
    tracker = fake.phase_tracker(state.drafter, state.optimizer, frozen=state.target)
    observe_reductions(state.drafter, lambda: _enter(tracker, REDUCTION), lambda: _enter(tracker, "micro-batches"))
    with tracker:
        plain_step(state, rows, 0, micro_batch, 1.0, mark=lambda phase: _enter(tracker, phase))
    before = tracker.live_bytes()
    rise, tap_bytes, layers_run = _target_forward_rise(state, data_batch(state, micro_batch), full_target)
    tracker.phase_peaks["target"] = before + rise
    return _figures(state, tracker, before, tap_bytes, layers_run), tracker


def _target_forward_rise(state: TrainState, batch: MicroBatch, full_target: bool) -> tuple[int, int, int]:
    """The target forward after the step, with the step's state and gradients alive: its peak above
    what was alive before it (torch's plain MemTracker, told of the target's weights first: the
    frozen target is no FSDP module, which FSDPMemTracker does not track), the taps' bytes and the
    layers run."""
    target_tracker = fake.frozen_model_tracker()
    target_tracker.track_external(state.target)         # its weights are alive before: not part of the rise
    with target_tracker:
        start = sum(snap["Total"] for snap in target_tracker.get_tracker_snapshot("current").values())
        features, layers_run = _target_taps(state, batch, full_target)
        tap_bytes = features.numel() * features.element_size()
    peak = max((snap["Total"] for snap in target_tracker.get_tracker_snapshot("peak").values()), default=0)
    return peak - start, tap_bytes, layers_run


REDUCTION = "gradient reduction"


def _enter(tracker: fake.PhaseTracking, phase: str) -> None:
    if tracker.phase != phase:          # a reduction allocates twice (its input and output buffers): one phase
        tracker.phase = phase


def data_batch(state: TrainState, micro_batch: int) -> MicroBatch:
    return state.data.collate(list(range(micro_batch)), 0)


def _target_taps(state: TrainState, batch: MicroBatch, full_target: bool) -> tuple[torch.Tensor, int]:
    """`extract_taps` over every loaded layer, or over the layers that decide the forward's peak; with
    train.loss = "distill" the last layer's output is captured too (`extract_taps_and_last`)."""
    from dflash.drafter.taps import decoder_layers, extract_taps

    loaded = len(decoder_layers(state.target))
    captured = [*state.layer_ids, *([loaded - 1] if state.loss.needs_teacher else [])]
    indices = (list(range(loaded)) if full_target
               else fake.peak_deciding_layers(fake.module_layer_types(state.target), captured))
    subset: contextlib.AbstractContextManager[object] = (contextlib.nullcontext() if full_target
                                                         else fake.LayerSubset(state.target, indices))
    with subset:
        features = extract_taps(state.target, batch.input_ids, [indices.index(k) for k in captured])
    return features, len(indices)


def _figures(state: TrainState, tracker: fake.PhaseTracking, before: int, tap_bytes: int, layers_run: int) -> TracedFigures:
    from dflash.drafter.taps import decoder_layers
    from dflash.train.rank.parallel import local_tensor

    phases, live = tracker.phase_peaks, tracker.live_by_category()
    shards = [local_tensor(p) for p in state.drafter.parameters() if p.requires_grad]
    return {"target_weights": _bytes(state.target.parameters()) / MIB, "drafter_weights": _bytes(shards) / MIB,
            "drafter_grads": live["Sharded Grad"] / MIB, "optimizer_states": live["OptState"] / MIB,
            "gathered_weights": tracker.gathered_peak / MIB,
            "tap_features": tap_bytes / MIB, "target_forward": (phases["target"] - before - tap_bytes) / MIB,
            "target_peak": phases["target"] / MIB, "step_peak": phases["micro-batches"] / MIB,
            "reduction_buffers": tracker.phase_rises.get(REDUCTION, 0) / MIB,
            "reduction_peak": phases.get(REDUCTION, 0) / MIB, "update_peak": phases["update"] / MIB,
            "peak": max(phases.values()) / MIB, "target_layers_run": layers_run,
            "target_layers_loaded": len(decoder_layers(state.target))}


def _bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


class KeepEveryRow:
    """A boolean index of a fake tensor (block_loss's `rows[keep]`, data-dependent) as the copy the
    worst case makes: every row kept (the worst-case data has a loss on every label)."""

    def __enter__(self) -> "KeepEveryRow":
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Callable[..., object], types: object, args: tuple[object, ...] = (),
                                   kwargs: dict[str, object] | None = None) -> object:
                import torch

                kwargs = kwargs or {}
                if func is torch.Tensor.__getitem__ and _boolean_rows(args):
                    tensor = cast(torch.Tensor, args[0])
                    return tensor.index_select(0, torch.arange(tensor.shape[0], device=tensor.device))
                return func(*args, **kwargs)

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def _boolean_rows(args: tuple[object, ...]) -> bool:
    import torch

    if len(args) != 2 or not isinstance(args[1], torch.Tensor) or args[1].dtype != torch.bool:
        return False
    tensor, index = args
    return (isinstance(tensor, torch.Tensor) and isinstance(index, torch.Tensor) and index.dim() == 1
            and tensor.dim() >= 1 and index.shape[0] == tensor.shape[0])
