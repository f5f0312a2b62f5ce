"""Run a bisect: build each candidate environment, probe it, log it, until one group is left.

The probe is any command following `git bisect run`'s exit codes (0 good, 125 skip, 1-127
bad; 128 and above, or a signal, aborts). By default it is `launcher.py probe` run with the
candidate venv's python: GOOD's probe report becomes the baseline the others are judged
against (passed as ENVCHECK_PROBE_BASELINE; each step's report goes to ENVCHECK_PROBE_OUT).

Groups come from the packages' metadata (`changes.group_changes`). A candidate that is still
inconsistent (`uv pip check` names a conflict between two groups) teaches the bisect a coupling:
it logs it, regroups (the two groups merge, or the needed one moves first) and goes on; logged
steps are matched to the new candidates by the set of packages they applied, so none is probed
twice. Only a candidate whose conflict no regrouping can fix is skipped.
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

from envcheck.bisect.changes import Change, Group, apply_groups, diff_sets, group_changes
from envcheck.bisect.coupling import Coupling, learned_couplings
from envcheck.bisect.log import BisectLog, LearnedRecord, StepRecord
from envcheck.bisect.metadata import MetadataMap, collect_metadata, save_cache
from envcheck.bisect.reqsets import RequirementSet, load_requirement_set
from envcheck.bisect.search import Outcome, next_candidate, search_state
from envcheck.bisect.venvs import InstallerOptions, build_candidate, venv_python
from launcher_core.errors import CannotTest, ConfigError, InputError, RunFailed
from launcher_core.fileio import write_text_atomic
from launcher_core.paths import REPO_ROOT

DEFAULT_PROBE = f"{{python}} {shlex.quote(str(REPO_ROOT / 'launcher.py'))} probe"
SKIP_CODE = 125
CRASH_MARK = "Traceback (most recent call last):"   # a Python crash, not a memory verdict


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
    use_metadata: bool = True                   # False: hard-coded families only
    learn_conflicts: bool = True                # False: an inconsistent candidate is only skipped


@dataclass
class BisectPlan:
    good: RequirementSet
    groups: list[Group]
    header: dict
    changes: list[Change] = field(default_factory=list)
    metadata: MetadataMap = field(default_factory=dict)
    extra_groups: list[str] = field(default_factory=list)


def plan_bisect(config: BisectConfig, write_cache: bool = False) -> BisectPlan:
    """Read both sets, read the changed packages' metadata and group the changes (builds nothing)."""
    good, bad = load_requirement_set(config.good), load_requirement_set(config.bad)
    changes = diff_sets(good, bad)
    if not changes:
        raise InputError(f"{config.good} and {config.bad} pin the same versions: nothing to bisect")
    metadata = _metadata(config, changes, write_cache) if config.use_metadata else {}
    groups = group_changes(changes, config.extra_groups, metadata)
    return BisectPlan(good, groups, _header(config, groups), changes, metadata, list(config.extra_groups))


def _metadata(config: BisectConfig, changes: list[Change], write_cache: bool) -> MetadataMap:
    cache = config.work_dir / "metadata.json"
    pins = [pin for change in changes for pin in (change.old, change.new) if pin is not None]
    metadata = collect_metadata(pins, config.installer, cache)
    if write_cache and metadata:
        save_cache(cache, metadata)
    return metadata


def regroup(plan: BisectPlan, learned: list[LearnedRecord]) -> BisectPlan:
    """The plan with the logged learned couplings applied (the header, and so the log, stays)."""
    if not learned:
        return plan
    couplings = [Coupling(item.mover, item.needs, item.reason, "check") for item in learned]
    groups = group_changes(plan.changes, plan.extra_groups, plan.metadata, couplings)
    return BisectPlan(plan.good, groups, plan.header, plan.changes, plan.metadata, plan.extra_groups)


def learn_from(plan: BisectPlan, record: StepRecord, known: list[LearnedRecord]) -> list[LearnedRecord]:
    """The couplings an inconsistent step shows that change the grouping; [] when none does."""
    changed = {change.name for change in plan.changes}
    found = learned_couplings(record.conflicts, set(record.packages), changed, record.step)
    new = [LearnedRecord(record.step, c.mover, c.needs, c.reason) for c in found]
    before = [(group.name, group.packages) for group in plan.groups]
    after = [(group.name, group.packages) for group in regroup(plan, [*known, *new]).groups]
    return new if after != before else []


def outcomes_for(plan: BisectPlan, steps: list[StepRecord]) -> dict[int, Outcome]:
    """The logged outcomes of the candidates of this grouping, matched by applied packages."""
    prefixes = {frozenset(_applied(plan.groups[:k])): k for k in range(len(plan.groups) + 1)}
    outcomes: dict[int, Outcome] = {}
    for step in steps:
        k = prefixes.get(frozenset(step.packages))
        if k is not None and step.reason != "regrouped":
            outcomes[k] = step.result
    return outcomes


def _applied(groups: list[Group]) -> list[str]:
    return [name for group in groups for name in group.packages]


def _header(config: BisectConfig, groups: list[Group]) -> dict:
    described = [[group.name, group.describe()] for group in groups]
    identity = json.dumps([described, config.probe])   # --verify-bad may be added on resume
    return {"kind": "bisect", "good": str(config.good), "bad": str(config.bad), "groups": described,
            "probe": config.probe, "fingerprint": hashlib.sha256(identity.encode()).hexdigest()[:16]}


def run_bisect(config: BisectConfig) -> tuple[BisectPlan, BisectLog, bool]:
    """Search until done (True) or until `max_steps` new steps ran (False: resume later)."""
    plan = plan_bisect(config, write_cache=True)
    log = BisectLog.open(config.log_path, plan.header, fresh=config.fresh)
    plan = regroup(plan, log.learned)
    outcomes = outcomes_for(plan, log.steps)
    new_steps = 0
    while (k := next_candidate(len(plan.groups), outcomes, config.verify_bad)) is not None:
        if config.max_steps is not None and new_steps >= config.max_steps:
            return plan, log, False
        record = run_step(config, plan, k, step=len(log.steps) + 1, baseline=_baseline(log))
        learned = learn_from(plan, record, log.learned) if config.learn_conflicts and record.reason == "inconsistent" else []
        record.reason = "regrouped" if learned else record.reason
        log.append(record)
        new_steps += 1
        if learned:
            for item in learned:
                log.append_learned(item)
            plan = regroup(plan, log.learned)
            outcomes = outcomes_for(plan, log.steps)
        else:
            outcomes[k] = record.result
    _check_good_was_good(config, log)
    _check_bad_builds(config, plan, log, outcomes)
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


BUILD_FAILED_REASONS = ("inconsistent", "venv failed", "install failed", "check failed")


def _check_bad_builds(config: BisectConfig, plan: BisectPlan, log: BisectLog, outcomes: dict[int, Outcome]) -> None:
    """A culprit range that reaches BAD rests on BAD being a real environment: when BAD was never
    probed bad, it must at least build. If it cannot, no group is to blame (InputError)."""
    groups = len(plan.groups)
    if search_state(groups, outcomes).hi != groups or outcomes.get(groups) == "bad":
        return
    record = next((step for step in log.steps if step.k == groups and step.reason in BUILD_FAILED_REASONS), None)
    if record is None and groups not in outcomes:
        record = build_only(config, plan, groups, step=len(log.steps) + 1)
        if record is None:
            return
        log.append(record)
    if record is not None:
        raise InputError(f"BAD ({config.bad}) cannot be built ({record.reason}: {record.message.strip()[:300]}): "
                         "no culprit. Fix the BAD set (a pin that does not exist or conflicts) and rerun with --fresh")


def build_only(config: BisectConfig, plan: BisectPlan, k: int, step: int) -> Optional[StepRecord]:
    """Build candidate k without probing it: None when it builds, else the (skip) record of the failure."""
    applied = plan.groups[:k]
    venv_dir = config.work_dir / "venvs" / f"k{k:03d}"
    requirements = config.work_dir / "steps" / f"{step_stem(step, k)}.requirements.txt"
    built = build_candidate(config.installer, venv_dir, apply_groups(plan.good, applied), requirements)
    shutil.rmtree(venv_dir, ignore_errors=True)
    if built.ok:
        return None
    record = StepRecord(step=step, k=k, groups=[group.name for group in applied], result="skip",
                        packages=sorted(_applied(applied)), message=built.message, conflicts=built.conflicts,
                        reason="inconsistent" if built.inconsistent else f"{built.stage} failed")
    record.seconds.update(built.seconds)
    return record


def run_step(config: BisectConfig, plan: BisectPlan, k: int, step: int, baseline: Optional[str]) -> StepRecord:
    """Build GOOD + the first k groups in a scratch venv, check it, probe it."""
    applied = plan.groups[:k]
    record = StepRecord(step=step, k=k, groups=[group.name for group in applied], result="skip",
                        packages=sorted(_applied(applied)))
    venv_dir = config.work_dir / "venvs" / f"k{k:03d}"
    started = time.monotonic()
    requirements = config.work_dir / "steps" / f"{step_stem(step, k)}.requirements.txt"
    built = build_candidate(config.installer, venv_dir, apply_groups(plan.good, applied), requirements)
    record.seconds.update(built.seconds)
    if not built.ok:
        record.reason = "inconsistent" if built.inconsistent else f"{built.stage} failed"
        record.message, record.conflicts = built.message, built.conflicts
    else:
        _probe_into(record, config, venv_dir, baseline)
    if not config.keep_venvs:
        shutil.rmtree(venv_dir, ignore_errors=True)
    record.seconds["total"] = round(time.monotonic() - started, 3)
    return record


def step_stem(step: int, k: int) -> str:
    """File name stem of a step's requirements, probe log and report: `step03-k005`."""
    return f"step{step:02d}-k{k:03d}"


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
    report = steps_dir / f"{step_stem(record.step, record.k)}.json"
    report.unlink(missing_ok=True)
    argv, env = probe_command(config.probe, venv_dir, report, None if record.k == 0 else baseline)
    started = time.monotonic()
    code, output = _run_probe(argv, env, config.probe_timeout_s)
    record.seconds["probe"] = round(time.monotonic() - started, 3)
    write_text_atomic(steps_dir / f"{step_stem(record.step, record.k)}.log", output)
    record.exit_code, record.result = code, _outcome(code, argv)
    record.reason = "cannot test" if code == SKIP_CODE else ""
    record.message = " | ".join(output.strip().splitlines()[-3:])
    if report.exists():
        record.probe_report = str(report)
        record.memory_mib = _headline(report)
    not_a_verdict = _not_a_verdict(code, output, report.exists(), expects_report(config.probe))
    if not_a_verdict and record.result != "skip":
        record.result, record.reason = "skip", not_a_verdict


def expects_report(probe: str) -> bool:
    """The default probe (`launcher.py probe`) and probes that name {out} write a report."""
    return probe.startswith(DEFAULT_PROBE) or "{out}" in probe


def _not_a_verdict(code: int, output: str, wrote_report: bool, wants_report: bool) -> str:
    """Why a probe run is not a verdict ("" when it is): it crashed, or wrote no result."""
    if code != 0 and CRASH_MARK in output:
        return "probe crashed"
    if wants_report and not wrote_report:
        return "no probe result"
    return ""


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
