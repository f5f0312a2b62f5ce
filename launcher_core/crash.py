"""The funnel for unexpected errors: an exception that is not a LauncherError is a bug (or an
input no check knows yet). Its traceback goes to a file, secrets masked, and the CLI prints one
line naming the command and that file, then exits with EXIT_CRASH (`probe`: EXIT_CANNOT_TEST,
so `git bisect run` skips the commit instead of calling it bad).

The file lands in the project's cache (`launcher_core.paths.cache_dir()`/crashes), or, when the
cache cannot be written, in the system's temporary directory.
"""
from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

from launcher_core.errors import EXIT_CANNOT_TEST, EXIT_CRASH, EXIT_NODE

CRASH_DIR = "crashes"
# Commands whose exit code is read by `git bisect run`: a crash is "cannot test" (skip), not "bad".
BISECT_COMMANDS = ("probe",)


def crash_exit_code(command: str) -> int:
    return EXIT_CANNOT_TEST if command in BISECT_COMMANDS else EXIT_CRASH


def known_exit_code(command: str, code: int) -> int:
    """The exit code of a known error: a node's fault (EXIT_NODE) in a bisect command is "cannot test" too
    (the commit may be good on a node that works), not "bad"."""
    return EXIT_CANNOT_TEST if command in BISECT_COMMANDS and code == EXIT_NODE else code


def crash_report_text(command: str, argv: Sequence[str], error: BaseException) -> str:
    """The traceback and the command line, secrets masked (`launcher_core.redact`): the argv's
    secret flags and URL credentials, and anywhere in the text the URLs' credentials and the values
    of secret-looking environment variables."""
    from launcher_core.redact import redact_argv, redact_text, secret_values

    secrets = secret_values(os.environ)
    lines = [f"launcher.py {command} crashed at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
             "argv: " + " ".join(redact_argv(argv, secrets)), "",
             *traceback.format_exception(type(error), error, error.__traceback__)]
    return redact_text("\n".join(line.rstrip("\n") for line in lines) + "\n", secrets)


def write_crash_report(command: str, argv: Sequence[str], error: BaseException) -> Path:
    """Write the traceback to `<cache>/crashes/<command>-<time>-<pid>.txt`; returns the path."""
    from launcher_core.fileio import write_text_atomic

    name = f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    text = crash_report_text(command, argv, error)
    for folder in _crash_folders():
        try:
            return write_text_atomic(folder / name, text)
        except OSError:
            continue
    raise error


def _crash_folders() -> list[Path]:
    folders = []
    try:
        from launcher_core.paths import cache_dir

        folders.append(cache_dir() / CRASH_DIR)
    except OSError:
        pass
    return [*folders, Path(tempfile.gettempdir()) / "dflash-launcher-crashes"]


def crash_line(command: str, error: BaseException, report: Path) -> str:
    """The one line the user sees: what crashed, the exception type, where the traceback is."""
    return (f"error: launcher.py {command} failed unexpectedly ({type(error).__name__}); this is a bug or an input "
            f"no check recognises. Traceback written to {report}; please include it in a report.")
