"""The project's error types and the one table that maps them to exit codes.

User errors raise one of these with a message that says what to do; `launcher.main`
turns them into the exit code below. `assert` is only for internal invariants. Each code is declared
once, with its meaning in `EXIT_MEANINGS`: docs/exit-codes.md is generated from them
(scripts/gen_docs_tables.py; a test fails when it differs).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_WARN_STRICT = 3
EXIT_DATA = 4
EXIT_RUN = 5
EXIT_PARITY = 6
EXIT_NODE = 7
EXIT_CRASH = 70
EXIT_CANNOT_TEST = 125
EXIT_INTERRUPTED = 130

# Every exit code -> what it means (every EXIT_* above has its entry: tests/test_docs_tables.py holds it).
EXIT_MEANINGS: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAIL: "the audit found a FAIL (`--force` runs anyway); `probe`: a memory regression (\"bad\" for `git bisect run`)",
    EXIT_USAGE: "bad command line, profile or input file: one line names the file, the key or flag, the value and what is "
                "valid; also a refused output path (docs/data.md), a run directory in use by another run, and an "
                "endpoint that refuses `generate`'s API key (at its start-up probe, before any prompt is sent)",
    EXIT_WARN_STRICT: "`audit --strict` found a WARN (and no FAIL)",
    EXIT_DATA: "the data is unusable or damaged (too many degenerate samples; `train --resume` when no checkpoint is "
               "whole; a training step whose loss is not finite, or more than train.max_skipped_steps steps in a "
               "row without a supervised position: the run stops before saving it)",
    EXIT_RUN: "a launched job (torchrun, a server) failed; the message names the cause: the rank that died, was killed "
              "or stopped, not the one that noticed (docs/failures.md); also `generate` when every request it sent failed, "
              "or its first requests all failed the same way (it stops early)",
    EXIT_PARITY: "`eval --engine`: the served drafter fails the parity gate, or the gate cannot decide (too few prompts, "
                 "no per-step figures from the engine: undecided never passes; docs/parity-gate.md)",
    EXIT_NODE: "the node, not the input: a full disk (`disk full: writing X to PATH needs about N bytes; M free`), a "
               "read-only filesystem, permission denied on a path the command writes, the host out of memory; one line "
               "names the path and what to do. The same command may pass on another node (a scheduler may retry it "
               "there)",
    EXIT_CRASH: "an unexpected error (a bug, not bad input): one line names the command and the file its traceback "
                "was written to (launcher_core.crash)",
    EXIT_CANNOT_TEST: "`probe` / `calibrate` cannot test this environment (`git bisect run`: skip); `probe` exits "
                      "125 on an unexpected error too",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM): training stops after its step with a checkpoint to `--resume` "
                      "from; a second one stops it at once",
}


class LauncherError(Exception):
    """Base class: a failure the user can act on. `exit_code` is what the CLI returns; `label` starts its line."""

    exit_code = EXIT_USAGE
    label = "error"


class ConfigError(LauncherError):
    """A profile, flag or config value is wrong. The message names the file/field and the valid choices."""

    exit_code = EXIT_USAGE


class InputError(LauncherError):
    """An input file is missing or malformed. The message names the file (and line)."""

    exit_code = EXIT_USAGE


class NodeFault(LauncherError):
    """The node failed the command, not its input: a read-only filesystem, permission denied on a path it
    writes, the host out of memory (launcher_core.nodefault). The message names the path and what to do."""

    exit_code = EXIT_NODE


class DiskFull(NodeFault):
    """A write found its filesystem full (ENOSPC, EDQUOT): the node's error, not a bug. The
    message names the path, the bytes the write needed and the bytes free (launcher_core.diskfull)."""


class DataError(LauncherError):
    """The data is readable but unusable (degenerate share too high, incompatible datasets...)."""

    exit_code = EXIT_DATA


class PreflightFailed(LauncherError):
    """The preflight audit found a FAIL before a run (use --force to run anyway)."""

    exit_code = EXIT_FAIL


class Interrupted(LauncherError):
    """A run stopped before its end by Ctrl-C or SIGTERM; the message says what was saved and how to continue."""

    exit_code = EXIT_INTERRUPTED
    label = "interrupted"


class RunFailed(LauncherError):
    """A launched process (torchrun rank, server) failed."""

    exit_code = EXIT_RUN


class ParityFailed(LauncherError):
    """The served drafter is not the trained one: the parity gate (dflash/eval/parity.py) failed. `rules`:
    the names of the rules broken; `report`: the engine report that holds the per-prompt figures."""

    exit_code = EXIT_PARITY

    def __init__(self, message: str, rules: tuple[str, ...] = (), report: str = ""):
        super().__init__(message)
        self.rules, self.report = rules, report


class CannotTest(LauncherError):
    """The probe cannot test this environment (git bisect run's 'skip')."""

    exit_code = EXIT_CANNOT_TEST


def first_line(error: BaseException, limit: int = 200) -> str:
    """An error's first line (its type's name when it says nothing), cut to `limit` characters: for a message
    that names what could not be read without pasting a library's whole report."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def exit_code_for(error: BaseException) -> int:
    """The single place that decides the exit code of an exception reaching the CLI."""
    if isinstance(error, LauncherError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    raise error
