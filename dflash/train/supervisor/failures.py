"""How a training run ended, in one message that names the cause, not the rank that noticed it.

What the launcher knows when torchrun has exited:

* `train/failures/rank-R.json`: an exception a rank caught and recorded (dflash.train.rank.worker);
  a full disk (`kind` "disk_full"), another fault of the node (`kind` "node_fault": a read-only filesystem,
  permission denied, the host out of memory) and a loss that cannot train (`kind` "loss_unusable",
  dflash.train.rank.loss_check) are recorded as such, and the rank ends without a traceback (torchrun's own
  report goes to train/logs/torchrun.log: dflash.train.supervisor.agent.route_torchrun_output);
* `train/failures/agent.json`: the ranks torchrun saw fail, with exit codes and signals
  (dflash.train.supervisor.agent): a rank killed by SIGKILL records nothing itself;
* the launcher's own observations: a rank that stopped beating (dflash.train.supervisor.heartbeat), the
  agent's own exit code.

`failure_cause` ranks them: a stopped rank (the launcher ended the run); the agent killed; a rank
killed by SIGKILL that recorded nothing (a user's kill -9 or the kernel's out-of-memory killer:
the others' "connection closed" errors are its echoes); the earliest recorded error; the agent's
list, with the Python stack a rank's faulthandler dumped into its log at a fatal signal (SIGABRT from
C++, SIGSEGV; the launcher sets PYTHONFAULTHANDLER for its ranks); torchrun's exit code alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict

if TYPE_CHECKING:
    from dflash.train.supervisor.heartbeat import Stall
    from dflash.train.supervisor.watchdog import Stuck


class _RankFailureBase(TypedDict):
    rank: int
    time: float
    error: str
    traceback: str


class RankFailure(_RankFailureBase, total=False):
    """train/failures/rank-R.json, as dflash.train.rank.worker.write_failure writes it."""

    kind: str                       # "disk_full" (a full disk), "node_fault" (launcher_core.nodefault),
                                    # "loss_unusable" (dflash.train.rank.loss_check)


# The failure kinds named by their message alone: the record's kind -> FailureCause.kind (the manifest's ended_by).
NAMED_KINDS = {"disk_full": "disk full", "node_fault": "node fault", "loss_unusable": "loss unusable"}


class AgentRank(TypedDict):
    """One entry of train/failures/agent.json (dflash.train.supervisor.agent.write_agent_record)."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    signal: str
    message: str


@dataclass(frozen=True)
class RunEnd:
    """What the launcher saw of the agent: its pid and exit code, whether the launcher itself was
    signalled (SIGTERM, Ctrl-C) and with what (`signals`, names in order: a second one stopped the run
    at once), and a rank it found stopped or stuck (then it ended the run)."""

    agent_pid: int
    code: int
    signalled: bool = False
    stall: Optional[Stall | Stuck] = None
    signals: tuple[str, ...] = ()


@dataclass(frozen=True)
class FailureCause:
    """`kind` (the manifest's `ended_by`): "rank stopped", "rank stuck", "agent killed", "rank killed",
    "rank failed", "disk full", "node fault", "loss unusable" or "unknown"; the rank to blame, when one is; the message."""

    kind: str
    rank: Optional[int]
    message: str


def read_rank_failures(failures_dir: Path) -> list[RankFailure]:
    records: list[RankFailure] = []
    for path in sorted(failures_dir.glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return records


def read_agent_ranks(failures_dir: Path) -> list[AgentRank]:
    from dflash.train.supervisor.agent import AGENT_RECORD

    try:
        document = json.loads((failures_dir / AGENT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return list(document.get("ranks") or []) if isinstance(document, dict) else []


def first_failure(failures_dir: Path) -> RankFailure | None:
    """The earliest failure a rank recorded (its later echoes on other ranks come after it)."""
    records = read_rank_failures(failures_dir)
    return min(records, key=lambda r: r["time"]) if records else None


def resume_hint(run_dir: Path) -> str:
    from dflash.drafter.checkpoint_files import checkpoints_dir

    pointer = checkpoints_dir(run_dir) / "latest"
    latest = pointer.read_text(encoding="utf-8", errors="replace").strip() if pointer.is_file() else ""
    if latest:
        return f"the last complete checkpoint is {latest}: continue from it with --resume"
    return "no checkpoint was written yet: train again to start over"


def failure_cause(run_dir: Path, end: RunEnd, collective_timeout_s: float) -> FailureCause:
    """The cause of a failed run (module docstring for the order)."""
    from dflash.train.supervisor.heartbeat import Stall
    from launcher_core.processes import signal_name

    failures, logs = run_dir / "train" / "failures", run_dir / "train" / "logs"
    hint = resume_hint(run_dir)
    if end.stall is not None:
        kind = "rank stopped" if isinstance(end.stall, Stall) else "rank stuck"
        return FailureCause(kind, end.stall.rank, f"{end.stall.describe()}. The launcher ended the run (the "
                            f"other ranks would have waited for it in their next collective for up to "
                            f"train.collective_timeout_s = {collective_timeout_s:.0f} s); {stacks_line(failures)}{hint}")
    if end.code < 0 and not end.signalled:
        return FailureCause("agent killed", None, f"the torchrun agent (pid {end.agent_pid}) was killed by "
                            f"{signal_name(end.code)}; its ranks died with it (no process of this run is left); {hint}")
    records, agent = read_rank_failures(failures), read_agent_ranks(failures)
    recorded = {r["rank"] for r in records}
    killed = [a for a in agent if a["signal"] == "SIGKILL" and a["rank"] not in recorded]
    first = min(records, key=lambda r: r["time"]) if records else None
    if killed:
        return _killed_rank(killed, first, hint, logs)
    if first is not None:
        return _recorded(first, hint, run_dir)
    if agent:
        ended = "; ".join(f"rank {a['rank']} (pid {a['pid']}) " + (f"was killed by {a['signal']}" if a["signal"]
                          else f"exited with code {a['exitcode']}") for a in agent)
        dumps = fatal_dumps(logs)
        if dumps:
            return FailureCause("rank failed", agent[0]["rank"], f"{ended}; a rank's Python stack at its fatal signal "
                                f"(PYTHONFAULTHANDLER):\n" + "\n".join(dumps) + f"\n(all rank logs: {logs}; {hint})")
        return FailureCause("rank failed", agent[0]["rank"], f"{ended}, recording no error; see the logs in {logs}; {hint}")
    return FailureCause("unknown", None, f"torchrun exited with code {end.code} and no rank recorded an error; see "
                        f"the logs in {logs}; {hint}")


def stacks_line(failures: Path) -> str:
    """Where the ranks' stack (and flight-recorder) dumps are, when the launcher asked for them."""
    stacks = sorted(failures.glob("stacks-rank-*.txt"))
    if not stacks:
        return ""
    line = f"every rank's Python stack: {failures}/stacks-rank-*.txt ({len(stacks)} rank(s))"
    for folder in ("flight-recorder", "nccl-flight-recorder"):
        dumps = sorted((failures / folder).glob("rank-*"))
        if dumps:
            line += (f"; the flight recorder's dumps of {len(dumps)} rank(s): `python -m "
                     f"torch.distributed.flight_recorder.fr_trace {failures / folder} --prefix rank-`")
    return line + "; "


FATAL_MARK = "Fatal Python error: "       # how Python's faulthandler starts its dump
DUMP_LINES = 12                           # lines of each dump in the message


def fatal_dumps(logs: Path) -> list[str]:
    """The faulthandler dumps in the ranks' stderr logs (torchrun's logs/<run>/attempt_N/<local rank>/):
    each as its log's path, the signal and the innermost frames of the thread that received it."""
    dumps = []
    for log in sorted(logs.glob("*/attempt_*/*/stderr.log")):
        try:
            text = log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        lines = text.splitlines()
        mark = next((i for i, line in enumerate(lines) if FATAL_MARK in line), None)
        if mark is not None:      # from the line before the mark: C++'s reason
            shown = [line for line in lines[max(0, mark - 1):] if line.strip()][:DUMP_LINES]
            dumps.append(f"{log}:\n  " + "\n  ".join(shown))
    return dumps


def _killed_rank(killed: list[AgentRank], echo: Optional[RankFailure], hint: str, logs: Path) -> FailureCause:
    names = " and ".join(f"rank {a['rank']} (pid {a['pid']})" for a in killed)
    after = f"; rank {echo['rank']} failed after it: {echo['error'][:300]}" if echo is not None else ""
    return FailureCause("rank killed", killed[0]["rank"],
                        f"{names} {'were' if len(killed) > 1 else 'was'} killed by SIGKILL from outside the run (a "
                        f"user's kill -9, or the kernel's out-of-memory killer when the host ran out of memory: see "
                        f"`dmesg`){after}\n(all rank logs: {logs}; {hint})")


def _recorded(first: RankFailure, hint: str, run_dir: Path) -> FailureCause:
    named, logs = NAMED_KINDS.get(first.get("kind", "")), run_dir / "train" / "logs"
    if named == "loss unusable":      # the same profile would diverge again; a wrecked checkpoint with any profile
        from dflash.train.supervisor.resume import trainable_checkpoint_hint

        return FailureCause(named, first["rank"], f"rank {first['rank']}: {first['error']}; once the key named is "
                            f"changed, {trainable_checkpoint_hint(run_dir)}")
    if named is not None:
        return FailureCause(named, first["rank"], f"rank {first['rank']}: {first['error']}; then {hint}")
    tail = "\n".join(first["traceback"].rstrip().splitlines()[-15:])
    return FailureCause("rank failed", first["rank"], f"rank {first['rank']} failed first: {first['error']}\n{tail}\n"
                        f"(all rank logs: {logs}; {hint})")
