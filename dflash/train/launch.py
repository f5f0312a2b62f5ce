"""Launching training: a pure builder of the torchrun (argv, env), and `run_training`.

`build_torchrun_command` starts nothing: one node -> a c10d rendezvous on the store the launcher
hosts on 127.0.0.1 (dflash.train.rendezvous: the agent joins it as a client, nothing listens on
another interface), `--nproc-per-node P`; several nodes (machine.nnodes > 1) -> a c10d
rendezvous at machine.rdzv_endpoint, the same command on every node. Workers get the resolved profile as JSON in the run directory, so every
rank and node trains exactly the same configuration.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Mapping, TypedDict

from dflash.train.progress import ProgressBar
from dflash.train.rendezvous import LOOPBACK_HOST, STORE_ENV, LoopbackStore, single_node_env
from launcher_core.errors import ConfigError, RunFailed
from launcher_core.paths import REPO_ROOT
from launcher_core.profile import profile_to_json
from launcher_core.redact import redact_env
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.memory.launch_plan import PlanInputs
    from dflash.memory.plan import Plan


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
    argv = [python or sys.executable, "-m", "torch.distributed.run", *_rendezvous_args(profile, store),
            "--nproc-per-node", str(machine.nproc_per_node), "--max-restarts", str(profile.train.max_restarts),
            "--log-dir", str(paths.logs), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
            "-m", "dflash.train.worker", "--profile-json", str(paths.profile_json), "--run-dir", str(paths.run_dir)]
    if resume:
        argv.append("--resume")
    single_node = {} if machine.nnodes > 1 else single_node_env(store)
    return argv, _worker_env(profile, base_env, {**single_node, **(extra_env or {})})


SINGLE_NODE_STORE_PLACEHOLDER = "127.0.0.1:PORT"   # the port LoopbackStore takes, known only at launch


def _rendezvous_args(profile: Profile, store: str) -> list[str]:
    machine = profile.machine
    if machine.nnodes <= 1:  # the launcher's store, loopback only (docs/train.md, "Rendezvous")
        return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", store,
                "--rdzv-conf", "is_host=false", "--local-addr", LOOPBACK_HOST,
                "--rdzv-id", f"dflash-{profile.name}"]
    assert machine.rdzv_endpoint, "the profile schema holds machine.rdzv_endpoint for several nodes"
    return ["--nnodes", str(machine.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", machine.rdzv_endpoint,
            "--rdzv-id", f"dflash-{profile.name}"]


def _worker_env(profile: Profile, base_env: Mapping[str, str] | None,
                extra_env: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    python_path = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update({"PYTHONPATH": os.pathsep.join(dict.fromkeys(python_path)), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(profile)))
    env.update(extra_env or {})
    return env


SHOWN_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", STORE_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME",
             "NCCL_SOCKET_IFNAME")


def describe_command(argv: list[str], env: Mapping[str, str], keys: tuple[str, ...] = SHOWN_ENV) -> str:
    """A paste-ready line for the per-node command (only the env we set; secrets never printed)."""
    import shlex

    shown = redact_env({k: env[k] for k in keys if k in env})
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown.items()), *map(shlex.quote, argv)])


def prepare_run_dir(profile: Profile, paths: TrainPaths, *, resume: bool, force: bool) -> None:
    """Refuse to overwrite checkpoints unless resuming; `force` moves the old train/ aside."""
    from dflash.drafter.checkpoint import checkpoints_dir
    from launcher_core.fileio import write_text_atomic

    has_checkpoints = any(checkpoints_dir(paths.run_dir).glob("step-*"))
    if has_checkpoints and not resume:
        if not force:
            raise ConfigError(f"{paths.train_dir} already holds checkpoints; pass --resume to continue, "
                              f"or --force to start over (the old train/ is kept as train.prev-*)")
        os.replace(paths.train_dir, paths.run_dir / f"train.prev-{time.strftime('%Y%m%d-%H%M%S')}")
    if paths.failures.exists():
        shutil.rmtree(paths.failures)
    (paths.train_dir / "stopped.json").unlink(missing_ok=True)
    write_text_atomic(paths.profile_json, profile_to_json(profile))


def run_training(profile: Profile, *, run_dir: str | Path, force: bool = False, resume: bool = False,
                 extra_env: Mapping[str, str] | None = None, plan: tuple[Plan, PlanInputs] | None = None) -> int:
    """Run torchrun for this node; returns 0, or raises RunFailed naming the first failing rank.

    Without `plan`, the profile is first checked against its target's config.json and tokenizer
    (dflash.train.launch_checks: ConfigError, exit 2, naming file and key) and the plan is computed
    here from this machine and the profile's baseline (`launcher.py train` checks and plans before
    calling). The plan, (Plan, PlanInputs) from dflash.memory.launch_plan, is written to
    train/plan.json, where every rank reads its starting micro-batch and budget. A rank that cannot hold one sequence stops the
    launch here (PreflightFailed), before any model loads."""
    from dflash.memory.launch_plan import plan_for_launch, read_inputs, write_plan
    from dflash.train.launch_checks import validate_profile_for_launch

    if plan is None:        # `launcher.py train` checked and planned already; the pipeline has not
        validate_profile_for_launch(profile)
        inputs = read_inputs(profile)
        plan = (plan_for_launch(profile, inputs), inputs)
    paths = TrainPaths(Path(run_dir).resolve())
    prepare_run_dir(profile, paths, resume=resume, force=force)
    write_plan(paths.run_dir, *plan)
    for restart in range(oom_restart_limit(profile) + 1):
        code, signalled = _run_torchrun(profile, paths, resume=resume or restart > 0, extra_env=extra_env)
        if code == 0 or signalled or not restart_after_oom(profile, paths, restart):
            break
    return _conclude(paths, code, signalled)


def _run_torchrun(profile: Profile, paths: TrainPaths, *, resume: bool,
                  extra_env: Mapping[str, str] | None) -> tuple[int, bool]:
    """One torchrun of every rank (a fresh rendezvous store each time)."""
    from launcher_core.manifest import update_stage

    with _rendezvous_store(profile) as store:
        argv, env = build_torchrun_command(profile, paths.run_dir, resume=resume, extra_env=extra_env, store=store)
        if profile.machine.nnodes > 1:
            print(f"run this on each of the {profile.machine.nnodes} nodes:\n  {describe_command(argv, env)}", flush=True)
        update_stage(paths.run_dir, "train", "running", resumed=resume)
        with ProgressBar(paths.train_dir):
            return _run_forwarding_sigterm(argv, env)


def oom_restart_limit(profile: Profile) -> int:
    """Restarts after out-of-memory errors: enough to halve train.max_micro_batch down to 1."""
    return profile.train.max_micro_batch.bit_length()


def restart_after_oom(profile: Profile, paths: TrainPaths, restarts_done: int) -> bool:
    """torchrun ended because a rank ran out of memory (its OOM record, dflash.train.autobatch): True
    when every rank should start again from the last checkpoint at half the micro-batch; RunFailed
    when that cannot help (an OOM at micro-batch 1); False when no rank recorded an OOM (one node
    only: on several nodes torchrun's --max-restarts restarts them)."""
    from dflash.train.autobatch import fatal_oom_message, read_oom_records, unrecoverable
    from launcher_core.manifest import update_stage

    records = read_oom_records(paths.run_dir) if profile.machine.nnodes <= 1 else []
    if not records:
        return False
    fatal = unrecoverable(records)
    if fatal is not None or restarts_done >= oom_restart_limit(profile):
        update_stage(paths.run_dir, "train", "failed", failed_rank=records[0].rank)
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


def _rendezvous_store(profile: Profile) -> "contextlib.AbstractContextManager[str | None]":
    """One node: the launcher's loopback store, open until torchrun has exited (also on an error,
    SIGINT or SIGTERM); several nodes: none (torchrun's own store at machine.rdzv_endpoint)."""
    return LoopbackStore() if profile.machine.nnodes <= 1 else contextlib.nullcontext(None)


def _run_forwarding_sigterm(argv: list[str], env: dict[str, str]) -> tuple[int, bool]:
    """Run torchrun; a SIGTERM to us goes to torchrun (which passes it to the ranks)."""
    process = subprocess.Popen(argv, env=env, cwd=str(REPO_ROOT))
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        process.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        code = process.wait()
        received.append(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, bool(received)


def _conclude(paths: TrainPaths, code: int, signalled: bool) -> int:
    from launcher_core.fileio import read_json
    from launcher_core.manifest import update_stage

    stopped = paths.train_dir / "stopped.json"
    if stopped.exists():
        info = read_json(stopped)
        update_stage(paths.run_dir, "train", "pending", stopped_at_step=info["step"])
        print(f"training stopped after step {info['step']}; checkpoint saved. Continue with --resume.", flush=True)
        return 0
    if code == 0 and not signalled:
        return 0
    failure = first_failure(paths.failures)
    update_stage(paths.run_dir, "train", "failed", exit_code=code, failed_rank=failure and failure["rank"])
    raise RunFailed(failure_message(failure, code, paths))


class RankFailure(TypedDict):
    """train/failures/rank-R.json, as dflash.train.worker.write_failure writes it."""

    rank: int
    time: float
    error: str
    traceback: str


def first_failure(failures_dir: Path) -> RankFailure | None:
    """The earliest failure a rank recorded (the root cause; later ones are its echoes)."""
    records: list[RankFailure] = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(failures_dir.glob("rank-*.json"))]
    return min(records, key=lambda r: r["time"]) if records else None


def failure_message(failure: RankFailure | None, code: int, paths: TrainPaths) -> str:
    if failure is None:
        return f"torchrun exited with code {code} and no rank recorded an error; see the logs in {paths.logs}"
    tail = "\n".join(failure["traceback"].rstrip().splitlines()[-15:])
    return (f"rank {failure['rank']} failed first: {failure['error']}\n{tail}\n"
            f"(all rank logs: {paths.logs}; continue from the last checkpoint with --resume)")
