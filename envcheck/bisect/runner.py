"""Run a bisect: build each candidate environment, probe it, log it, until one group is left.

The probe is any command following `git bisect run`'s exit codes (0 good, 125 skip, 1-127
bad; 128 and above, or a signal, aborts). By default it is `launcher.py probe` run with the
candidate venv's python: GOOD's probe report becomes the baseline the others are judged
against (passed as ENVCHECK_PROBE_BASELINE; each step's report goes to ENVCHECK_PROBE_OUT).
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from envcheck.bisect.changes import Group, apply_groups, diff_sets, group_changes
from envcheck.bisect.log import BisectLog, StepRecord
from envcheck.bisect.reqsets import RequirementSet, load_requirement_set
from envcheck.bisect.search import Outcome, next_candidate
from envcheck.bisect.venvs import InstallerOptions, build_candidate, venv_python
from core.errors import CannotTest, ConfigError, InputError, RunFailed
from core.paths import REPO_ROOT

DEFAULT_PROBE = f"{{python}} {shlex.quote(str(REPO_ROOT / 'launcher.py'))} probe"
SKIP_CODE = 125


@dataclass
class BisectConfig:
    good: Path
    bad: Path
    work_dir: Path                              # venvs/, steps/, report.json live here
    log_path: Path
    probe: str = DEFAULT_PROBE                  # command line; {python} {venv} {out} are expanded
    installer: InstallerOptions = field(default_factory=InstallerOptions)
    extra_groups: list[str] = field(default_factory=list)
    verify_bad: bool = False
    max_steps: Optional[int] = None             # stop after this many new steps (resume later)
    fresh: bool = False
    keep_venvs: bool = False
    probe_timeout_s: float = 1800.0


@dataclass
class BisectPlan:
    good: RequirementSet
    groups: list[Group]
    header: dict


def plan_bisect(config: BisectConfig) -> BisectPlan:
    """Read both sets and group their differences (starts nothing)."""
    good, bad = load_requirement_set(config.good), load_requirement_set(config.bad)
    groups = group_changes(diff_sets(good, bad), config.extra_groups)
    if not groups:
        raise InputError(f"{config.good} and {config.bad} pin the same versions: nothing to bisect")
    return BisectPlan(good, groups, _header(config, groups))


def _header(config: BisectConfig, groups: list[Group]) -> dict:
    described = [[group.name, group.describe()] for group in groups]
    identity = json.dumps([described, config.probe])   # --verify-bad may be added on resume
    return {"kind": "bisect", "good": str(config.good), "bad": str(config.bad), "groups": described,
            "probe": config.probe, "fingerprint": hashlib.sha256(identity.encode()).hexdigest()[:16]}


def run_bisect(config: BisectConfig) -> tuple[BisectPlan, BisectLog, bool]:
    """Search until done (True) or until `max_steps` new steps ran (False: resume later)."""
    plan = plan_bisect(config)
    log = BisectLog.open(config.log_path, plan.header, fresh=config.fresh)
    outcomes: dict[int, Outcome] = {step.k: step.result for step in log.steps}
    new_steps = 0
    while (k := next_candidate(len(plan.groups), outcomes, config.verify_bad)) is not None:
        if config.max_steps is not None and new_steps >= config.max_steps:
            return plan, log, False
        record = run_step(config, plan, k, step=len(log.steps) + 1, baseline=_baseline(log))
        log.append(record)
        outcomes[k] = record.result
        new_steps += 1
    _check_good_was_good(config, log)
    return plan, log, True


def _baseline(log: BisectLog) -> Optional[str]:
    for step in log.steps:
        if step.k == 0 and step.result == "good" and step.probe_report and Path(step.probe_report).exists():
            return step.probe_report
    return None


def _check_good_was_good(config: BisectConfig, log: BisectLog) -> None:
    good = next(step for step in log.steps if step.k == 0)
    if good.result == "bad":
        raise ConfigError(f"GOOD ({config.good}) is already bad under this probe: nothing to bisect")
    if good.result == "skip":
        raise CannotTest(f"GOOD ({config.good}) cannot be tested ({good.reason}): {good.message}")


def run_step(config: BisectConfig, plan: BisectPlan, k: int, step: int, baseline: Optional[str]) -> StepRecord:
    """Build GOOD + the first k groups in a scratch venv, check it, probe it."""
    applied = plan.groups[:k]
    record = StepRecord(step=step, k=k, groups=[group.name for group in applied], result="skip")
    venv_dir = config.work_dir / "venvs" / f"k{k:03d}"
    started = time.monotonic()
    requirements = config.work_dir / "steps" / f"k{k:03d}.requirements.txt"
    built = build_candidate(config.installer, venv_dir, apply_groups(plan.good, applied), requirements)
    record.seconds.update(built.seconds)
    if not built.ok:
        record.reason = "inconsistent" if built.inconsistent else f"{built.stage} failed"
        record.message = built.message
    else:
        _probe_into(record, config, venv_dir, baseline)
    if not config.keep_venvs:
        shutil.rmtree(venv_dir, ignore_errors=True)
    record.seconds["total"] = round(time.monotonic() - started, 3)
    return record


def probe_command(template: str, venv_dir: Path, report: Path, baseline: Optional[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the probe for one candidate: its python first on PATH, report paths in env."""
    python = str(venv_python(venv_dir))
    values = {"python": python, "venv": str(venv_dir), "out": str(report)}
    argv = [token.format(**values) for token in shlex.split(template)]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python
    env = dict(os.environ)
    env.update(VIRTUAL_ENV=str(venv_dir), ENVCHECK_PROBE_OUT=str(report),
               PATH=os.pathsep.join([str(venv_dir / "bin"), env.get("PATH", "")]))
    env.pop("ENVCHECK_PROBE_BASELINE", None)
    if baseline:
        env["ENVCHECK_PROBE_BASELINE"] = baseline
    return argv, env


def _probe_into(record: StepRecord, config: BisectConfig, venv_dir: Path, baseline: Optional[str]) -> None:
    steps_dir = config.work_dir / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    report = steps_dir / f"k{record.k:03d}.json"
    report.unlink(missing_ok=True)
    argv, env = probe_command(config.probe, venv_dir, report, None if record.k == 0 else baseline)
    started = time.monotonic()
    code, output = _run_probe(argv, env, config.probe_timeout_s)
    record.seconds["probe"] = round(time.monotonic() - started, 3)
    (steps_dir / f"k{record.k:03d}.log").write_text(output, encoding="utf-8")
    record.exit_code, record.result = code, _outcome(code, argv)
    record.reason = "cannot test" if code == SKIP_CODE else ""
    record.message = " | ".join(output.strip().splitlines()[-3:])
    if report.exists():
        record.probe_report = str(report)
        record.memory_mib = _headline(report)


def _run_probe(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    try:
        completed = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise ConfigError(f"probe command not found: {argv[0]!r}; check --probe") from None
    except subprocess.TimeoutExpired as expired:
        return SKIP_CODE, f"{expired.output or ''}\nprobe timed out after {timeout_s:.0f} s"
    return completed.returncode, completed.stdout


def _outcome(code: int, argv: list[str]) -> Outcome:
    """git bisect run's reading of an exit code; 128+ or a signal aborts the bisect."""
    if code == 0:
        return "good"
    if code == SKIP_CODE:
        return "skip"
    if 0 < code < 128:
        return "bad"
    raise RunFailed(f"the probe {shlex.join(argv)} exited with {code} (a crash or a signal, not a verdict); "
                    "the step was not logged, rerun the bisect to retry it")


def _headline(report: Path) -> Optional[float]:
    try:
        value = json.loads(report.read_text(encoding="utf-8")).get("headline_mib")
    except (json.JSONDecodeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
