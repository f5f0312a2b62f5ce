"""`launcher.py status RUN_DIR`: each stage's state and figures, read from the run's manifest.

Every stage updates `manifest.json` atomically as it goes; this only reads it. A training run that
ended before its last step (a rank failed or was killed, Ctrl-C, SIGTERM, its launcher killed) gets a
note naming its last checkpoint and the `train --resume` that continues from it (`resume_notes`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HIDDEN_KEYS = ("state", "updated_at")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="the run directory (e.g. runs/cpu-demo)")
    parser.add_argument("--profile", metavar="P", help="instead of RUN_DIR: the profile's paths.run_dir")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")


def run(args: argparse.Namespace) -> int:
    from launcher_core.errors import ConfigError, InputError
    from launcher_core.manifest import manifest_path, read_manifest

    run_dir = resolve_run_dir(args.run_dir, args.profile)
    if not manifest_path(run_dir).exists():
        if not run_dir.is_dir():
            raise InputError(f"{run_dir}: no such run directory")
        raise InputError(f"{run_dir}: no {manifest_path(run_dir).name} yet; no stage has run in this directory")
    try:
        manifest = read_manifest(run_dir)
    except json.JSONDecodeError as error:
        raise InputError(f"{manifest_path(run_dir)}: line {error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(manifest.get("stages"), dict):
        raise ConfigError(f"{manifest_path(run_dir)}: expected an object with 'stages'")
    print(json.dumps(manifest, indent=2, sort_keys=True) if args.json else format_status(run_dir, manifest))
    for line in orphaned_stages(run_dir, manifest) + resume_notes(run_dir, manifest, args.profile):
        print(line)
    return 0


def resume_notes(run_dir: Path, manifest: dict[str, Any], profile: str | None = None) -> list[str]:
    """A train stage that ended before its last step (failed, or stopped and pending again): what ended it
    and the command that continues it, from its last checkpoint when it has one. `profile`: the --profile
    status was given (else the run's own, from train/profile.json; `P` where that cannot be read)."""
    entry = manifest["stages"].get("train") or {}
    state, ended_by = entry.get("state"), entry.get("ended_by")
    if state != "failed" and not (state == "pending" and (ended_by or "stopped_at_step" in entry)):
        return []
    verb = "failed" if state == "failed" else "stopped"
    how = str(ended_by) if str(ended_by).startswith(verb) else f"{verb} ({ended_by})" if ended_by else verb
    command = f"launcher.py train --profile {profile or trained_profile(run_dir) or 'P'} --run-dir {run_dir}"
    checkpoint = last_checkpoint(run_dir)
    if checkpoint is None:
        return [f"note: train {how} before its first checkpoint; `{command}` starts it again"]
    return [f"note: train {how}; its last checkpoint is {checkpoint}: `{command} --resume` continues from it"]


def trained_profile(run_dir: Path) -> str | None:
    """The name of the profile the run trained (train/profile.json, written at each launch); None when unreadable."""
    from dflash.train.supervisor.launch import TrainPaths

    try:
        name = json.loads(TrainPaths(run_dir).profile_json.read_text(encoding="utf-8")).get("name")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def last_checkpoint(run_dir: Path) -> str | None:
    """The step directory `latest` names when it is there, else the newest `step-N` (None: none yet).
    Read only: `train --resume` verifies it and falls back to an older whole one when it is damaged."""
    from dflash.drafter.checkpoint_files import LATEST, checkpoints_dir
    from dflash.train.supervisor.resume import step_directories

    directory = checkpoints_dir(run_dir)
    try:
        named = (directory / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    if named and "/" not in named and (directory / named).is_dir():
        return named
    steps = step_directories(directory) if directory.is_dir() else []
    return steps[0].name if steps else None


def orphaned_stages(run_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """A stage still "running" whose launcher is gone and holds no lock on the run directory: it
    was killed without a word (the manifest could not say so); `train --resume` records it."""
    from launcher_core.processes import process_alive
    from launcher_core.runlock import lock_holder

    if lock_holder(run_dir) is not None:
        return []
    lines = []
    for name, entry in manifest["stages"].items():
        pid = entry.get("launcher_pid")
        if entry.get("state") == "running" and isinstance(pid, int) and not process_alive(pid):
            lines.append(f"note: {name} says running, but its launcher (pid {pid}) is gone and nothing holds the run "
                         f"directory: it was killed. `launcher.py {name} --resume` continues from the last checkpoint.")
    return lines


def resolve_run_dir(run_dir: str | None, profile_name: str | None) -> Path:
    from launcher_core.errors import ConfigError

    if run_dir and not profile_name:
        return Path(run_dir)
    if run_dir or not profile_name:
        raise ConfigError("give either RUN_DIR or --profile P (one of them)")
    from launcher_core.profile import expand_path, load_profile

    profile = load_profile(profile_name)
    return expand_path(profile, profile.paths.run_dir)


def format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def format_status(run_dir: Path, manifest: dict[str, Any]) -> str:
    """One line per stage (pipeline order first): state, figures, last update."""
    from launcher_core.manifest import STAGES

    stages = manifest["stages"]
    names = [name for name in STAGES] + sorted(set(stages) - set(STAGES))
    lines = [f"run {run_dir}"]
    for name in names:
        entry = stages.get(name, {"state": "pending"})
        figures = "  ".join(f"{key}={format_value(value)}" for key, value in entry.items() if key not in HIDDEN_KEYS)
        updated = f"  [{entry['updated_at']}]" if "updated_at" in entry else ""
        lines.append(f"  {name:<9} {entry.get('state', '?'):<8} {figures}{updated}".rstrip())
    return "\n".join(lines)
