"""The torchrun agent of a node: `python -m dflash.train.supervisor.agent TORCHRUN_ARGUMENTS...`.

It is torch.distributed.run (same arguments, same behaviour) with what ties a run's processes to
their launcher:

* the ranks fork from torchrun's forkserver, which imports what a rank needs once (`RANK_IMPORTS`);
* the ranks die with the agent (`AGENT_PID_ENV`: each asks the kernel for SIGKILL when its parent
  ends; a rank forked by the forkserver, whose pipe it holds, outlives a killed agent until the launcher
  ends it: dflash.train.supervisor.launch.kill_run, end_stragglers), and the agent with the launcher: end of
  file on a pipe only the launcher writes (`PIPE_FD_ENV`) makes it kill the ranks, record the end in the
  run's manifest and exit;
* the ranks that failed, with exit codes and signals, go to `train/failures/agent.json`, so the
  launcher names a killed rank rather than the one that noticed (dflash.train.supervisor.failures);
* SIGTERM and SIGINT ask every rank once to stop after its step (`StopOnSignal`): torchrun's own
  handler would kill them after its shutdown timeout (a save can take longer) and end in a traceback;
* torchrun's own words go to `train/logs/torchrun.log` (`route_torchrun_output`); the terminal keeps
  the ranks' lines and the launcher's diagnosis.

Without the launcher's environment (a node started by hand from `train --print-command`) it is
torchrun with the same stop on SIGTERM and SIGINT, writing to stderr, its ranks still dying with it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TextIO

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

PIPE_FD_ENV = "DFLASH_LAUNCHER_PIPE_FD"
RUN_DIR_ENV = "DFLASH_RUN_DIR"
AGENT_PID_ENV = "DFLASH_AGENT_PID"
AGENT_RECORD = "agent.json"
TORCHRUN_LOG = "torchrun.log"          # under train/logs/: torchrun's own words (route_torchrun_output)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_LAUNCHER_GONE = 1
STOP_RANKS_TIMEOUT_S = 10.0
# What a rank (dflash.train.rank.worker) imports before its first step, imported once by torchrun's forkserver
# (`preload_rank_imports`). Nothing here starts a thread beyond torch's own or touches a device: the
# forkserver forks every rank from it. `datasets` (pyarrow's allocator starts a background thread at
# import) is left to each rank.
RANK_IMPORTS = ("dflash.train.rank.setup", "dflash.train.rank.step", "dflash.train.rank.parallel", "dflash.train.rank.validation",
                "dflash.train.rank.sharded_checkpoints", "dflash.train.supervisor.heartbeat", "dflash.drafter.checkpoint_files",
                "torch.distributed.checkpoint", "torch.utils.tensorboard")
LAUNCHER_GONE = threading.Event()      # set by the watch thread: the main thread must not exit before it


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    arguments = list(sys.argv[1:] if argv is None else argv)
    preload_rank_imports()
    report_every_failed_rank()
    run_dir = Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None
    report = route_torchrun_output(run_dir)
    StopOnSignal(report).install()
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    pipe = os.environ.pop(PIPE_FD_ENV, "")
    if pipe.isdigit():
        threading.Thread(target=_watch_launcher, args=(int(pipe), run_dir), name="launcher-watch", daemon=True).start()
    try:
        torchrun_main(arguments)
    except ChildFailedError as failed:
        if run_dir is not None and not LAUNCHER_GONE.is_set():
            write_agent_record(run_dir, failed)
        print(str(failed), file=report, flush=True)
        return 1
    except SignalException as stopped:      # SIGHUP, SIGQUIT: torchrun signalled its ranks and reaped them
        print(f"torchrun stopped its ranks on {stopped.sigval.name}", file=report, flush=True)
        return 128 + int(stopped.sigval)
    except Exception as error:
        if report is sys.stderr:
            raise
        traceback.print_exc(file=report)
        print(f"torchrun failed: {type(error).__name__}: {error} (its traceback: {report.name})", file=sys.stderr,
              flush=True)
        return 1
    finally:
        while LAUNCHER_GONE.is_set():   # the watch thread is stopping the run: it ends this process
            time.sleep(1.0)
    return 0


def route_torchrun_output(run_dir: Optional[Path]) -> TextIO:
    """Where torchrun's own words go, opened: with a run directory, `train/logs/torchrun.log` (appended to);
    without one, stderr. The log takes this process's file descriptor 2: what torch's loggers write there
    (their handlers hold the stream of fd 2: the elastic agent's warnings and errors, their tracebacks), C++
    warnings of the agent, and the stderr of the processes it starts that keep it (multiprocessing's
    forkserver and resource tracker; the ranks' own output goes to their files under train/logs). sys.stderr
    becomes a copy of the terminal's: the rank lines torchrun tees there (`--tee`) and what this module
    prints for the terminal stay on it."""
    if run_dir is None:
        return sys.stderr
    path = run_dir / "train" / "logs" / TORCHRUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("a", encoding="utf-8", buffering=1)
    print(f"== torchrun agent pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}", file=log)
    sys.stderr.flush()
    with contextlib.suppress(OSError):        # no terminal (fd 2 closed): everything goes to the log
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    os.dup2(log.fileno(), 2)
    return log


class StopOnSignal:
    """SIGTERM and SIGINT to the agent: every rank of the running group is asked once to stop after its step
    (SIGTERM to each: dflash.train.rank.worker's StopFlag, which SIGINT from a terminal also sets) and the agent waits
    for them as for any end. torchrun puts its own handler back each time it starts ranks (PContext.start):
    this one replaces it there again. A signal before any rank started ends the agent (exit 128 + the signal):
    there is nothing to save. What it does is noted in `report` (the handler writes with os.write: a buffered
    write there could be one the main thread is inside)."""

    def __init__(self, report: TextIO):
        self.report = report
        self.context: Optional[PContext] = None
        self.requested: Optional[signal.Signals] = None

    def install(self) -> None:
        global STOP
        STOP = self
        self._handle()
        stop_on_signal_at_every_start()

    def _handle(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self.on_signal)

    def started(self, context: PContext) -> None:
        self.context = context
        self._handle()
        if self.requested is not None:
            self.forward()

    def on_signal(self, signum: int, _frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.context is None:
            self.note(f"{name} before any rank started: the agent ends")
            raise SystemExit(128 + signum)
        if self.requested is not None:
            self.note(f"{name}: the ranks were asked to stop already ({self.requested.name})")
            return
        self.requested = signal.Signals(signum)
        self.forward()

    def forward(self) -> None:
        """SIGTERM to each rank of the current group that is still a process of this agent (a pid that
        could be another process's by now is not signalled)."""
        import psutil

        assert self.context is not None and self.requested is not None
        ours = {child.pid for child in psutil.Process().children(recursive=True)}
        ranks = [pid for pid in self.context.pids().values() if pid in ours]
        self.note(f"{self.requested.name}: asking the rank processes {ranks} to stop after their step")
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def note(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            os.write(self.report.fileno(), f"{line}\n".encode())


STOP: Optional[StopOnSignal] = None     # the agent's StopOnSignal, told each time torchrun starts its ranks


def stop_on_signal_at_every_start() -> None:
    """Have torchrun's PContext.start (it starts a group of ranks and installs its own handler of SIGTERM and
    SIGINT) hand the started group to STOP, which installs its handler again; once per process."""
    from torch.distributed.elastic.multiprocessing import api

    start = api.PContext.start
    if getattr(start, "stops_on_signal", False):
        return

    def start_then_stop_on_signal(context: PContext) -> None:
        start(context)
        if STOP is not None:
            STOP.started(context)

    setattr(start_then_stop_on_signal, "stops_on_signal", True)
    setattr(api.PContext, "start", start_then_stop_on_signal)


def preload_rank_imports() -> None:
    """Have multiprocessing's forkserver (torchrun `--start-method forkserver`) import what every rank
    imports (RANK_IMPORTS) once, before it forks the ranks. Nothing is imported
    here: the forkserver is a process of its own, started with the first rank."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(RANK_IMPORTS))


def report_every_failed_rank() -> None:
    """Have torchrun's multiprocessing context (ranks started with a start method) report every rank
    that had failed when it noticed a failure, as its command context does. Its join reports one: the
    first it looks at among the ranks that have ended. A rank killed by a signal (a kill -9, the kernel's
    out-of-memory killer) and the peer that fails on the broken connection end in the same instant, and
    the report then named the peer's echo instead of the killed rank. Added: each other rank that ended with a non-zero exit code or a signal,
    except SIGTERM, with which the context itself stops the rest. torch has no public hook for this: the
    replacement of its private poll is dflash.torch_private's; where torch lacks it, nothing changes."""
    import signal

    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dflash.torch_private import multiprocess_processes, wrap_multiprocess_poll

    def every_failure(poll: Callable[[api.MultiprocessContext], Optional[api.RunProcsResult]]
                      ) -> Callable[[api.MultiprocessContext], Optional[api.RunProcsResult]]:
        def poll_every_failure(context: api.MultiprocessContext) -> Optional[api.RunProcsResult]:
            result = poll(context)
            processes = multiprocess_processes(context)
            if result is None or not result.failures or processes is None:
                return result
            for local_rank, process in enumerate(processes):
                if local_rank not in result.failures and process.exitcode not in (None, 0, -signal.SIGTERM):
                    result.failures[local_rank] = ProcessFailure(local_rank, process.pid, process.exitcode,
                                                                 context.error_files[local_rank])
            return result

        return poll_every_failure

    wrap_multiprocess_poll(every_failure, "reports_every_failed_rank")


def write_agent_record(run_dir: Path, failed: ChildFailedError) -> None:
    """train/failures/agent.json: {"ranks": [{rank, local_rank, pid, exitcode, signal, message}]}."""
    from launcher_core.fileio import write_json_atomic

    ranks = [{"rank": int(rank), "local_rank": failure.local_rank, "pid": failure.pid, "exitcode": failure.exitcode,
              "signal": failure.signal_name() if failure.exitcode < 0 else "", "message": failure_message(failure)}
             for rank, failure in sorted(failed.failures.items())]
    write_json_atomic(Path(run_dir) / "train" / "failures" / AGENT_RECORD, {"ranks": ranks})


def failure_message(failure: ProcessFailure) -> str:
    """The failure's message as text: a rank torchrun ran as a function leaves an error file, whose
    content torch gives as a dict ({"message": ..., "extraInfo": {"py_callstack": ...}})."""
    message = failure.message
    if isinstance(message, dict):
        return str(message.get("message", message))
    return str(message)


def _watch_launcher(fd: int, run_dir: Optional[Path]) -> None:
    """Block on the launcher's pipe; on end of file the launcher is gone: stop the run and exit."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    LAUNCHER_GONE.set()
    try:
        ranks = count_live_ranks(run_dir)
        stop_ranks()
        if run_dir is not None:
            record_launcher_gone(run_dir, ranks)
    finally:
        os._exit(EXIT_LAUNCHER_GONE)


def count_live_ranks(run_dir: Optional[Path]) -> int:
    """The run's rank processes alive on this node (their heartbeat records), not every process `stop_ranks`
    ends (torchrun's forkserver, multiprocessing's resource tracker, a rank's own children); 0 when they
    cannot be read, which never keeps the ranks from being stopped."""
    try:
        from dflash.train.supervisor.heartbeat import live_rank_pids

        return len(live_rank_pids(run_dir)) if run_dir is not None else 0
    except Exception:
        return 0


def stop_ranks() -> int:
    """SIGKILL every process this agent started (the ranks and theirs) and wait until they are gone;
    returns how many there were."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=STOP_RANKS_TIMEOUT_S)
    return len(children)


def record_launcher_gone(run_dir: Path, ranks: int) -> None:
    """The manifest's train stage: failed, and why (the launcher's pid, the step, the rank processes
    stopped, the checkpoint)."""
    from dflash.drafter.checkpoint_files import checkpoints_dir
    from dflash.train.supervisor.heartbeat import LAUNCHER_PID_ENV
    from dflash.train.supervisor.progress import read_progress
    from launcher_core.manifest import update_stage

    progress = read_progress(run_dir / "train")
    pointer = checkpoints_dir(run_dir) / "latest"
    latest = pointer.read_text(encoding="utf-8", errors="replace").strip() if pointer.is_file() else ""
    step = f" after step {progress.step}" if progress else ""
    resume = (f"the last complete checkpoint is {latest}: continue with `launcher.py train --resume`" if latest
              else "no checkpoint was complete: train again")
    update_stage(run_dir, "train", "failed", ended_by="launcher gone", exit_code=None,
                 error=f"the launcher (pid {os.environ.get(LAUNCHER_PID_ENV, '?')}) ended while training{step} "
                       f"(it was killed); its torchrun agent stopped "
                       f"{f'the {ranks} rank process(es)' if ranks else 'the processes it had started'} before exiting; "
                       f"{resume}")


if __name__ == "__main__":
    sys.exit(main())
