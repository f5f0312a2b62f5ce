"""Launching training: a pure builder of the torchrun (argv, env), and `run_training`.

`build_torchrun_command` starts nothing: one node -> a c10d rendezvous on the store the launcher
hosts on 127.0.0.1 (dflash.train.supervisor.rendezvous: the agent joins it as a client, nothing listens on
another interface), `--nproc-per-node P`; several nodes (machine.nnodes > 1) -> a c10d
rendezvous at machine.rdzv_endpoint, the same command on every node. Workers get the resolved
profile as JSON in the run directory, so every rank and node trains exactly the same configuration.

The agent is torchrun run through `dflash.train.supervisor.agent`: it and its ranks never outlive the
launcher (a pipe whose end of file stops them, the ranks' parent-death signal), and it records
which ranks torchrun saw fail. `run_training` holds the run directory's lock for the whole run,
watches the ranks' heartbeats (dflash.train.supervisor.heartbeat), and ends with one message naming the
cause (dflash.train.supervisor.failures).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Mapping

from dflash.train.supervisor.failures import RunEnd
from dflash.train.supervisor.progress import ProgressBar
from dflash.train.supervisor.rendezvous import LOOPBACK_HOST, STORE_ENV, LoopbackStore, single_node_env
from envcheck.allocator import ALLOC_CONF_VARIABLES, AllocatorSetting, allocator_setting, apply_allocator_env
from launcher_core.errors import ConfigError, Interrupted, PreflightFailed, RunFailed
from launcher_core.paths import REPO_ROOT
from launcher_core.processes import child_tempdir, child_tempdir_env
from launcher_core.profile import profile_to_json
from launcher_core.redact import redact_argv, redact_env
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.data.rendering_record import TrainingDataRecord
    from dflash.memory.budget import Plan
    from dflash.memory.launch_plan import PlanInputs
    from dflash.train.supervisor.heartbeat import Stall
    from dflash.train.supervisor.watchdog import Stuck, StuckBound


@dataclass(frozen=True)
class TrainPaths:
    run_dir: Path

    @property
    def train_dir(self) -> Path:
        return self.run_dir / "train"

    @property
    def profile_json(self) -> Path:
        return self.train_dir / "profile.json"

    @property
    def logs(self) -> Path:
        return self.train_dir / "logs"

    @property
    def failures(self) -> Path:
        return self.train_dir / "failures"


def worker_threads(profile: Profile) -> int:
    """OMP threads per rank: the node's cores shared by its ranks (GPU ranks: 1 is plenty... at least 1)."""
    from envcheck.host import cpu_count

    cores = cpu_count()
    return max(1, cores // max(1, profile.machine.nproc_per_node))


def build_torchrun_command(profile: Profile, run_dir: Path, *, resume: bool = False, python: str | None = None,
                           base_env: Mapping[str, str] | None = None,
                           extra_env: Mapping[str, str] | None = None,
                           store: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the torchrun that trains `profile` into `run_dir`; starts nothing.

    One node: `store` is the host:port of the launcher's loopback store (`LoopbackStore`);
    None names it `127.0.0.1:PORT` (what `train --print-command` shows)."""
    machine, paths = profile.machine, TrainPaths(Path(run_dir))
    store = store or SINGLE_NODE_STORE_PLACEHOLDER
    argv = [python or sys.executable, "-m", "dflash.train.supervisor.agent", *_rendezvous_args(profile, store),
            "--nproc-per-node", str(machine.nproc_per_node), "--max-restarts", str(profile.train.max_restarts),
            "--log-dir", str(paths.logs), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
            *rank_start_args(profile), "--profile-json", str(paths.profile_json), "--run-dir", str(paths.run_dir)]
    if resume:
        argv.append("--resume")
    single_node = {} if machine.nnodes > 1 else single_node_env(store)
    return argv, _worker_env(profile, base_env, {**single_node, **(extra_env or {})}, paths)


# Ranks are forks of torchrun's forkserver, which imports what a rank needs once (the agent's
# RANK_IMPORTS), rather than interpreters of their own importing torch again: torchrun runs a
# `--run-path` script as a function entrypoint (benchmarks/results/rank-start-forkserver_cpu-2core_2026-12-06.md).
WORKER_SCRIPT = REPO_ROOT / "dflash" / "train" / "rank" / "worker.py"
SINGLE_NODE_STORE_PLACEHOLDER = "127.0.0.1:PORT"   # the port LoopbackStore takes, known only at launch


def rank_start_args(profile: Profile) -> list[str]:
    """torchrun's arguments that start the ranks (train.rank_start): forks of its forkserver running the
    worker script as a function entrypoint, or each rank as a command of its own."""
    if profile.train.rank_start == "command":
        return ["-m", "dflash.train.rank.worker"]
    return ["--start-method", "forkserver", "--run-path", str(WORKER_SCRIPT)]


def _rendezvous_args(profile: Profile, store: str) -> list[str]:
    machine = profile.machine
    if machine.nnodes <= 1:  # the launcher's store, loopback only (docs/train.md, "Rendezvous: loopback only")
        return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", store,
                "--rdzv-conf", "is_host=false", "--local-addr", LOOPBACK_HOST,
                "--rdzv-id", f"dflash-{profile.name}"]
    assert machine.rdzv_endpoint, "the profile schema holds machine.rdzv_endpoint for several nodes"
    return ["--nnodes", str(machine.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", machine.rdzv_endpoint,
            "--rdzv-id", f"dflash-{profile.name}"]


def _worker_env(profile: Profile, base_env: Mapping[str, str] | None,
                extra_env: Mapping[str, str] | None, paths: TrainPaths) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    python_path = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update({"PYTHONPATH": os.pathsep.join(dict.fromkeys(python_path)), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(profile)))
    # a rank killed by a fatal signal of its own (SIGABRT from C++ `terminate`, SIGSEGV) writes every
    # thread's Python stack into its log first; dflash.train.supervisor.failures names it (fatal_dumps)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.update(flight_recorder_env(profile, paths, env))
    env.update(extra_env or {})
    apply_allocator_env(rank_allocator(profile, env), env)
    return env


FLIGHT_RECORDER_ENTRIES = 2000      # torch's recommended buffer: the last collectives of every process group


def flight_recorder_env(profile: Profile, paths: TrainPaths, env: Mapping[str, str]) -> dict[str, str]:
    """torch's flight recorder on every rank (a user's own settings kept): the ranks' heartbeats count the
    collectives each has entered from it (dflash.train.supervisor.watchdog). Both variable names: torch 2.9 reads
    TORCH_NCCL_*, later releases TORCH_FR_* first. On CUDA, NCCL's monitor thread also dumps its recorder into
    train/failures/nccl-flight-recorder/rank-R (fr_trace reads that folder): at a collective's timeout, and when the
    launcher writes the rank's dump pipe (train/ranks/nccl-dump-rank-R.pipe) before it stops a stuck run. The pipe
    is polled every TORCH_NCCL_COORD_CHECK_MILSEC only with TORCH_NCCL_DUMP_ON_TIMEOUT on (ProcessGroupNCCL.cpp,
    `HeartbeatMonitor::runLoop`, torch 2.9.1 and 2.13.0; otherwise every TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)."""
    from dflash.train.supervisor.heartbeat import nccl_dump_pipe_stem, nccl_flight_recorder_dir

    entries = env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or str(FLIGHT_RECORDER_ENTRIES)
    settings = {"TORCH_FR_BUFFER_SIZE": entries, "TORCH_NCCL_TRACE_BUFFER_SIZE": entries}
    if profile.machine.device == "cuda":
        dump = env.get("TORCH_FR_DUMP_TEMP_FILE") or str(nccl_flight_recorder_dir(paths.run_dir) / "rank-")
        settings.update({"TORCH_NCCL_DUMP_ON_TIMEOUT": env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                         "TORCH_FR_DUMP_TEMP_FILE": dump, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump,
                         "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
                         or str(nccl_dump_pipe_stem(paths.run_dir))})
    return settings


def rank_allocator(profile: Profile, env: Mapping[str, str]) -> AllocatorSetting:
    """The CUDA caching allocator's variables the ranks get (envcheck.allocator): expandable segments unless
    memory.expandable_segments is off or the user's own variable says otherwise; none on a CPU profile.
    ConfigError when the user's two allocator variables disagree (torch versions differ on which one wins)."""
    if profile.machine.device != "cuda":
        return AllocatorSetting(False, "CPU profile: no CUDA caching allocator")
    return allocator_setting(profile.memory.expandable_segments, env).require()


SHOWN_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", *ALLOC_CONF_VARIABLES, STORE_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME",
             "NCCL_SOCKET_IFNAME")


def describe_command(argv: list[str], env: Mapping[str, str], keys: tuple[str, ...] = SHOWN_ENV) -> str:
    """A paste-ready line for the per-node command (only the env we set; secrets never printed)."""
    import shlex

    shown = redact_env({k: env[k] for k in keys if k in env})
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown.items()), *map(shlex.quote, redact_argv(argv))])


def prepare_run_dir(profile: Profile, paths: TrainPaths, *, resume: bool, start_over: bool,
                    data: TrainingDataRecord | None = None) -> None:
    """Refuse to overwrite checkpoints unless resuming; `start_over` moves the old train/ aside (kept as
    train.prev-<time>). The caller holds the run directory's lock (launcher_core.runlock), so no live run is moved.
    Writes the resolved profile and the training data's rendering record the ranks copy into each checkpoint."""
    from dflash.drafter.checkpoint_files import TRAINING_DATA, checkpoints_dir
    from dflash.train.supervisor.heartbeat import ranks_dir
    from launcher_core.fileio import write_json_atomic, write_text_atomic

    has_checkpoints = any(checkpoints_dir(paths.run_dir).glob("step-*"))
    if has_checkpoints and not resume:
        if not start_over:
            raise ConfigError(f"{paths.train_dir} already holds checkpoints; pass --resume to continue, "
                              f"or --start-over to start over (the old train/ is kept as train.prev-*)")
        os.replace(paths.train_dir, paths.run_dir / f"{PREVIOUS_TRAIN}{time.strftime('%Y%m%d-%H%M%S')}")
    for folder in (paths.failures, ranks_dir(paths.run_dir)):
        if folder.exists():
            shutil.rmtree(folder)
    (paths.train_dir / "stopped.json").unlink(missing_ok=True)
    write_text_atomic(paths.profile_json, profile_to_json(profile))
    write_json_atomic(paths.train_dir / TRAINING_DATA, data if data is not None else training_data(profile))


PREVIOUS_TRAIN = "train.prev-"      # where --start-over moves an earlier train/ (the same disk: it still fills it)
SKIP_FLAG = "--skip-resource-checks"


def training_data(profile: Profile) -> TrainingDataRecord:
    """The dataset's path and rendering record (dflash.data.rendering_record), which prepare_run_dir writes into
    train/training_data.json, rank 0 copies into every checkpoint and export into an exported drafter, for eval's
    mode check. InputError naming the file and field when the dataset's meta is damaged."""
    from dflash.data.dataset_io import META_NAME
    from dflash.data.rendering_record import training_data_record
    from launcher_core.profile import expand_path

    return training_data_record(expand_path(profile, profile.paths.dataset) / META_NAME)


def check_checkpoint_disk(profile: Profile, plan: Plan, run_dir: Path, *, resume: bool = False) -> None:
    """PreflightFailed, before anything starts, when the checkpoints the run writes do not fit the free disk at
    the run directory (dflash.memory.checkpoint_costs): on a resume its own whole checkpoints already there count, as
    retention removes them; earlier runs moved aside (train.prev-*) are named with what they hold. `--skip-resource-checks`
    trains anyway."""
    from dflash.drafter.checkpoint_files import complete_checkpoints
    from dflash.memory.checkpoint_costs import checkpoint_disk
    from envcheck.host import disk_usage

    own = len(complete_checkpoints(run_dir)) if resume else 0
    problem = checkpoint_disk(plan, profile.train, on_disk=own).problem(disk_usage(run_dir))
    if problem:
        raise PreflightFailed(f"train: {problem}{previous_runs_note(run_dir)} (or pass {SKIP_FLAG} to train anyway)")


def previous_runs_note(run_dir: Path) -> str:
    """`; earlier runs moved aside by --start-over hold 3.1 GiB of it (train.prev-20260101-120000, ...): remove those
    no longer needed`, or "" when there are none."""
    from launcher_core.diskfull import human_bytes, tree_bytes

    previous = sorted(path for path in run_dir.glob(f"{PREVIOUS_TRAIN}*") if path.is_dir() and not path.is_symlink())
    if not previous:
        return ""
    held = sum(tree_bytes(path) for path in previous)
    return (f"; earlier runs moved aside by --start-over hold {human_bytes(held)} of it "
            f"({', '.join(path.name for path in previous)}): remove those no longer needed")


def check_host_ram(profile: Profile, plan: Plan, ram_mib: int | None = None) -> None:
    """PreflightFailed, before anything starts, when this node's RAM (`ram_mib`, default: read now, the cgroup
    limit applied) does not hold the host RAM its ranks need at start (dflash.memory.host_ram; `--skip-resource-checks`
    trains anyway)."""
    from dflash.memory.host_ram import host_ram_at_start
    from envcheck.host import ram_mib as node_ram_mib

    problem = host_ram_at_start(profile, plan).problem(ram_mib if ram_mib is not None else node_ram_mib()[0])
    if problem:
        raise PreflightFailed(f"train: {problem} (or pass {SKIP_FLAG} to train anyway)")


def run_training(profile: Profile, *, run_dir: str | Path, start_over: bool = False, resume: bool = False,
                 skip_resource_checks: bool = False, extra_env: Mapping[str, str] | None = None,
                 plan: tuple[Plan, PlanInputs] | None = None) -> int:
    """Run torchrun for this node; returns 0, or raises RunFailed naming the cause (dflash.train.supervisor.failures), or
    Interrupted (exit 130) when SIGTERM or SIGINT stopped it (`LauncherStop`: the ranks save after their step).

    The run directory is locked for the run's life (launcher_core.runlock: a second run there is
    refused, exit 2). The profile is checked against its target's config.json and tokenizer
    (dflash.train.supervisor.launch_checks: ConfigError, exit 2, naming file and key); with `resume`, the
    checkpoint to resume is verified and fitted to the profile's drafter first (dflash.train.supervisor.resume:
    a damaged latest falls back to the newest good one; a drafter of another shape is exit 2), and
    partial checkpoints an interrupted run left are removed. Without `plan`, the plan is computed
    here from this machine and the profile's baseline (`launcher.py train` checks and plans before
    calling). The plan, (Plan, PlanInputs) from dflash.memory.launch_plan, is written to
    train/plan.json, where every rank reads its starting micro-batch and budget. A rank that cannot
    hold one sequence, checkpoints that do not fit the disk, or ranks whose start does not fit the node's RAM
    (dflash.memory.host_ram) stop the launch here (PreflightFailed), before any model loads, unless
    `skip_resource_checks`; `start_over` moves an earlier run's train/ aside (kept as train.prev-*). On CUDA
    it prints what the ranks' caching allocator gets and why (`rank_allocator`: expandable segments)."""
    from dflash.memory.launch_plan import plan_for_launch, read_inputs, write_plan
    from dflash.train.supervisor.launch_checks import validate_profile_for_launch
    from dflash.train.supervisor.resume import prepare_checkpoints
    from launcher_core.runlock import run_lock

    paths = TrainPaths(Path(run_dir).resolve())
    facts = validate_profile_for_launch(profile)
    data = training_data(profile)           # a damaged dataset meta: InputError before anything is moved
    allocator = rank_allocator(profile, {**os.environ, **(extra_env or {})})     # ConfigError before anything starts
    if profile.machine.device == "cuda":
        print(f"allocator: {allocator.describe()}", flush=True)
    with run_lock(paths.run_dir, "train") as lock:
        if lock.previous is not None:
            note_dead_run(paths, lock.previous.pid)
        prepare_checkpoints(profile, facts, paths.run_dir, resume=resume)
        if plan is None:        # `launcher.py train` planned already; the pipeline has not
            inputs = read_inputs(profile)
            plan = (plan_for_launch(profile, inputs), inputs)
        if not skip_resource_checks:
            check_checkpoint_disk(profile, plan[0], paths.run_dir, resume=resume)
            check_host_ram(profile, plan[0])
        prepare_run_dir(profile, paths, resume=resume, start_over=start_over, data=data)
        write_plan(paths.run_dir, *plan)
        for restart in range(oom_restart_limit(profile) + 1):
            if restart:         # after an OOM: the checkpoint to resume, verified again (a save may have been cut)
                prepare_checkpoints(profile, facts, paths.run_dir, resume=True)
            end = _run_torchrun(profile, paths, lock.fileno(), resume=resume or restart > 0, extra_env=extra_env)
            if end.code == 0 or end.signalled or not restart_after_oom(profile, paths, restart):
                break
        return _conclude(paths, end, profile.train.collective_timeout_s)


def _run_torchrun(profile: Profile, paths: TrainPaths, lock_fd: int, *, resume: bool,
                  extra_env: Mapping[str, str] | None) -> RunEnd:
    """One torchrun of every rank under the launcher's agent (a fresh rendezvous store each time)."""
    from launcher_core.manifest import update_stage

    with _rendezvous_store(profile) as store:
        argv, env = build_torchrun_command(profile, paths.run_dir, resume=resume, extra_env=extra_env, store=store)
        if profile.machine.nnodes > 1:
            print(f"run this on each of the {profile.machine.nnodes} nodes:\n  {describe_command(argv, env)}",
                  flush=True)
        update_stage(paths.run_dir, "train", "running", resumed=resume, launcher_pid=os.getpid())
        with ProgressBar(paths.train_dir):
            return run_agent(argv, env, paths, lock_fd, profile.train.heartbeat_timeout_s, stuck_bound(profile))


def oom_restart_limit(profile: Profile) -> int:
    """Restarts after out-of-memory errors: enough to halve train.max_micro_batch down to 1."""
    return profile.train.max_micro_batch.bit_length()


def restart_after_oom(profile: Profile, paths: TrainPaths, restarts_done: int) -> bool:
    """torchrun ended because a rank ran out of memory (its OOM record, dflash.train.supervisor.oom_records): True
    when every rank should start again from the last checkpoint at half the micro-batch; RunFailed
    when that cannot help (an OOM at micro-batch 1); False when no rank recorded an OOM (one node
    only: on several nodes torchrun's --max-restarts restarts them)."""
    from dflash.train.supervisor.oom_records import fatal_oom_message, read_oom_records, unrecoverable
    from launcher_core.manifest import update_stage

    records = read_oom_records(paths.run_dir) if profile.machine.nnodes <= 1 else []
    if not records:
        return False
    fatal = unrecoverable(records)
    if fatal is not None or restarts_done >= oom_restart_limit(profile):
        update_stage(paths.run_dir, "train", "failed", failed_rank=records[0].rank, exit_code=RunFailed.exit_code)
        raise RunFailed(fatal_oom_message(fatal) if fatal is not None else
                        f"out of memory again after {restarts_done} restart(s) at smaller micro-batches; "
                        f"see {paths.run_dir / 'train' / 'autobatch.json'}")
    first = min(records, key=lambda r: (r.step, r.rank))
    print(f"[autobatch] rank {first.rank} ran out of memory at step {first.step}, micro-batch {first.micro_batch} "
          f"({first.phase}); restarting every rank from the last checkpoint at micro-batch {max(1, first.halved)}",
          flush=True)
    if paths.failures.exists():
        shutil.rmtree(paths.failures)       # the echoes of the OOM in the other ranks
    return True


def note_dead_run(paths: TrainPaths, pid: int) -> None:
    """A run whose launcher died without a word (its lock was taken over): its manifest entry, if
    still "running", says how it ended."""
    from launcher_core.manifest import read_manifest, update_stage

    entry = read_manifest(paths.run_dir)["stages"].get("train", {})
    if entry.get("state") == "running":
        update_stage(paths.run_dir, "train", "failed", ended_by="launcher gone",
                     error=f"the launcher (pid {pid}) ended without a word (killed, or the machine went down); "
                           f"found by the next run")


def _rendezvous_store(profile: Profile) -> "contextlib.AbstractContextManager[str | None]":
    """One node: the launcher's loopback store, open until torchrun has exited (also on an error,
    SIGINT or SIGTERM); several nodes: none (torchrun's own store at machine.rdzv_endpoint)."""
    return LoopbackStore() if profile.machine.nnodes <= 1 else contextlib.nullcontext(None)


WATCH_S = 1.0             # how often the launcher looks at the ranks' heartbeats
STRAGGLER_GRACE_S = 5.0   # after the agent exits, how long its ranks may take to go before they are killed


def stuck_bound(profile: Profile) -> StuckBound:
    """train.stuck_after_steps x the measured step time, at least train.stuck_floor_s (dflash.train.supervisor.watchdog)."""
    from dflash.train.supervisor.watchdog import StuckBound

    return StuckBound(profile.train.stuck_floor_s, profile.train.stuck_after_steps)


def run_agent(argv: list[str], env: dict[str, str], paths: TrainPaths, lock_fd: int,
              heartbeat_timeout_s: float, stuck: StuckBound | None = None) -> RunEnd:
    """Run the torchrun agent (dflash.train.supervisor.agent) tied to this process: it holds the read end of a
    pipe only we can write (its end of file: we are gone) and the run directory's lock. SIGTERM or SIGINT
    to us stops the run (`LauncherStop`); a rank that stops beating, or that holds the others past `stuck`
    (dflash.train.supervisor.watchdog), ends the run. When the agent has exited, no rank may outlive it. They share a temporary
    folder of their own (TMPDIR, `child_tempdir`), removed once they have all ended (end_stragglers)."""
    with child_tempdir("train") as folder:
        return _run_agent_in(argv, {**env, **child_tempdir_env(folder)}, paths, lock_fd, heartbeat_timeout_s, stuck)


class LauncherStop:
    """SIGTERM and SIGINT to the launcher while its agent runs (a terminal's Ctrl-C reaches the agent and the
    ranks as well: they take it as the same stop). The first is passed on to the agent as SIGTERM: it asks every
    rank to stop after its step, and they save and end (dflash.train.supervisor.agent.StopOnSignal). A second, of either
    kind, stops the run at once (`kill_run`): the agent and its ranks are killed in the handler, and the run keeps
    its last complete checkpoint (none at the stop)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.received: list[str] = []
        self.agent: subprocess.Popen | None = None
        self.previous: dict[int, object] = {}

    def install(self) -> None:
        self.previous = {signum: signal.signal(signum, self.on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)      # type: ignore[arg-type]

    def attach(self, agent: subprocess.Popen) -> None:
        self.agent = agent
        if self.received:
            self.pass_on()

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum).name)
        self.pass_on()

    def pass_on(self) -> None:
        if self.agent is None:
            return
        if len(self.received) == 1:
            self.agent.send_signal(signal.SIGTERM)
        else:
            kill_run(self.agent, self.run_dir)


def _run_agent_in(argv: list[str], env: dict[str, str], paths: TrainPaths, lock_fd: int,
                  heartbeat_timeout_s: float, stuck: StuckBound | None) -> RunEnd:
    from dflash.train.supervisor.agent import PIPE_FD_ENV, RUN_DIR_ENV
    from dflash.train.supervisor.heartbeat import LAUNCHER_PID_ENV

    read_fd, write_fd = os.pipe()
    env = {**env, PIPE_FD_ENV: str(read_fd), RUN_DIR_ENV: str(paths.run_dir), LAUNCHER_PID_ENV: str(os.getpid())}
    stop = LauncherStop(paths.run_dir)
    stop.install()              # before the agent starts: a Ctrl-C is a stop from here on, never a KeyboardInterrupt
    try:
        try:
            process = subprocess.Popen(argv, env=env, cwd=str(REPO_ROOT), pass_fds=(read_fd, lock_fd))
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        stop.attach(process)
        stall: Stall | Stuck | None = None
        try:
            code, stall = _wait_watching(process, paths.run_dir, heartbeat_timeout_s, stuck)
        finally:
            os.close(write_fd)            # the agent, if it still runs (an error here), stops its ranks
        end_stragglers(paths.run_dir)
    finally:
        stop.restore()
    return RunEnd(process.pid, code, bool(stop.received), stall, tuple(stop.received))


def _wait_watching(process: subprocess.Popen, run_dir: Path, timeout_s: float,
                   stuck: StuckBound | None) -> tuple[int, Stall | Stuck | None]:
    """Wait for the agent; a rank that stops beating for `timeout_s`, or holds the others past `stuck`,
    ends the run: every rank's stacks are dumped into train/failures/, then the agent and ranks are killed."""
    from dflash.train.supervisor.heartbeat import find_stall
    from dflash.train.supervisor.watchdog import find_stuck, request_dumps

    while True:
        try:
            return process.wait(timeout=WATCH_S), None
        except subprocess.TimeoutExpired:
            pass
        found: Stall | Stuck | None = find_stall(run_dir, timeout_s)
        if found is None and stuck is not None:
            found = find_stuck(run_dir, stuck)
        if found is not None:
            request_dumps(run_dir)
            kill_run(process, run_dir)
            return process.wait(), found


def kill_run(agent: subprocess.Popen, run_dir: Path) -> None:
    """End the run now: SIGKILL the agent first (torchrun restarts nothing), then its ranks. A rank forked by
    the agent's forkserver does not die with the agent on its own: it holds the write end of the pipe whose end
    of file would end the forkserver, and with it the rank (multiprocessing gives every forked child that end);
    left alone, it would finish its step and save before `end_stragglers` ends it."""
    agent.kill()
    end_stragglers(run_dir, grace_s=0.0)


def end_stragglers(run_dir: Path, grace_s: float = STRAGGLER_GRACE_S) -> list[int]:
    """Rank processes of this node still alive after their agent: wait `grace_s`, then SIGKILL them
    (they die with the agent; this is the last guard). Returns the pids that had to be killed."""
    import psutil

    from dflash.train.supervisor.heartbeat import live_rank_pids

    deadline = time.monotonic() + grace_s
    while live_rank_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for pid in live_rank_pids(run_dir):
        try:
            psutil.Process(pid).kill()
            killed.append(pid)
        except psutil.Error:
            pass
    return killed


def _conclude(paths: TrainPaths, end: RunEnd, collective_timeout_s: float) -> int:
    """0 for a whole run; Interrupted for a run stopped by a signal (manifest `pending`, what to resume);
    otherwise RunFailed, DiskFull, NodeFault or DataError naming the cause (dflash.train.supervisor.failures), its
    exit code the manifest's `exit_code` (the command's, not torchrun's)."""
    from dflash.train.supervisor.failures import failure_cause, read_rank_failures
    from launcher_core.errors import DataError, DiskFull, NodeFault
    from launcher_core.fileio import read_json
    from launcher_core.manifest import update_stage

    stopped = paths.train_dir / "stopped.json"
    if stopped.exists():
        raise stopped_run(paths, end, read_json(stopped))
    if end.code == 0:
        say_skipped_steps(paths)
        return 0
    if end.signalled and (len(end.signals) > 1 or not read_rank_failures(paths.failures)):
        raise interrupted_run(paths, end)
    cause = failure_cause(paths.run_dir, end, collective_timeout_s)
    error = {"disk full": DiskFull, "node fault": NodeFault, "loss unusable": DataError}.get(cause.kind, RunFailed)
    update_stage(paths.run_dir, "train", "failed", exit_code=error.exit_code, failed_rank=cause.rank,
                 ended_by=cause.kind, error=cause.message.splitlines()[0][:500])
    raise error(cause.message)


def say_skipped_steps(paths: TrainPaths) -> None:
    """The run's count of steps skipped without a supervised position (dflash.train.rank.loss_check), when any."""
    from launcher_core.manifest import read_manifest

    skipped = int(read_manifest(paths.run_dir)["stages"].get("train", {}).get("skipped_steps") or 0)
    if skipped:
        print(f"train: {skipped} step(s) skipped without a supervised position (no update; \"skipped\": true in "
              f"{paths.train_dir / 'metrics.jsonl'}; train.max_skipped_steps bounds them in a row)", flush=True)


def stopped_run(paths: TrainPaths, end: RunEnd, info: dict) -> Interrupted:
    """The ranks stopped after a step and saved (train/stopped.json): the manifest's train stage `pending`."""
    from launcher_core.manifest import update_stage

    by = end.signals[0] if end.signals else "a signal to torchrun or its ranks"
    checkpoint = Path(str(info.get("checkpoint", ""))).name or f"step-{info['step']}"
    update_stage(paths.run_dir, "train", "pending", stopped_at_step=info["step"],
                 ended_by=f"stopped ({end.signals[0] if end.signals else 'signal'})",
                 hint=f"continue from {checkpoint} with `launcher.py train --resume`")
    return Interrupted(f"training stopped by {by} after step {info['step']}; checkpoint {checkpoint} saved. "
                       f"Continue with --resume.")


def interrupted_run(paths: TrainPaths, end: RunEnd) -> Interrupted:
    """Signalled, and no checkpoint at the stop: a second signal stopped the run at once, or the first came
    before the ranks could save (before their first step). The manifest's train stage `pending`."""
    from dflash.train.supervisor.failures import resume_hint
    from launcher_core.manifest import update_stage

    twice = len(end.signals) > 1
    how = (f"by a second {end.signals[1]}: stopped at once, without a checkpoint at the stop" if twice
           else f"by {end.signals[0]} before the ranks could save a checkpoint at the stop")
    hint = resume_hint(paths.run_dir)
    update_stage(paths.run_dir, "train", "pending", ended_by=f"interrupted ({'forced' if twice else end.signals[0]})",
                 hint=hint)
    return Interrupted(f"training interrupted {how}; {hint}")
