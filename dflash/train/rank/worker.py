"""Entry point of each torchrun rank: `torchrun --start-method forkserver --run-path
dflash/train/rank/worker.py --profile-json F --run-dir D` (dflash.train.supervisor.launch), or
`python -m dflash.train.rank.worker ...` as a command of its own (train.rank_start).

A forked rank is a fork of the forkserver that imported the agent's `RANK_IMPORTS` once, rather than
a new interpreter importing torch again (benchmarks/results/rank-start-forkserver_cpu-2core_2026-12-06.md);
it reports success the way elastic collects it, by returning (`end_rank`).

Every rank gets the same argv; per-rank values come from RANK / LOCAL_RANK / WORLD_SIZE. Rank 0
writes metrics (JSONL + TensorBoard), checkpoints and the manifest. SIGTERM or SIGINT sets a flag the
ranks agree on after the current step: a checkpoint is saved and the ranks exit cleanly. An exception
is written to `train/failures/rank-R.json` before the rank exits, so the launcher can name the rank
that failed first.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn, Optional, TypedDict

from dflash.train.rank.feature_cache import FeatureCache

if TYPE_CHECKING:
    import torch

    from dflash.memory.launch_plan import RankStart
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import TrainState
    from dflash.train.rank.sharded_checkpoints import Published
    from dflash.train.rank.step import StepStats
    from dflash.train.rank.validation import HeldOut, Validation
    from dflash.train.supervisor.failures import RankFailure
    from launcher_core.schema import Profile

STOPPED_FILE = "stopped.json"
RECORDED_EXIT = 3       # a rank whose failure's cause is recorded with a `kind` (end_recorded_rank) ends with it
RANK_TITLE = "dflash.train.rank.worker"   # a forked rank's process title (ps, pgrep -f): this, its rank and run dir
SETTLE_TIMEOUT_S = 120.0              # a failing rank waits this long at most for the save being written
RETURNED_RANK_EXIT_S = 2.0           # a rank that returned to torchrun's elastic agent ends itself this long after
SCALARS: tuple[Literal["loss", "sim_tau", "tokens_per_s", "lr"], ...] = ("loss", "sim_tau", "tokens_per_s", "lr")


class _MetricsLineBase(TypedDict):
    step: int
    epoch: float
    loss: Optional[float]                   # None: a skipped step (no supervised position: dflash.train.rank.loss_check)
    acc: list[Optional[float]]
    sim_tau: float
    tokens_per_s: float
    lr: float
    mem_mib: list[float]
    predicted_peak_mib: Optional[float]
    micro_batch: int
    time: float
    skipped_steps: int                      # steps skipped without a supervised position so far in the run


class MetricsLine(_MetricsLineBase, total=False):
    """One line of train/metrics.jsonl (a logged step)."""

    feature_cache: dict[str, float]         # train.feature_cache: rows, MiB, hits, misses (rank 0's)
    val_loss: float                         # train.validation_share: the held-out figures at this step
    val_tau: float                          # (dflash.train.rank.validation; tau as eval counts it)
    val_acc: list[Optional[float]]
    selector: dict[str, object]             # DFlash 2: unary / selector losses, recall, acceptance, taus, lift
    skipped: bool                           # this step was skipped: no supervised position in its rows, no update


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one DFlash training rank (started by torchrun)")
    parser.add_argument("--profile-json", required=True, type=Path, help="the resolved profile (JSON)")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    die_with_agent()
    args = parse_args(argv)
    from dflash.train.rank.parallel import WorkerEnv

    env = WorkerEnv.from_env()
    name_forked_rank(env.rank, env.world_size, args.run_dir)
    try:
        code = _train(args, env)
    except BaseException as error:
        if not isinstance(error, SystemExit) and "kind" in write_failure(args.run_dir, env.rank, error):
            end_recorded_rank()
        raise
    end_rank(code)


def end_recorded_rank() -> NoReturn:
    """End a rank whose failure's cause is recorded and named by the launcher (a full disk, an unusable
    loss) with RECORDED_EXIT and no traceback. A forked rank raises SystemExit: multiprocessing turns it into
    the exit code, quietly, after its own clean-up (os._exit there would leave its semaphores to the
    resource tracker's warning); a rank that is a command of its own exits without finalization (end_rank)."""
    if started_by_elastic():
        raise SystemExit(RECORDED_EXIT)
    end_rank(RECORDED_EXIT)
    raise AssertionError("end_rank exits with a non-zero code")


def started_by_elastic() -> bool:
    """True in a rank torchrun's agent started as a function entrypoint (a multiprocessing child:
    `--run-path` with a start method), False in a rank that is a command of its own."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


def end_rank(code: int) -> None:
    """End a rank whose work is done, without the interpreter's finalization (exit_without_finalization).
    A rank forked by torchrun's agent that succeeded returns instead: elastic counts a rank done when its
    return value arrives (one that exits 0 without one is never counted, and the agent waits forever), then
    multiprocessing ends the process with os._exit (no finalization either). The value is written before
    the rank waits for the agent to read it; a closing agent (another rank failed) reads none and only waits for
    the process to go, so the rank ends itself RETURNED_RANK_EXIT_S later, or at the next SIGTERM."""
    from launcher_core.processes import exit_without_finalization

    if code != 0 or not started_by_elastic():
        exit_without_finalization(code)
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_after, args=(RETURNED_RANK_EXIT_S,), name="returned-rank-exit", daemon=True).start()


def _exit_after(seconds: float) -> None:
    from launcher_core.processes import exit_without_finalization

    time.sleep(seconds)
    exit_without_finalization(0)


def name_forked_rank(rank: int, world_size: int, run_dir: Path) -> None:
    """A rank forked from torchrun's forkserver carries the forkserver's command line; give it a title
    that says what it is (`ps`, `pgrep -f RUN_DIR` find it as they found a rank started as a command)."""
    if not started_by_elastic():
        return
    import setproctitle

    setproctitle.setproctitle(f"{RANK_TITLE} rank {rank}/{world_size} --run-dir {run_dir}")


def die_with_agent() -> None:
    """SIGKILL this rank when its torchrun agent ends, however it ends (dflash.train.supervisor.agent): a rank
    never trains on, or writes into the run directory, without its agent and launcher. A rank forked by
    the agent's forkserver dies with the forkserver, which ends on end of file of the agent's pipe; every
    forked rank holds that pipe too (multiprocessing gives it to each child), so after a killed agent the
    launcher ends the ranks (dflash.train.supervisor.launch.kill_run, end_stragglers)."""
    import os

    from dflash.train.supervisor.agent import AGENT_PID_ENV
    from launcher_core.processes import die_with_parent, parent_of

    agent = int(os.environ[AGENT_PID_ENV]) if os.environ.get(AGENT_PID_ENV, "").isdigit() else None
    parent = os.getppid()
    forked_by_server = agent is not None and parent != agent and parent_of(parent) == agent
    die_with_parent(signal.SIGKILL, parent if forked_by_server else agent)


def write_failure(run_dir: Path, rank: int, error: BaseException) -> RankFailure:
    """train/failures/rank-R.json, and the record written. A cause the user acts on is recorded as such,
    with its `kind` and its own message, not the writer's words: a full disk ("disk_full": the DiskFull
    message with the path, bytes needed and free), another fault of the node ("node_fault": a read-only
    filesystem, permission denied, the host out of memory: launcher_core.nodefault) or a loss that cannot
    train ("loss_unusable": the DataError of dflash.train.rank.loss_check)."""
    from launcher_core.fileio import write_json_atomic

    text = "".join(traceback.format_exception(error))
    kind, cause = recorded_cause(run_dir, error)
    record: RankFailure = {"rank": rank, "time": time.time(), "error": str(cause) if cause else repr(error),
                           "traceback": text}
    if kind:
        record["kind"] = kind
    try:
        write_json_atomic(run_dir / "train" / "failures" / f"rank-{rank}.json", record)
    except OSError:
        if kind not in NODE_KINDS:
            raise
        print(f"rank {rank}: {cause}", file=sys.stderr, flush=True)    # no room (or no right) even for the record
    return record


NODE_KINDS = ("disk_full", "node_fault")


def recorded_cause(run_dir: Path, error: BaseException) -> tuple[str, Optional[BaseException]]:
    """(kind, the error to name) of a cause the launcher names by its message; ("", None) for any other."""
    from dflash.train.rank.loss_check import UnusableLoss
    from dflash.train.rank.sharded_checkpoints import WRITING
    from launcher_core.diskfull import disk_full_of
    from launcher_core.nodefault import node_fault_of

    if isinstance(error, UnusableLoss):
        return "loss_unusable", error
    full = disk_full_of(error, run_dir / "train", checkpoint_bytes_needed(run_dir), WRITING)
    if full is not None:
        return "disk_full", full
    fault = node_fault_of(error)
    return ("node_fault", fault) if fault is not None else ("", None)


def checkpoint_bytes_needed(run_dir: Path) -> int | None:
    """What one more checkpoint needs: the size of the newest complete one (None before the first)."""
    from dflash.drafter.checkpoint_files import checkpoints_dir
    from launcher_core.diskfull import tree_bytes

    complete = [p for p in checkpoints_dir(run_dir).glob("step-*") if p.is_dir()]
    newest = max(complete, key=lambda p: p.stat().st_mtime, default=None)
    return tree_bytes(newest) if newest is not None else None


def _train(args: argparse.Namespace, env: WorkerEnv) -> int:
    from dflash.train.rank.parallel import barrier, close_process_group, init_process_group, rank_device
    from dflash.train.rank.setup import build_state
    from dflash.train.supervisor.heartbeat import RankHeartbeat
    from launcher_core.profile import profile_from_json

    stop = StopFlag.install()
    profile = profile_from_json(args.profile_json)
    heartbeat = RankHeartbeat.from_env(args.run_dir, env.rank, profile.train.heartbeat_timeout_s,
                                       profile.train.stuck_floor_s).start()
    device = rank_device(profile.machine.device, env)
    init_process_group(profile.machine.backend, device, timeout_s=profile.train.collective_timeout_s)
    try:
        start = apply_rank_plan(args.run_dir, env, device)
        state = build_state(profile, args.run_dir, env, resume=args.resume,
                            planned_micro_batch=start.micro_batch if start else None)
        state.predicted_peak_mib = start.predicted_peak_mib if start else None
        state.progress = heartbeat.progress
        install_fault_injection(state)
        train_loop(state, profile, args.run_dir, stop)
        barrier()      # ranks leave together: a rank tearing gloo down while a peer still writes aborts it
    finally:
        close_process_group()
    return 0


def install_fault_injection(state: TrainState) -> None:
    """The debugging option of tests and drills (dflash.train.rank.faults: DFLASH_INJECT_OOM, DFLASH_INJECT_STALL,
    DFLASH_FAIL_RANK), read once here; a plain run has none, and nothing is installed."""
    from dflash.train.rank.faults import FaultInjection

    recovered = state.autobatch.reductions if state.autobatch is not None else []
    faults = FaultInjection.from_env(state.env.rank, recovered=recovered)
    if faults is not None:
        faults.install(state.progress, state.drafter, lambda: state.micro_batch)


def apply_rank_plan(run_dir: Path, env: WorkerEnv, device: torch.device) -> RankStart | None:
    """This rank's line of train/plan.json (None without one); on CUDA the allocator is capped to
    the rank's budget, so it cannot take memory another process on that GPU was promised. The cap
    holds reserved memory; the plan fitted the allocated peak times the reserve ratio into the same
    budget (dflash.memory.reserve), so the allocator's reserve lies inside the cap."""
    from dflash.memory.launch_plan import allocator_fraction, read_rank_start

    start = read_rank_start(run_dir, env.rank)
    fraction = allocator_fraction(start) if start else None
    if start is not None and fraction is not None and device.type == "cuda":
        import torch

        torch.cuda.set_per_process_memory_fraction(fraction, device)
        planned = f"; planned reserved peak {start.predicted_reserved_mib:.0f} MiB" if start.predicted_reserved_mib else ""
        print(f"rank {env.rank}: allocator capped to {start.budget_mib:.0f} MiB ({fraction:.3f} of the GPU){planned}",
              flush=True)
    return start


class StopFlag:
    """Set by SIGTERM or SIGINT (`signal`: the first one's name); ranks agree on it (all_reduce MAX) between steps."""

    def __init__(self) -> None:
        self.requested = False
        self.signal = ""

    @classmethod
    def install(cls) -> "StopFlag":
        flag = cls()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, flag.set)
        return flag

    def set(self, signum: int, _frame: object) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        self.requested = True

    def agreed(self) -> bool:
        from dflash.train.rank.parallel import any_rank

        return any_rank(self.requested)


def train_loop(state: TrainState, profile: Profile, run_dir: Path, stop: StopFlag) -> None:
    from dflash.train.rank.loss_check import check_step
    from dflash.train.rank.parallel import gather_memory_mib
    from dflash.train.rank.sharded_checkpoints import note_initial_weights
    from dflash.train.rank.step import run_next_step
    from dflash.train.rank.validation import start_validation

    total = state.total_steps
    note_initial_weights(state)
    log = MetricsLog(run_dir, state, profile) if state.env.is_main else None
    validation = start_validation(state, profile, run_dir)     # None without train.validation_share
    saves = CheckpointSaves(state, profile, run_dir, validation)
    try:
        while state.step < total:
            stats, epoch = run_next_step(state)
            check_step(state, stats, profile)     # every rank alike, before these weights reach a save
            saves.poll()
            held_out = validation.after_step(state) if validation else None     # every rank, when due
            state.progress.enter("reduction")
            if state.step % max(1, profile.train.log_every_steps) == 0 or state.step == total:
                state.mem_mib = gather_memory_mib(state.device)
            if log:
                log.record(state, stats, epoch, held_out)
            if stop.agreed():
                saves.save(stopped=stop.signal or "a signal")
                return
            if saves.due() and state.step < total:
                saves.save()
        saves.save(final=True)
        if validation and state.env.is_main:
            validation.finish(run_dir)
        if state.env.is_main and isinstance(state.feature_cache, FeatureCache):
            state.feature_cache.remove()      # every rank is past the final barrier
    except BaseException:
        saves.settle()                        # a save being written is finished, not lost with the rank
        raise
    finally:
        if log:
            log.close()


class CheckpointSaves:
    """When the run saves (every train.save_every_steps, and train.save_every_minutes after the last save,
    whichever comes first), how (train.async_save: shards written while the ranks train on; the last save
    and a SIGTERM stop's are synchronous, the last with model.safetensors), and what follows a checkpoint
    put in place: rank 0 records it in the manifest and applies train.keep_checkpoints."""

    def __init__(self, state: TrainState, profile: Profile, run_dir: Path, validation: Optional[Validation]):
        from dflash.train.rank.sharded_checkpoints import AsyncCheckpointer

        self.state, self.train, self.run_dir, self.validation = state, profile.train, run_dir, validation
        self.writer = AsyncCheckpointer(run_dir, state.env) if profile.train.async_save else None
        self.last_save = time.monotonic()

    def due(self) -> bool:
        """Every rank, after each step: the same answer on all (the clock's through all_reduce MAX)."""
        from dflash.train.rank.parallel import any_rank

        by_steps = self.state.step % self.train.save_every_steps == 0
        if self.train.save_every_minutes <= 0:
            return by_steps
        late = any_rank(time.monotonic() - self.last_save >= 60 * self.train.save_every_minutes)
        return by_steps or late

    def poll(self) -> None:
        if self.writer is not None:
            self._placed(self.writer.poll(self.state))

    def save(self, *, final: bool = False, stopped: str = "") -> None:
        """Every rank: a collective (dflash.train.rank.sharded_checkpoints); `stopped`: the signal that stopped the run."""
        from dflash.train.rank.sharded_checkpoints import save_training_checkpoint

        self.last_save = time.monotonic()
        self.state.progress.enter("save")
        self.state.optimizer.zero_grad(set_to_none=True)     # no gradients held while the shards are copied
        if self.writer is not None:
            self._placed(self.writer.wait(self.state))
            if not (final or stopped):
                self.writer.start(self.state)
                return
        where = save_training_checkpoint(self.state, self.run_dir, with_weights=final)
        self._recorded(where, final=final)
        if stopped and self.state.env.is_main:
            from launcher_core.fileio import write_json_atomic

            write_json_atomic(self.run_dir / "train" / STOPPED_FILE, {"step": self.state.step, "checkpoint": str(where)})
            print(f"stopped by {stopped} after step {self.state.step}; checkpoint {where}", flush=True)

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """A rank that fails (an OOM, a dead peer) lets the save being written finish before it exits, so the
        restart resumes from it: every rank's shards are then written and rank 0 puts it in place if it can
        (otherwise the launcher does: dflash.train.supervisor.resume.remove_partial_saves). The save's own failure is
        not this rank's: it is ignored."""
        if self.writer is None:
            return
        try:
            self._placed(self.writer.wait(self.state, timeout_s))
        except Exception:       # noqa: BLE001 - a save that cannot finish stays a partial one; the first error stands
            pass

    def _placed(self, published: Optional[Published]) -> None:
        if published is not None:
            print(published.line(), flush=True)
            self._recorded(published.path, final=False)

    def _recorded(self, where: Path, *, final: bool) -> None:
        """Rank 0: the manifest names the checkpoint, then train.keep_checkpoints is applied (dflash.train.rank.retention)."""
        from dflash.train.rank.retention import prune_checkpoints
        from launcher_core.manifest import update_stage

        if not self.state.env.is_main:
            return
        update_stage(self.run_dir, "train", "done" if final else "running", steps=self.state.step,
                     last_loss=self.state.last_loss, checkpoint=str(where), skipped_steps=self.state.skipped_steps)
        if self.train.keep_checkpoints <= 0:
            return
        best = self.validation.log.best() if self.validation and self.validation.log else None
        done = prune_checkpoints(self.run_dir, self.train.keep_checkpoints, best.step if best else None)
        if done.removed:
            print(done.line(), flush=True)


class MetricsLog:
    """Rank 0: metrics.jsonl (one line per logged step), TensorBoard events, and train/progress.json
    after every step, from which the launcher draws the one progress bar (dflash.train.supervisor.progress)."""

    def __init__(self, run_dir: Path, state: TrainState, profile: Profile):
        from torch.utils.tensorboard import SummaryWriter

        self.train_dir = run_dir / "train"
        self.path = run_dir / "train" / "metrics.jsonl"
        self.every = max(1, profile.train.log_every_steps)
        truncate_metrics(self.path, state.step)
        self.writer = SummaryWriter(str(run_dir / "train" / "tb"), purge_step=state.step + 1)
        self.val_tau: Optional[float] = None      # the last held-out tau, shown on the progress line

    def record(self, state: TrainState, stats: StepStats, epoch: int, held_out: Optional[HeldOut] = None) -> None:
        from dflash.train.supervisor.progress import TrainProgress, write_progress

        state.last_loss = state.last_loss if stats.skipped else stats.loss
        self.val_tau = held_out.tau if held_out is not None else self.val_tau
        shown = (state.last_loss if state.last_loss is not None else math.nan, stats.sim_tau)
        write_progress(self.train_dir, TrainProgress(state.step, state.total_steps, *shown, self.val_tau))
        due = state.step % self.every == 0 or state.step == state.total_steps
        if not (due or held_out is not None or stats.skipped):     # a skipped step is always on record
            return
        line = metrics_line(state, stats, held_out)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")
        self.writer.add_scalar("train/skipped_steps", state.skipped_steps, state.step)
        for key in SCALARS:
            if line[key] is not None:
                self.writer.add_scalar(f"train/{key}", line[key], state.step)
        for k, value in enumerate(stats.acc, start=1):
            self.writer.add_scalar(f"acc/acc_{k}", value, state.step)
        if held_out is not None:
            self.writer.add_scalar("val/loss", held_out.loss, state.step)
            self.writer.add_scalar("val/tau", held_out.tau, state.step)
        if stats.selector is not None:
            for name in ("unary_loss", "selector_loss", "unary_tau", "selector_tau", "lift"):
                self.writer.add_scalar(f"selector/{name}", getattr(stats.selector, name), state.step)

    def close(self) -> None:
        self.writer.close()


def metrics_line(state: TrainState, stats: StepStats, held_out: Optional[HeldOut] = None) -> MetricsLine:
    line: MetricsLine = {
        "step": state.step, "epoch": round(state.step / state.data.steps_per_epoch, 4),
        "loss": None if stats.skipped else stats.loss, "acc": [None if math.isnan(a) else a for a in stats.acc],
        "sim_tau": stats.sim_tau, "tokens_per_s": stats.tokens / max(stats.seconds, 1e-9),
        "lr": state.optimizer.param_groups[0]["lr"], "mem_mib": state.mem_mib,
        "predicted_peak_mib": state.predicted_peak_mib,
        "micro_batch": state.micro_batch, "time": time.time(), "skipped_steps": state.skipped_steps,
    }
    if stats.skipped:
        line["skipped"] = True
    if isinstance(state.feature_cache, FeatureCache):   # train.feature_cache: files on the node; hits and misses of rank 0
        line["feature_cache"] = state.feature_cache.stats()
    if held_out is not None:
        line["val_loss"], line["val_tau"] = held_out.loss, held_out.tau
        line["val_acc"] = [None if math.isnan(a) else a for a in held_out.acc]
    if stats.selector is not None:
        line["selector"] = stats.selector.to_json()
    return line


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only lines up to `step` (a resumed run rewrites what came after its checkpoint)."""
    from launcher_core.fileio import write_text_atomic

    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and (line_step := _line_step(line)) is not None and line_step <= step]
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def _line_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


if __name__ == "__main__":
    main()
