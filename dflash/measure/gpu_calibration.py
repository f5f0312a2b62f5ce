"""The memory calibration of a profile, measured on GPUs (`launcher.py calibrate --profile P`).

The workload is the memory model's worst case (every sequence at `data.max_length` with a loss on
every token: `worst_case_bench` writes it as a small Arrow dataset) and the state and step are the
trainer's own (`dflash.train.rank.setup.build_state`, `run_step`), so what is measured is what
training runs. After warm-up steps at each size (flex compiles per size; AdamW's states exist after
a first update) it measures the allocated peak of one step of two micro-batches
(`MICRO_BATCHES_PER_STEP`: the accumulated gradients are in it) at micro-batch 1 and 2 and fits the
line (dflash.memory.calibration_record). The reserve ratio comes from steps of differently shaped
micro-batches without emptying the cache (`measure_reserve`), under the profile's allocator setting.

A profile of 2 or more ranks is calibrated on 2 ranks where this node has 2 GPUs, so FSDP2's
collectives run between them, else in one process; the calibration records how many, and the plan
corrects its estimate for N ranks by what it missed there (dflash.memory.peak_estimate.peak_model). CUDA
only: a CPU profile is a ConfigError (exit 2), a machine without a CUDA device CannotTest (exit 125).
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from dflash.measure.peaks import measure_allocator_peaks, measure_step_peaks
from dflash.memory import peak_estimate as memory
from dflash.memory.calibration_record import AllocatorPeaks, Calibration, fit_calibration, save_calibration
from dflash.memory.target_shape import target_shape
from launcher_core.errors import CannotTest, ConfigError, RunFailed
from launcher_core.processes import free_port
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import TrainState
    from dflash.train.rank.step import StepStats
    from envcheck.allocator import AllocatorSetting

CALIBRATION_MICRO_BATCHES = (1, 2)
MICRO_BATCHES_PER_STEP = 2          # each measured step accumulates: the earlier micro-batch's gradients are alive
VARIED_LENGTH_FRACTIONS = (0.25, 0.75, 0.5)   # the shorter shapes of measure_reserve, in the order they run


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
    workload: memory.Workload           # the profile's (its world size)
    world_size: int
    ranks: int = 1                      # processes the bench runs on: the ranks the drafter is sharded over
    start_s: float = 0.0                # build_state: the target loaded, the drafter built and sharded


@dataclass
class MeasuredPeaks:
    """What the measuring process(es) found (rank 0's, or the larger of the ranks')."""

    peaks_mib: dict[int, float]
    check_peaks_mib: dict[int, float]
    backend: str
    flex_error: str
    warmup_s: float
    device_name: str
    reserved_mib: dict[int, float] = field(default_factory=dict)    # peak reserved at each measured size
    varied: AllocatorPeaks | None = None                            # measure_reserve's peaks
    start_s: float = 0.0                                            # the bench's build_state (the slowest rank's)


@dataclass
class CalibrationRun:
    calibration: Calibration
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

def varied_lengths(max_length: int) -> tuple[int, ...]:
    """The shorter sequence lengths measure_reserve steps through (distinct, below max_length)."""
    lengths = (max(2, int(max_length * fraction)) for fraction in VARIED_LENGTH_FRACTIONS)
    return tuple(dict.fromkeys(length for length in lengths if length < max_length))


def write_worst_case_dataset(path: Path, rows: int, max_length: int, vocab: int, seed: int = 0,
                             varied_rows: int = 0) -> Path:
    """`rows` sequences of exactly max_length random token ids (the lower half of the vocabulary,
    so never a mask row), loss on every token: the memory model's worst micro-batch. Then
    `varied_rows` rows of each of `varied_lengths(max_length)` (rows `varied_row_range`)."""
    import numpy as np

    from dflash.data.dataset_io import save_token_rows

    generator, high = np.random.default_rng(seed), max(2, vocab // 2)
    shapes = [(rows, max_length)] + [(varied_rows, length) for length in varied_lengths(max_length) if varied_rows]
    ids = [row.tolist() for count, length in shapes for row in generator.integers(0, high, size=(count, length))]
    return save_token_rows(path, [(row, [1] * len(row)) for row in ids], id_prefix="worst-case")


def varied_row_range(worst_rows: int, varied_rows: int, shape: int) -> list[int]:
    """The dataset rows of the `shape`-th shorter length (write_worst_case_dataset's order)."""
    start = worst_rows + shape * varied_rows
    return list(range(start, start + varied_rows))


def worst_case_profile(profile: Profile, dataset: Path, rows: int, ranks: int = 1) -> Profile:
    """The profile on the worst-case dataset: `rows` sequences per rank and step at most, `ranks`
    ranks, no feature cache, no row held out for validation (every worst-case row trains). Nothing
    that enters the workload key (shape, lengths, anchors, block, taps, chunk) changes."""
    train = dataclasses.replace(profile.train, global_batch=rows * ranks, max_micro_batch=rows, feature_cache=False,
                                max_steps=max(profile.train.max_steps, 1000), warmup_ratio=0.0, validation_share=0.0)
    machine = dataclasses.replace(profile.machine, nproc_per_node=ranks, nnodes=1)
    return dataclasses.replace(profile, machine=machine, train=train,
                               paths=dataclasses.replace(profile.paths, dataset=str(dataset)))


def worst_case_bench(profile: Profile, scratch: Path, rows: int = 2, env: WorkerEnv | None = None) -> CalibrationBench:
    """Dataset + state through `build_state` (no OOM recovery: an OOM must surface), `rows`
    sequences per rank and step. `env`: this rank of a multi-rank calibration (joined to its
    process group), default one process."""
    from dflash.memory.budget import world_size_of
    from dflash.train.rank.parallel import WorkerEnv, barrier
    from dflash.train.rank.setup import build_state

    env = env or WorkerEnv(0, 1, 0)
    world = world_size_of(profile)
    shape = target_shape(profile)
    dataset = scratch / "worst-case-dataset"
    if env.is_main:
        for stale in (dataset, scratch / "run"):        # a kept scratch from an earlier run
            shutil.rmtree(stale, ignore_errors=True)
        write_worst_case_dataset(dataset, rows * env.world_size, profile.data.max_length, shape.vocab,
                                 varied_rows=rows)
    barrier()
    copy = worst_case_profile(profile, dataset, rows, env.world_size)
    started = time.perf_counter()
    state = build_state(copy, scratch / "run", env, resume=False, planned_micro_batch=rows)
    start_s = time.perf_counter() - started
    state.autobatch = None
    return CalibrationBench(copy, state, memory.workload_from_profile(profile, shape, world), world, env.world_size,
                            start_s)


def calibration_ranks(profile: Profile, cuda_devices: int) -> int:
    """2 when the profile trains on 2+ ranks and this node has 2+ GPUs (FSDP2's collectives run
    between them), else 1."""
    from dflash.memory.budget import world_size_of

    return 2 if world_size_of(profile) >= 2 and cuda_devices >= 2 else 1


# --- steps and measurements ---------------------------------------------------------------

def step_at(bench: CalibrationBench, micro_batch: int) -> StepStats:
    """One optimizer step of two micro-batches of `micro_batch` worst-case sequences each."""
    from dflash.memory.budget import batch_plan
    from dflash.train.rank.step import run_step

    rows = MICRO_BATCHES_PER_STEP * micro_batch
    return run_step(bench.state, list(range(rows)), 0, batch_plan(rows, 1, micro_batch))


def varied_step_at(bench: CalibrationBench, micro_batch: int, shape: int) -> StepStats:
    """One optimizer step of two micro-batches of `micro_batch` sequences of the `shape`-th shorter length."""
    from dflash.memory.budget import batch_plan
    from dflash.train.rank.step import run_step

    rows = MICRO_BATCHES_PER_STEP * micro_batch
    worst = bench.profile.train.global_batch            # worst_case_profile: rows per rank x ranks
    shaped = varied_row_range(worst, worst // bench.ranks, shape)[:rows]
    return run_step(bench.state, shaped, 0, batch_plan(len(shaped), 1, micro_batch))


def run_varied_shapes(bench: CalibrationBench, micro_batch: int) -> list[StepStats]:
    """A step of every shorter length, then the worst case, one after the other (nothing emptied between)."""
    shapes = range(len(varied_lengths(bench.workload.max_length)))
    return [*(varied_step_at(bench, micro_batch, shape) for shape in shapes), step_at(bench, micro_batch)]


def measure_reserve(bench: CalibrationBench, micro_batch: int) -> AllocatorPeaks:
    """Peak allocated and reserved over steps of differently shaped micro-batches (run_varied_shapes),
    from an emptied cache: how much the allocator reserves beyond what tensors hold."""
    import torch

    try:
        return measure_allocator_peaks(lambda: run_varied_shapes(bench, micro_batch))
    except torch.OutOfMemoryError:
        raise RunFailed(f"steps of differently shaped micro-batches of {micro_batch} ran out of GPU memory while "
                        f"measuring the allocator's reserve") from None


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
    return {m: peaks.allocated_mib for m, peaks in measure_steps(bench, micro_batches).items()}


def measure_steps(bench: CalibrationBench, micro_batches: Sequence[int]) -> dict[int, AllocatorPeaks]:
    """Peak allocated and reserved MiB of one step per size; an OOM says which size did not fit."""
    import torch

    def one_step(size: int) -> None:
        step_at(bench, size)

    peaks: dict[int, AllocatorPeaks] = {}
    for micro_batch in micro_batches:
        try:
            peaks.update(measure_step_peaks(one_step, (micro_batch,)))
        except torch.OutOfMemoryError:
            peaks = {}
            break
    if len(peaks) != len(micro_batches):
        raise RunFailed(f"a worst-case step at micro-batch {micro_batch} ({bench.workload.max_length} tokens, "
                        f"{bench.workload.anchors} anchors per sequence) ran out of GPU memory; the calibration "
                        f"needs micro-batch {', '.join(map(str, micro_batches))} to fit one GPU")
    return peaks


def fit(bench: CalibrationBench, peaks: dict[int, float], device_name: str = "") -> Calibration:
    import torch

    return fit_calibration(peaks, bench.workload, torch_version=torch.__version__,
                           device_name=device_name or torch.cuda.get_device_name(bench.state.device),
                           measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), world_size=bench.ranks,
                           micro_batches_per_step=MICRO_BATCHES_PER_STEP)


def check_predictions(bench: CalibrationBench, calibration: Calibration,
                      micro_batches: Sequence[int]) -> list[PredictionCheck]:
    """The calibrated line and the analytic estimate against measured peaks at `micro_batches`."""
    return predictions_of(bench.workload, calibration, measure(bench, micro_batches))


def predictions_of(workload: memory.Workload, calibration: Calibration,
                   measured: dict[int, float]) -> list[PredictionCheck]:
    """The calibrated line and the estimate of the MEASURED step (its ranks, two micro-batches) at each size."""
    return [PredictionCheck(m, peak, *_predicted_at(workload, calibration, m)) for m, peak in measured.items()]


def _predicted_at(workload: memory.Workload, calibration: Calibration, micro_batch: int) -> tuple[float, float]:
    measured_step = dataclasses.replace(workload, world_size=calibration.world_size,
                                        rank_share=MICRO_BATCHES_PER_STEP * micro_batch)
    return (memory.peak_model(measured_step, calibration).peak_mib(micro_batch),
            memory.estimated_peak_model(measured_step).peak_mib(micro_batch))


# --- the whole procedure ------------------------------------------------------------------

def measure_bench(bench: CalibrationBench, check_micro_batches: Sequence[int] = ()) -> MeasuredPeaks:
    """Warm up, measure at micro-batch 1 and 2, the reserve over differently shaped micro-batches of 2,
    then the check sizes (every rank the same steps)."""
    import torch

    started = time.perf_counter()
    flex_error = warm_up(bench)
    warmup_s = time.perf_counter() - started
    steps = measure_steps(bench, CALIBRATION_MICRO_BATCHES)
    varied = measure_reserve(bench, CALIBRATION_MICRO_BATCHES[-1])
    checks = measure(bench, check_micro_batches) if check_micro_batches else {}
    return MeasuredPeaks({m: p.allocated_mib for m, p in steps.items()}, checks, bench.state.backend, flex_error,
                         warmup_s, torch.cuda.get_device_name(bench.state.device),
                         reserved_mib={m: p.reserved_mib for m, p in steps.items()}, varied=varied,
                         start_s=bench.start_s)


def calibrate(profile: Profile, scratch: Path | None = None,
              check_micro_batches: Sequence[int] = ()) -> CalibrationRun:
    """Measure the worst case on 1 or 2 ranks (`calibration_ranks`), fit; check the line if asked."""
    import torch

    from dflash.train.supervisor.launch_checks import validate_profile_for_launch

    require_cuda(profile)
    allocator = apply_allocator_setting(profile)
    validate_profile_for_launch(profile)        # the profile against its target, as `train` checks it
    rows = MICRO_BATCHES_PER_STEP * max((*CALIBRATION_MICRO_BATCHES, *check_micro_batches))
    ranks = calibration_ranks(profile, torch.cuda.device_count())
    with scratch_directory(scratch) as work:
        if ranks == 1:
            measured = measure_bench(worst_case_bench(profile, Path(work), rows), check_micro_batches)
        else:
            measured = measure_on_ranks(profile, Path(work), rows, check_micro_batches, ranks)
    workload = memory.workload_from_profile(profile, target_shape(profile))
    calibration = fit_calibration(measured.peaks_mib, workload, measured.reserved_mib, measured.varied,
                                  device_name=measured.device_name, torch_version=torch.__version__,
                                  measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), world_size=ranks,
                                  micro_batches_per_step=MICRO_BATCHES_PER_STEP,
                                  expandable_segments=allocator.expandable, start_s=round(measured.start_s, 1))
    return CalibrationRun(calibration, workload, measured.peaks_mib, measured.backend, measured.flex_error,
                          measured.warmup_s, predictions_of(workload, calibration, measured.check_peaks_mib))


# --- 2 ranks, one per GPU -----------------------------------------------------------------

def measure_on_ranks(profile: Profile, work: Path, rows: int, check_micro_batches: Sequence[int],
                     ranks: int) -> MeasuredPeaks:
    """The bench on `ranks` processes (GPU r for rank r, the profile's backend), every step the
    trainer's with the real gradient sum between them; each rank's peaks, the larger kept."""
    import torch.multiprocessing as mp

    from launcher_core.fileio import read_json

    mp.spawn(calibration_rank, args=(ranks, free_port(), profile, str(work), rows, tuple(check_micro_batches)),
             nprocs=ranks, join=True)
    found = [read_json(work / f"calibration-rank-{rank}.json") for rank in range(ranks)]
    failed = [document["error"] for document in found if "error" in document]
    if failed:
        raise RunFailed(failed[0])
    peaks, checks, reserved = (_larger_peaks([d[key] for d in found])
                               for key in ("peaks_mib", "check_peaks_mib", "reserved_mib"))
    varied = max((AllocatorPeaks(**d["varied"]) for d in found if d.get("varied")), key=lambda p: p.ratio, default=None)
    return MeasuredPeaks(peaks, checks, found[0]["backend"], found[0]["flex_error"], found[0]["warmup_s"],
                         found[0]["device_name"], reserved, varied, max(float(d.get("start_s", 0.0)) for d in found))


def _larger_peaks(by_rank: list[dict[str, float]]) -> dict[int, float]:
    return {int(m): max(float(peaks[m]) for peaks in by_rank) for m in by_rank[0]}


def calibration_rank(rank: int, ranks: int, port: int, profile: Profile, work: str, rows: int,
                     check_micro_batches: tuple[int, ...],
                     measure_step: Callable[[CalibrationBench], dict[str, object]] | None = None) -> None:
    """One rank of a multi-rank calibration: join the group, build the bench, measure, write
    `calibration-rank-R.json` (or the RunFailed message). `measure_step(bench)`: what to run
    instead of the GPU measurement (returns a JSON-able dict; the CPU tests' hook)."""
    import os

    import torch.distributed as torch_dist

    from dflash.train.rank.parallel import WorkerEnv, close_process_group, rank_device
    from launcher_core.fileio import write_json_atomic
    from launcher_core.processes import exit_without_finalization

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank))
    env = WorkerEnv.from_env()
    device = rank_device(profile.machine.device, env)
    torch_dist.init_process_group(profile.machine.backend, rank=rank, world_size=ranks,
                                  device_id=device if device.type == "cuda" else None)
    try:
        bench = worst_case_bench(profile, Path(work), rows, env)
        result: dict[str, object] = (measure_step(bench) if measure_step
                                     else dataclasses.asdict(measure_bench(bench, check_micro_batches)))
    except RunFailed as error:              # an OOM of the worst case, said in the parent's words
        result = {"error": str(error)}
    write_json_atomic(Path(work) / f"calibration-rank-{rank}.json", result)
    close_process_group()
    exit_without_finalization(0)


def apply_allocator_setting(profile: Profile) -> AllocatorSetting:
    """This process's CUDA allocator as the profile's ranks run it (envcheck.allocator: expandable segments
    unless memory.expandable_segments is off or the user's own variable says otherwise), returned for the
    calibration's record. Called before this process allocates CUDA memory: torch reads the variable when
    its allocator is first configured."""
    import os

    from envcheck.allocator import allocator_setting, apply_allocator_env

    setting = allocator_setting(profile.memory.expandable_segments, os.environ).require()
    apply_allocator_env(setting, os.environ)
    return setting


def scratch_directory(scratch: Path | None) -> contextlib.AbstractContextManager[str | Path]:
    """The given directory (kept), else a temporary one (removed afterwards)."""
    if scratch is None:
        return tempfile.TemporaryDirectory(prefix="dflash-calibrate-")  # yields a str
    scratch.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(scratch)


def store_calibration(baseline: Path, calibration: Calibration) -> Path:
    """Write the calibration into the baseline document (atomically; its other keys are kept)."""
    return save_calibration(baseline, calibration)


def iter_prediction_rows(run: CalibrationRun) -> Iterator[dict[str, float]]:
    for check in run.predictions:
        yield {"micro_batch": check.micro_batch, "measured_mib": round(check.measured_mib, 1),
               "calibrated_mib": round(check.calibrated_mib, 1), "calibrated_error": round(check.calibrated_error, 4),
               "estimate_mib": round(check.estimate_mib, 1), "estimate_error": round(check.estimate_error, 4)}
