"""The run directory's manifest: each stage's state and figures, updated atomically.

`launcher.py status RUN_DIR` reads it; every stage calls `update_stage` as it goes, so nobody
keeps a progress file by hand. Updates are read-modify-write under an exclusive lock and land
with an atomic rename, so concurrent writers and crashes never corrupt it. A manifest damaged by
other hands (not JSON, cut short, `stages` or a stage entry not an object, a `state` that is not a
stage state, a path or time that is not a string) is an InputError naming the file and the key
(exit 2), whichever command reads or updates it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Any, Iterator, Literal

from launcher_core.fileio import make_run_dir, write_json_atomic

MANIFEST_NAME = "manifest.json"
STAGES = ("audit", "generate", "tokenize", "train", "eval")
StageState = Literal["pending", "running", "done", "failed", "skipped"]
# Figures that describe how a stage last stopped; a stage that runs again or finishes drops them.
STOP_KEYS = ("error", "exit_code", "failed_rank", "stopped_at_step", "ended_by", "hint")
STATES = ("pending", "running", "done", "failed", "skipped")
# Entry keys the commands read as text (paths, times), or null: any other type is damage, not a figure.
TEXT_KEYS = ("updated_at", "output", "dataset", "checkpoint", "validation_best_checkpoint", "ended_by", "error", "hint")


def manifest_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MANIFEST_NAME


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The manifest as a dict ({"stages": {...}}); empty stages when there is none yet."""
    from launcher_core.fileio import read_json_object

    path = manifest_path(run_dir)
    if not path.exists():
        return {"stages": {}}
    document = read_json_object(path, "a run manifest")    # damaged: InputError naming it
    document.setdefault("stages", {})
    from launcher_core.errors import InputError

    if not isinstance(document["stages"], dict):
        raise InputError(f"{path}: `stages` is not an object; the manifest is damaged (move it aside to start over)")
    for name, entry in document["stages"].items():
        problem = entry_problem(entry)
        if problem:
            raise InputError(f"{path}: stages.{name}{problem}; the manifest is damaged (move it aside to start over)")
    return document


def entry_problem(entry: object) -> str:
    """What is wrong with one stage entry ("" when nothing), as the tail of `stages.NAME...`."""
    if not isinstance(entry, dict):
        return f" is {_kind(entry)}, not an object"
    state = entry.get("state", "pending")
    if state not in STATES:
        return f".state is {state!r}; valid: {', '.join(STATES)}"
    wrong = next((key for key in TEXT_KEYS if not isinstance(entry.get(key), (str, type(None)))), None)
    if wrong is not None:
        return f".{wrong} is {_kind(entry[wrong])}; valid: a string (or null)"
    return ""


def _kind(value: object) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    make_run_dir(run_dir)
    with (run_dir / f".{MANIFEST_NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update_stage(run_dir: str | Path, stage: str, state: StageState | None = None, **figures: Any) -> dict:
    """Merge `figures` (JSON-serialisable) into the stage's entry and set its state. Every string
    goes through the redaction (`launcher_core.redact`): an endpoint's credentials, a secret flag
    in a command line or an error message never reach the file."""
    from launcher_core.redact import redact_document, secret_values

    run_dir = Path(run_dir)
    figures = redact_document(figures, secret_values(os.environ))
    with _locked(run_dir):
        document = read_manifest(run_dir)
        entry = document["stages"].setdefault(stage, {"state": "pending"})
        if state is not None:
            entry["state"] = state
        if state in ("running", "done"):
            for key in STOP_KEYS:
                entry.pop(key, None)
        entry.update(figures)
        entry["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_json_atomic(manifest_path(run_dir), document)
    return entry
