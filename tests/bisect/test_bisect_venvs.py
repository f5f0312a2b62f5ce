"""End to end: real uv venvs built from a wheelhouse the test writes, real probes, no network."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envcheck.bisect.bisect_report import build_report
from envcheck.bisect.demo import build_demo, demo_probe
from envcheck.bisect.runner import BisectConfig, run_bisect
from envcheck.bisect.search import probe_bound
from envcheck.bisect.venvs import InstallerOptions, install_command

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = str(REPO_ROOT / "launcher.py")
PROBE = demo_probe().replace("launcher.py", LAUNCHER)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("bisect-demo")
    return build_demo(root), root / "uv-cache"


def _config(demo, work_dir: Path, **overrides) -> BisectConfig:
    paths, cache = demo
    installer = InstallerOptions(find_links=(str(paths.wheelhouse),), no_index=True, offline=True,
                                 cache_dir=str(cache))
    return BisectConfig(good=paths.good, bad=paths.bad, work_dir=work_dir, log_path=work_dir / "log.jsonl",
                        probe=overrides.pop("probe", PROBE), installer=installer, **overrides)


def _cli(demo, work_dir: Path, *extra: str, probe: str = PROBE) -> subprocess.CompletedProcess:
    paths, cache = demo
    argv = [sys.executable, LAUNCHER, "bisect", "--good", str(paths.good), "--bad", str(paths.bad),
            "--find-links", str(paths.wheelhouse), "--no-index", "--offline", "--cache-dir", str(cache),
            "--work-dir", str(work_dir), "--probe", probe, "--json", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)


def test_finds_memhog_within_the_probe_bound_with_the_coupled_pair_read_from_metadata(demo, tmp_path):
    plan, log, complete = run_bisect(_config(demo, tmp_path))
    report = build_report(plan, log, complete)
    assert complete and report["culprit"]["groups"] == ["memhog"] and report["culprit"]["exact"]
    assert [group.name for group in plan.groups] == ["alpha", "beta", "gadget", "jointa+jointb", "memhog", "relic", "zulu"]
    assert plan.groups[3].rules == ("metadata",) and "jointa 2.0 requires jointb==2.0 (GOOD has jointb 1.0)" in \
        plan.groups[3].reasons
    assert report["probes_used"] <= probe_bound(7) == 4
    assert report["culprit"]["memory_delta_mib"] > 150          # 10 MB -> 200 MB at import
    assert [step.result for step in log.steps if step.result == "skip"] == [], "no candidate is inconsistent"
    assert json.loads((tmp_path / "metadata.json").read_text())["jointa==2.0"]["requires"] == ["jointb==2.0"]
    assert not list((tmp_path / "venvs").glob("k*")), "scratch venvs are removed after each step"
    first_bad = next(step for step in log.steps if step.k == 5)
    culprit_env = (tmp_path / "steps" / f"step{first_bad.step:02d}-k005.requirements.txt").read_text()
    assert "memhog==2.0" in culprit_env and "relic==0.9" in culprit_env and "zulu==3.0" in culprit_env


def test_cli_stops_after_two_steps_and_resumes_from_its_log(demo, tmp_path):
    first = _cli(demo, tmp_path, "--max-steps", "2")
    assert first.returncode == 0, first.stderr
    partial = json.loads(first.stdout)
    assert not partial["complete"] and len(partial["steps"]) == 2
    second = _cli(demo, tmp_path)
    assert second.returncode == 0, second.stderr
    report = json.loads(second.stdout)
    assert report["complete"] and report["culprit"]["groups"] == ["memhog"]
    assert report["steps"][:2] == partial["steps"], "the logged steps are reused, not rerun"
    assert len({step["k"] for step in report["steps"]}) == len(report["steps"])
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["culprit"] == report["culprit"]


KILLER = """
import os, signal, sys
counter = sys.argv[1]
calls = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "w").write(str(calls))
if calls == int(sys.argv[2]):
    os.kill(os.getppid(), signal.SIGKILL)   # the bisect process dies mid-step
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""


def test_bisect_killed_mid_step_resumes_without_reprobing_logged_steps(demo, tmp_path):
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    counter = tmp_path / "probe-calls"
    probe = f"{{python}} {killer} {counter} 2 " + PROBE.removeprefix("{python} ")
    # without metadata the jointa/jointb coupling is learned from two inconsistent candidates
    killed = _cli(demo, tmp_path / "work", "--no-metadata", probe=probe)
    assert killed.returncode == -9
    logged = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()[1:]]
    steps = [(line["k"], line["result"], line["reason"]) for line in logged if line["kind"] == "step"]
    assert steps == [(0, "good", ""), (4, "skip", "regrouped"), (4, "skip", "regrouped")]
    assert [(line["mover"], line["needs"]) for line in logged if line["kind"] == "learned"] == \
        [("jointa", "jointb"), ("jointb", "jointa")]
    resumed = _cli(demo, tmp_path / "work", "--no-metadata", probe=probe)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["culprit"]["groups"] == ["memhog"]
    assert [group["name"] for group in report["groups"]][3] == "jointa+jointb"
    # probes: GOOD (1), the killed one (2), then the three the search still needed: k=3 again, 5, 4
    assert int(counter.read_text()) == 2 + 3
    assert [step["k"] for step in report["steps"]] == [0, 4, 4, 3, 5, 4]
    assert report["skipped"] == 0 and report["regrouped"] == 2


def test_pip_builds_the_same_candidate(demo, tmp_path):
    paths, _ = demo
    options = InstallerOptions(installer="pip", find_links=(str(paths.wheelhouse),), no_index=True)
    argv, _ = install_command(options, tmp_path / "venv", tmp_path / "reqs.txt")
    assert argv[1:3] == ["-m", "pip"] and "--no-deps" in argv and "--no-index" in argv
    config = BisectConfig(good=paths.good, bad=paths.bad, work_dir=tmp_path, log_path=tmp_path / "log.jsonl",
                          probe=PROBE, installer=options, max_steps=2, use_metadata=False)
    plan, log, complete = run_bisect(config)
    assert [(step.result, step.reason) for step in log.steps] == [("good", ""), ("skip", "regrouped")] and not complete
    assert log.steps[1].conflicts == ["jointa 2.0 has requirement jointb==2.0, but you have jointb 1.0."]
    assert [(item.mover, item.needs) for item in log.learned] == [("jointa", "jointb")]
