"""The preflight audit: snapshot + checks against the profile, its pins and its baseline.

`run_preflight` is what `train`, `generate` and `pipeline` call before spending GPU time.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from envcheck.checks import CheckInput, Finding, RamNeed, run_checks
from envcheck.snapshot import Snapshot
from launcher_core.errors import ConfigError, PreflightFailed
from launcher_core.schema import Profile


def requirements_path(profile: Profile) -> Path:
    from launcher_core.paths import REPO_ROOT

    path = Path(profile.machine.requirements)
    return path if path.is_absolute() else REPO_ROOT / path


def read_profile_pins(profile: Profile) -> dict[str, str]:
    from envcheck.packages import read_pins

    path = requirements_path(profile)
    if not path.exists():
        raise ConfigError(f"profile {profile.name}: key 'machine.requirements' names {path.name}, which does not exist")
    return read_pins(path)


def disk_paths(profile: Profile, run_dir: Path | None = None) -> list[Path]:
    """Where the run writes: the run directory the command will really use (`--run-dir`, else the
    profile's paths.run_dir; completions, dataset, checkpoints live under it)."""
    from launcher_core.profile import expand_path

    return [Path(run_dir) if run_dir is not None else expand_path(profile, profile.paths.run_dir)]


def live_snapshot(profile: Profile, cuda_probe: bool = False, run_dir: Path | None = None) -> Snapshot:
    from envcheck.collect import collect_snapshot

    return collect_snapshot(disk_paths(profile, run_dir), cuda_probe=cuda_probe)


def audit(profile: Profile, snapshot: Snapshot, baseline: Optional[Snapshot] = None, *,
          use_saved_baseline: bool = True, ram_at_start: Optional[RamNeed] = None) -> list[Finding]:
    """Run every check. Without an explicit baseline, the profile's saved one for the snapshot's host.
    The target's facts come from its config.json (envcheck.target_architecture), read here; `ram_at_start` is the
    workload's host RAM at start (the caller's: the machine layer does not model the workload)."""
    from envcheck.baseline import load_baseline
    from envcheck.target_architecture import read_target_architecture

    if baseline is None and use_saved_baseline:
        baseline = load_baseline(profile.name, snapshot.hostname or None)
    context = CheckInput(snapshot=snapshot, profile=profile, baseline=baseline,
                         pins=read_profile_pins(profile), pins_file=profile.machine.requirements,
                         target=read_target_architecture(profile), ram_at_start=ram_at_start)
    return run_checks(context)


def run_preflight(profile: Profile, *, force: bool = False, run_dir: Path | None = None,
                  snapshot: Snapshot | None = None, ram_at_start: Optional[RamNeed] = None) -> list[Finding]:
    """Audit before a run: print the findings, record them, raise PreflightFailed on a FAIL unless forced."""
    from envcheck import findings_format

    snapshot = snapshot if snapshot is not None else live_snapshot(profile, run_dir=run_dir)
    findings = audit(profile, snapshot, ram_at_start=ram_at_start)
    print(scrub(findings_format.format_table(findings, title=f"preflight audit ({profile.name})")), file=sys.stderr)
    if run_dir is not None:
        _record(Path(run_dir), profile, findings, force)
    failed = [f for f in findings if f.status == "FAIL"]
    if failed and not force:
        listing = "\n".join(f"  {f.id}: {f.message}" for f in failed)
        raise PreflightFailed(f"preflight audit found {len(failed)} FAIL(s):\n{listing}\n"
                              "fix them (see the hints above), or pass --force to skip this check")
    return findings


def _record(run_dir: Path, profile: Profile, findings: list[Finding], force: bool) -> None:
    from envcheck import findings_format
    from launcher_core.fileio import write_json_atomic
    from launcher_core.manifest import StageState, update_stage

    document = findings_format.findings_document(findings, profile=profile.name, forced=force)
    write_json_atomic(run_dir / "audit" / "findings.json", scrub_document(document))
    failed = document["counts"]["FAIL"]
    state: StageState = "failed" if failed and not force else "done"
    update_stage(run_dir, "audit", state, forced=force, **{k.lower(): v for k, v in document["counts"].items()})


def scrub(text: str) -> str:
    """Mask the values of secret-looking environment variables wherever they appear."""
    from launcher_core.redact import redact_value, secret_values

    return redact_value("", text, secret_values(os.environ))


def scrub_document(document):
    from launcher_core.redact import redact_document, secret_values

    return redact_document(document, secret_values(os.environ))
