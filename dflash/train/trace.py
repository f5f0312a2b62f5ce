"""One training step of the trainer's own code, traced on fake tensors at the profile's world size.

Nothing is allocated: the step runs under PyTorch's `FakeTensorMode` and torch's fake process
group (`init_process_group("fake", store=FakeStore(), rank=r, world_size=N)`, as torchtitan's
memory estimation runs it), and `MemTracker` (dflash.memory.trace.phase_tracker) counts every
storage created, by category, and the peak. The state is the trainer's: `state_from_target`
(tap layers, the drafter with its draft vocabulary and target init, the truncated target, the
profile's optimizer with ZeRO-1 sharding over the N fake ranks, the schedule), and the step is
`dflash.train.step.plain_step` (zero_grad, every micro-batch's forward/backward with the chunked
loss under the trainer's autocast rule, the gradient sum over the ranks, clipping, the update),
as `run_step` runs it. The traced rank is the one with the fullest ZeRO-1 shard.

Where the trace differs from a GPU run, on purpose (each a stand-in for what cannot run here):
* the target: built from its config under FakeTensorMode (27B parameters cost nothing), its
  forward traced on its own (`extract_taps` over the layers that decide its peak,
  dflash.memory.trace.LayerSubset) while the step's state and gradients are alive; the drafter
  step reads the tap features through the trainer's feature-cache path (`state.feature_cache`),
  a fresh fake tensor of the taps' shape per micro-batch, as the cache does;
* attention: flex_attention has no backward on CPU, so the drafter attends through SDPA with
  flex's memory (dflash.memory.trace.FlexMemoryAttention, the state's attention factory
  `layer_attends`; its mask made before tracking, as flex's BlockMask is a few KiB);
* the label selection `rows[keep]` has a data-dependent shape; the worst case keeps every label,
  so a boolean index of a fake tensor becomes the same copy through `index_select` of all rows;
* two micro-batches stand for all of them: from the second on, each one's forward/backward runs
  with the gradients of the earlier ones alive, and the rest repeat it;
* the optimizer's states are allocated before tracking (a step after the first).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypedDict, cast

from dflash.memory import model as memory
from dflash.memory import trace as fake
from launcher_core.schema import Profile

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from dflash.train.data import MicroBatch
    from dflash.train.setup import TrainState

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
        from dflash.train.data import collate_rows

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
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """torch's fake process group: collectives on fake tensors, no peers (world size 1: none at all)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size <= 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("the memory trace needs its own (fake) process group; one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def traced_rank(profile: Profile, workload: memory.Workload) -> int:
    """The rank whose ZeRO-1 shard is the fullest (rank 0 without sharding)."""
    if workload.optimizer_shards <= 1:
        return 0
    sizes = memory.zero_shard_sizes(memory.drafter_param_sizes(workload), workload.optimizer_shards)
    return sizes.index(max(sizes))


def trace_step(profile: Profile, micro_batch: int, *, config: PretrainedConfig | None = None, full_target: bool = False,
               world_size: int | None = None) -> fake.TracedStep:
    """One training step of `profile` at `micro_batch` sequences per forward, traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflash.memory.plan import batch_plan, world_size_of

    started = time.perf_counter()
    config = config if config is not None else fake.target_config(profile)
    world = world_size or world_size_of(profile)
    workload = fake.workload_for_config(profile, config, world)
    plan = batch_plan(profile.train.global_batch, world, micro_batch)
    rows = list(range(min(plan.rank_share, 2 * plan.micro_batch)))      # two micro-batches stand for all
    data = WorstCaseData(profile, config.vocab_size)
    data.prepare({len(rows[i:i + plan.micro_batch]) for i in range(0, len(rows), plan.micro_batch)})
    with fake_process_group(world, traced_rank(profile, workload)), \
            FakeTensorMode(allow_non_fake_inputs=True), KeepEveryRow():
        state = traced_state(profile, config, data, world)
        figures, tracker = _traced(state, profile, workload, rows, plan.micro_batch, full_target)
    peak = fake.by_category(tracker.get_tracker_snapshot("peak"))
    return fake.TracedStep(micro_batch=micro_batch, peak_categories={k: v / MIB for k, v in peak.items() if v},
                           seconds=time.perf_counter() - started, world_size=world, **figures)


def traced_state(profile: Profile, config: PretrainedConfig, data: WorstCaseData, world: int) -> TrainState:
    """The trainer's state (`state_from_target`) around a fake target, its optimizer states allocated."""
    import torch

    from dflash.train.dist import WorkerEnv, rank_of_process
    from dflash.train.setup import state_from_target
    from dflash.train.step import autocast_wanted

    target = fake.build_target(config, getattr(torch, profile.model.dtype))
    state = state_from_target(profile, WorkerEnv(rank_of_process(), world, 0), torch.device("cpu"), target, data)
    state.autocast = "bfloat16" if autocast_wanted(profile.machine.device, profile.train.autocast) else "off"
    width = len(state.layer_ids) * config.hidden_size
    state.feature_cache = FakeFeatures(width, getattr(torch, profile.model.dtype))
    allocate_optimizer_states(state)
    return state


def allocate_optimizer_states(state: TrainState) -> None:
    """One update on zero gradients (the trainer's `update`): AdamW allocates its states at its
    first step; the trace is of a later one."""
    import torch

    from dflash.train.step import update

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
    tap_features: float
    target_forward: float
    target_peak: float
    step_peak: float
    sum_peak: float
    update_peak: float
    peak: float
    target_layers_run: int
    target_layers_loaded: int


def _traced(state: TrainState, profile: Profile, workload: memory.Workload, rows: list[int], micro_batch: int,
            full_target: bool) -> tuple[TracedFigures, fake.PhaseTracking]:
    from dflash.train.step import plain_step

    data = state.data
    assert isinstance(data, WorstCaseData), "the trace's state reads the worst case (traced_state)"
    attend = fake.FlexMemoryAttention(state.drafter, {size: b.anchors for size, b in data._batches.items()},
                                      profile.data.max_length, state.autocast == "bfloat16")
    state.layer_attends = attend.make_layer_attends
    tracker = fake.phase_tracker()
    tracker.track_external(state.target, state.drafter, getattr(state.optimizer, "optim", state.optimizer))  # ZeRO: its local AdamW
    with tracker:
        plain_step(state, rows, 0, micro_batch, 1.0, mark=lambda phase: setattr(tracker, "phase", phase))
        tracker.phase = "target"
        before = tracker.live_bytes()
        features, layers_run = _target_taps(state, data_batch(state, micro_batch), full_target)
        tap_bytes = features.numel() * features.element_size()
    return _figures(state, tracker, before, tap_bytes, layers_run), tracker


def data_batch(state: TrainState, micro_batch: int) -> MicroBatch:
    return state.data.collate(list(range(micro_batch)), 0)


def _target_taps(state: TrainState, batch: MicroBatch, full_target: bool) -> tuple[torch.Tensor, int]:
    """`extract_taps` over every loaded layer, or over the layers that decide the forward's peak."""
    from dflash.drafter.taps import decoder_layers, extract_taps

    loaded = len(decoder_layers(state.target))
    indices = (list(range(loaded)) if full_target
               else fake.peak_deciding_layers(fake.module_layer_types(state.target), state.layer_ids))
    subset: contextlib.AbstractContextManager[object] = (contextlib.nullcontext() if full_target
                                                         else fake.LayerSubset(state.target, indices))
    with subset:
        features = extract_taps(state.target, batch.input_ids, [indices.index(k) for k in state.layer_ids])
    return features, len(indices)


def _figures(state: TrainState, tracker: fake.PhaseTracking, before: int, tap_bytes: int, layers_run: int) -> TracedFigures:
    from dflash.drafter.taps import decoder_layers

    phases, live = tracker.phase_peaks, tracker.live_by_category()
    trainable = [p for p in state.drafter.parameters() if p.requires_grad]
    return {"target_weights": _bytes(state.target.parameters()) / MIB, "drafter_weights": _bytes(trainable) / MIB,
            "drafter_grads": live["Gradient"] / MIB, "optimizer_states": live["Optstate"] / MIB,
            "tap_features": tap_bytes / MIB, "target_forward": (phases["target"] - before - tap_bytes) / MIB,
            "target_peak": phases["target"] / MIB, "step_peak": phases["micro-batches"] / MIB,
            "sum_peak": phases["gradient sum"] / MIB, "update_peak": phases["update"] / MIB,
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
