"""The memory calibration of a profile, measured on one GPU (`launcher.py calibrate --profile P`).

The worst case the memory model describes (`dflash.memory.model`): every sequence at
`data.max_length` with a loss on every token, so each has the full `train.num_anchors` anchors.
`worst_case_bench` writes that workload as a small Arrow dataset in a scratch directory, points
a copy of the profile at it (`dataclasses.replace`) and builds the training state through the
trainer's own entry point, `dflash.train.setup.build_state`: the profile's target, dtype,
drafter, attention backend, loss chunking and optimizer. `calibrate` then runs warm-up steps at
micro-batch 1 and 2 (flex_attention compiles for both; the AdamW states exist after a first
update), measures the peak allocated memory of one step at each size (`memory.measure_peaks`)
and fits the line (`memory.fit_calibration`). Optionally the calibrated line is held against
measured peaks at larger micro-batches (`check_micro_batches`).

One process, one GPU. With `train.optimizer_sharding = "zero1"` over several ranks, the
optimizer of the measured state keeps only the parameters of the fullest rank's shard (the
partition ZeroRedundancyOptimizer makes: largest tensor first, to the least-loaded rank), so
the measurement holds what one rank of the real run holds: all weights and gradients, one shard
of AdamW states. The calibration's workload key then carries the profile's world size, as the
plan's does.

Runs on CUDA only: a CPU profile is a ConfigError (exit 2: nothing to calibrate); a CUDA
profile on a machine without a CUDA device is CannotTest (exit 125: this machine cannot
measure it, the same meaning as `launcher.py probe`).
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from dflash.memory import model as memory
from launcher_core.errors import CannotTest, ConfigError, RunFailed
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.train.setup import TrainState
    from dflash.train.step import StepStats

CALIBRATION_MICRO_BATCHES = (1, 2)


@dataclass(frozen=True)
class PredictionCheck:
    """The calibrated line and the analytic estimate against a measured peak at one micro-batch."""

    micro_batch: int
    measured_mib: float
    calibrated_mib: float
    estimate_mib: float

    @property
    def calibrated_error(self) -> float:
        return (self.calibrated_mib - self.measured_mib) / self.measured_mib

    @property
    def estimate_error(self) -> float:
        return (self.estimate_mib - self.measured_mib) / self.measured_mib


@dataclass
class CalibrationBench:
    """The worst-case workload of a profile, its training state and the memory model's view of it."""

    profile: Profile                    # the copy pointed at the worst-case dataset
    state: TrainState
    workload: memory.Workload
    world_size: int
    optimizer_shards: int


@dataclass
class CalibrationRun:
    calibration: memory.Calibration
    workload: memory.Workload
    peaks_mib: dict[int, float]
    backend: str
    flex_error: str                     # why flex_attention was given up for SDPA ('' when it ran)
    warmup_s: float
    predictions: list[PredictionCheck] = field(default_factory=list)


# --- preconditions ------------------------------------------------------------------------

def require_cuda(profile: Profile) -> None:
    """A CPU profile has no GPU memory to calibrate; a CUDA profile needs a CUDA device here."""
    if profile.machine.device != "cuda":
        raise ConfigError(f"profile {profile.name}: machine.device is {profile.machine.device!r}; the memory "
                          f"calibration measures GPU memory and needs a profile with machine.device = \"cuda\"")
    import torch

    if not torch.cuda.is_available():
        raise CannotTest(f"profile {profile.name}: no CUDA device here (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); run `launcher.py calibrate` on the GPU node")


# --- the worst-case workload --------------------------------------------------------------

def write_worst_case_dataset(path: Path, rows: int, max_length: int, vocab: int, seed: int = 0) -> Path:
    """`rows` sequences of exactly max_length random token ids (the lower half of the vocabulary,
    so never a mask row), loss on every token: the memory model's worst micro-batch."""
    import numpy as np

    from dflash.data.dataset_io import save_token_rows

    ids = np.random.default_rng(seed).integers(0, max(2, vocab // 2), size=(rows, max_length))
    return save_token_rows(path, [(row.tolist(), [1] * max_length) for row in ids], id_prefix="worst-case")


def worst_case_profile(profile: Profile, dataset: Path, rows: int) -> Profile:
    """The profile on the worst-case dataset: `rows` sequences per step at most, no feature cache.
    Nothing that enters the workload key (shape, lengths, anchors, block, taps, chunk) changes."""
    train = dataclasses.replace(profile.train, global_batch=rows, max_micro_batch=rows, feature_cache=False,
                                max_steps=max(profile.train.max_steps, 1000), warmup_ratio=0.0)
    machine = dataclasses.replace(profile.machine, nproc_per_node=1, nnodes=1)
    return dataclasses.replace(profile, machine=machine, train=train,
                               paths=dataclasses.replace(profile.paths, dataset=str(dataset)))


def worst_case_bench(profile: Profile, scratch: Path, rows: int = 2) -> CalibrationBench:
    """Dataset + state through `build_state` (one rank, no OOM recovery: an OOM must surface)."""
    from dflash.memory.plan import world_size_of
    from dflash.train.dist import WorkerEnv
    from dflash.train.setup import build_state

    world = world_size_of(profile)
    shape = memory.target_shape(profile)
    for stale in (scratch / "worst-case-dataset", scratch / "run"):        # a kept scratch from an earlier run
        shutil.rmtree(stale, ignore_errors=True)
    dataset = write_worst_case_dataset(scratch / "worst-case-dataset", rows, profile.data.max_length, shape.vocab)
    copy = worst_case_profile(profile, dataset, rows)
    state = build_state(copy, scratch / "run", WorkerEnv(0, 1, 0), resume=False, planned_micro_batch=rows)
    state.autobatch = None
    shards = memory.optimizer_shards(profile, world)
    if shards > 1:
        keep_one_optimizer_shard(state, copy, shards)
    return CalibrationBench(copy, state, memory.workload_from_profile(profile, shape, world), world, shards)


def keep_one_optimizer_shard(state: TrainState, profile: Profile, shards: int) -> int:
    """zero1 in one process: the optimizer holds only the fullest rank's parameters. Returns their count."""
    import torch

    from dflash.train.optim import cosine_schedule

    owned = memory.fullest_zero1_shard([p for p in state.drafter.parameters() if p.requires_grad], shards)
    state.optimizer = torch.optim.AdamW(owned, lr=profile.train.lr, weight_decay=profile.train.weight_decay)
    state.scheduler = cosine_schedule(state.optimizer, state.total_steps, profile.train.warmup_ratio)
    return sum(p.numel() for p in owned)


# --- steps and measurements ---------------------------------------------------------------

def step_at(bench: CalibrationBench, micro_batch: int) -> StepStats:
    """One optimizer step over `micro_batch` worst-case sequences in one forward/backward."""
    from dflash.memory.plan import batch_plan
    from dflash.train.step import run_step

    return run_step(bench.state, list(range(micro_batch)), 0, batch_plan(micro_batch, 1, micro_batch))


def warm_up(bench: CalibrationBench, micro_batches: Sequence[int] = CALIBRATION_MICRO_BATCHES) -> str:
    """A step at every measured size first (flex compiles per size; AdamW states are allocated
    lazily). If flex_attention fails (not an OOM), the state goes on with SDPA: returns the error."""
    import torch

    try:
        for micro_batch in micro_batches:
            step_at(bench, micro_batch)
        return ""
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        if bench.state.backend != "flex":
            raise
        failure = f"{type(error).__name__}: {str(error)[:300]}"
    bench.state.backend = "sdpa"
    for micro_batch in micro_batches:
        step_at(bench, micro_batch)
    return failure


def measure(bench: CalibrationBench, micro_batches: Sequence[int]) -> dict[int, float]:
    """Peak allocated MiB of one step per size; an OOM says which size did not fit."""
    import torch

    peaks: dict[int, float] = {}
    for micro_batch in micro_batches:
        try:
            peaks.update(memory.measure_peaks(lambda m: step_at(bench, m), (micro_batch,)))
        except torch.OutOfMemoryError:
            peaks = {}
            break
    if len(peaks) != len(micro_batches):
        raise RunFailed(f"a worst-case step at micro-batch {micro_batch} ({bench.workload.max_length} tokens, "
                        f"{bench.workload.anchors} anchors per sequence) ran out of GPU memory; the calibration "
                        f"needs micro-batch {', '.join(map(str, micro_batches))} to fit one GPU")
    return peaks


def fit(bench: CalibrationBench, peaks: dict[int, float]) -> memory.Calibration:
    import torch

    return memory.fit_calibration(peaks, bench.workload, device_name=torch.cuda.get_device_name(bench.state.device),
                                  torch_version=torch.__version__, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def check_predictions(bench: CalibrationBench, calibration: memory.Calibration,
                      micro_batches: Sequence[int]) -> list[PredictionCheck]:
    """The calibrated line and the analytic estimate against measured peaks at `micro_batches`."""
    calibrated = memory.peak_model(bench.workload, calibration)
    estimated = memory.estimated_peak_model(bench.workload)
    measured = measure(bench, micro_batches)
    return [PredictionCheck(m, peak, calibrated.peak_mib(m), estimated.peak_mib(m)) for m, peak in measured.items()]


# --- the whole procedure ------------------------------------------------------------------

def calibrate(profile: Profile, scratch: Path | None = None,
              check_micro_batches: Sequence[int] = ()) -> CalibrationRun:
    """Warm up, measure at micro-batch 1 and 2, fit; then, if asked, check the line at larger sizes."""
    require_cuda(profile)
    rows = max((*CALIBRATION_MICRO_BATCHES, *check_micro_batches))
    with scratch_directory(scratch) as work:
        bench = worst_case_bench(profile, Path(work), rows)
        started = time.perf_counter()
        flex_error = warm_up(bench)
        warmup_s = time.perf_counter() - started
        peaks = measure(bench, CALIBRATION_MICRO_BATCHES)
        calibration = fit(bench, peaks)
        predictions = check_predictions(bench, calibration, check_micro_batches) if check_micro_batches else []
        return CalibrationRun(calibration, bench.workload, peaks, bench.state.backend, flex_error, warmup_s,
                              predictions)


def scratch_directory(scratch: Path | None) -> Any:
    """The given directory (kept), else a temporary one (removed afterwards)."""
    import contextlib

    if scratch is None:
        return tempfile.TemporaryDirectory(prefix="dflash-calibrate-")  # yields a str
    scratch.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(scratch)


def store_calibration(baseline: Path, calibration: memory.Calibration) -> Path:
    """Write the calibration into the baseline document (atomically; its other keys are kept)."""
    return memory.save_calibration(baseline, calibration)


def iter_prediction_rows(run: CalibrationRun) -> Iterator[dict[str, float]]:
    for check in run.predictions:
        yield {"micro_batch": check.micro_batch, "measured_mib": round(check.measured_mib, 1),
               "calibrated_mib": round(check.calibrated_mib, 1), "calibrated_error": round(check.calibrated_error, 4),
               "estimate_mib": round(check.estimate_mib, 1), "estimate_error": round(check.estimate_error, 4)}
