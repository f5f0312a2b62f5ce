"""Groups learned from the packages' own metadata, on a wheelhouse the test builds: two-way pins,
a chain, a one-way pair, an added and a removed package; real uv venvs and probes."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from envcheck.bisect.bisect_report import build_report
from envcheck.bisect.changes import diff_sets, group_changes
from envcheck.bisect.coupling import learned_couplings
from envcheck.bisect.demo import COUPLED_IMPORTED, build_coupled_demo, demo_probe
from envcheck.bisect.metadata import PackageMetadata, read_file_requires, read_local
from envcheck.bisect.reqsets import load_requirement_set
from envcheck.bisect.runner import BisectConfig, run_bisect
from envcheck.bisect.search import probe_bound
from envcheck.bisect.venvs import InstallerOptions, check_conflicts

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = str(REPO_ROOT / "launcher.py")
PROBE = demo_probe(COUPLED_IMPORTED).replace("launcher.py", LAUNCHER)
ORDER = ["base", "app+lib", "gadget", "core+plug", "foo", "util", "opt", "relic"]


@pytest.fixture(scope="module")
def coupled(tmp_path_factory):
    return build_coupled_demo(tmp_path_factory.mktemp("coupled"))


def _groups(demo):
    good, bad = load_requirement_set(demo.good), load_requirement_set(demo.bad)
    changes = diff_sets(good, bad)
    pins = [pin for change in changes for pin in (change.old, change.new) if pin is not None]
    return changes, read_local(pins, [str(demo.wheelhouse)])


def test_metadata_groups_two_way_pins_and_orders_one_way_chains_added_and_removed(coupled):
    changes, metadata = _groups(coupled)
    assert len(metadata) == 18 and metadata[("plug", "2.0")].requires == ("core==2.0", "gadget>=0.1")
    groups = {group.name: group for group in group_changes(changes, metadata=metadata)}
    assert list(groups) == ORDER
    assert groups["core+plug"].rules == ("metadata",)
    assert set(groups["core+plug"].reasons) == {"plug 2.0 requires core==2.0 (GOOD has core 1.0)",
                                               "plug 1.0 requires core==1.0 (BAD has core 2.0)"}
    assert groups["app+lib"].after == (("base", "lib 2.0 requires base>=2.0 (GOOD has base 1.0)"),)
    assert groups["opt"].after == (("util", "opt 2.0 requires util>=2.0 (GOOD has util 1.0)"),)
    assert groups["core+plug"].after == (("gadget", "plug 2.0 requires gadget>=0.1 (GOOD lacks gadget)"),)
    assert groups["relic"].after == (("core+plug", "plug 1.0 requires relic>=0.9 (BAD removes relic)"),)
    assert groups["foo"].rules == ("alone",) and groups["foo"].after == ()


def test_families_are_only_a_fallback_for_packages_without_metadata(tmp_path):
    (tmp_path / "good.txt").write_text("torch==2.9.1\ntriton==3.5.1\nflashinfer-python==0.6.7\n"
                                       "flashinfer-jit-cache==0.6.7\nnvidia-nccl-cu12==2.27.5\n")
    (tmp_path / "bad.txt").write_text("torch==2.11.0\ntriton==3.6.0\nflashinfer-python==0.6.8\n"
                                      "flashinfer-jit-cache==0.6.8\nnvidia-nccl-cu12==2.27.5\n")
    changes = diff_sets(load_requirement_set(tmp_path / "good.txt"), load_requirement_set(tmp_path / "bad.txt"))
    metadata = {(name, version): PackageMetadata(name, version, (), "wheel")
                for name, version in [("torch", "2.9.1"), ("torch", "2.11.0"), ("triton", "3.5.1"), ("triton", "3.6.0"),
                                      ("flashinfer-python", "0.6.7"), ("flashinfer-python", "0.6.8")]}
    groups = {group.name: group for group in group_changes(changes, metadata=metadata)}
    assert set(groups) == {"flashinfer", "torch", "triton"}, "torch and triton pin nothing here: separate"
    assert groups["flashinfer"].rules == ("family",)
    assert groups["flashinfer"].reasons == ("no metadata readable for flashinfer-jit-cache: moves with its family "
                                            "(flashinfer)",)


def test_sdist_metadata_is_trusted_only_when_static(tmp_path):
    def sdist(name: str, pkg_info: str) -> Path:
        path = tmp_path / f"{name}-1.0.tar.gz"
        data = pkg_info.encode()
        with tarfile.open(path, "w:gz") as archive:
            info = tarfile.TarInfo(f"{name}-1.0/PKG-INFO")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        return path

    static = sdist("stat", "Metadata-Version: 2.2\nName: stat\nVersion: 1.0\nRequires-Dist: core==2.0\n")
    dynamic = sdist("dyn", "Metadata-Version: 2.2\nName: dyn\nVersion: 1.0\nDynamic: Requires-Dist\n")
    old = sdist("old", "Metadata-Version: 2.1\nName: old\nVersion: 1.0\n")
    assert read_file_requires(static) == ("core==2.0",)
    assert read_file_requires(dynamic) is None and read_file_requires(old) is None


def test_check_output_teaches_the_direction_of_a_coupling():
    uv = "The package `plug` requires `core==2.0`, but `1.0` is installed"
    pip = "plug 1.0 has requirement core==1.0, but you have core 2.0."
    assert check_conflicts(uv) == check_conflicts(pip) == [("plug", "core")]
    changed = {"plug", "core", "foo"}
    forward = learned_couplings([uv], applied={"plug"}, changed=changed, step=3)
    backward = learned_couplings([pip], applied={"core"}, changed=changed, step=4)
    assert [(c.mover, c.needs, c.source) for c in forward] == [("plug", "core", "check")]
    assert [(c.mover, c.needs) for c in backward] == [("core", "plug")]
    assert learned_couplings([uv], applied={"plug", "core"}, changed=changed, step=5) == []
    assert learned_couplings(["The package `steady` requires `core<2`, but `2.0` is installed"],
                             applied={"core"}, changed=changed, step=6) == []


def _config(demo, work_dir: Path, **overrides) -> BisectConfig:
    installer = InstallerOptions(find_links=(str(demo.wheelhouse),), no_index=True, offline=True,
                                 cache_dir=str(work_dir.parent / "uv-cache"))
    return BisectConfig(good=demo.good, bad=demo.bad, work_dir=work_dir, log_path=work_dir / "log.jsonl",
                        probe=PROBE, installer=installer, **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("culprit, expected", [("core", ["core", "plug"]), ("opt", ["opt"]), ("base", ["base"])])
def test_names_the_culprit_group_and_nothing_innocent_within_the_bound(tmp_path, culprit, expected):
    demo = build_coupled_demo(tmp_path / "demo", culprit)
    report = build_report(*run_bisect(_config(demo, tmp_path / "work")))
    assert report["complete"] and report["culprit"]["exact"]
    assert report["culprit"]["packages"] == expected
    assert report["culprit"]["memory_delta_mib"] > 150
    assert [group["name"] for group in report["groups"]] == ORDER
    assert report["probes_used"] <= probe_bound(len(ORDER)) == 4
    assert report["skipped"] == 0 and report["regrouped"] == 0 and report["learned"] == []


@pytest.mark.slow
def test_without_metadata_the_check_teaches_the_couplings_instead_of_skipping(tmp_path):
    demo = build_coupled_demo(tmp_path / "demo", "core")
    plan, log, complete = run_bisect(_config(demo, tmp_path / "work", use_metadata=False))
    report = build_report(plan, log, complete)
    assert report["culprit"]["packages"] == ["core", "plug"] and report["culprit"]["exact"]
    assert report["skipped"] == 0 and report["regrouped"] >= 2
    assert {("plug", "core"), ("core", "plug")} <= {(item.mover, item.needs) for item in log.learned}
    core_plug = next(group for group in plan.groups if group.name == "core+plug")
    assert core_plug.rules == ("check",) and all(reason.startswith("check of step") for reason in core_plug.reasons)
    assert report["probes_used"] <= probe_bound(len(plan.groups)) + 1


@pytest.mark.slow
def test_without_metadata_or_learning_the_old_skips_blame_innocents(tmp_path):
    """The behaviour the issue reported, kept reachable to measure against."""
    demo = build_coupled_demo(tmp_path / "demo", "core")
    report = build_report(*run_bisect(_config(demo, tmp_path / "work", use_metadata=False, learn_conflicts=False)))
    assert report["skipped"] >= 3 and not report["culprit"]["exact"]
    assert {"foo", "app"} <= set(report["culprit"]["packages"])


def test_plan_prints_groups_reasons_and_bound_and_builds_nothing(coupled, tmp_path):
    argv = [sys.executable, LAUNCHER, "bisect", "--good", str(coupled.good), "--bad", str(coupled.bad),
            "--find-links", str(coupled.wheelhouse), "--no-index", "--offline", "--work-dir", str(tmp_path / "work"),
            "--plan"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("10 changed package(s) in 8 group(s); probe bound 4")
    assert "   4 core+plug: core 1.0 -> 2.0; plug 1.0 -> 2.0\n       rule: metadata\n" in result.stdout
    assert "after util: opt 2.0 requires util>=2.0 (GOOD has util 1.0)" in result.stdout
    assert "plug==2.0: wheel plug-2.0-py3-none-any.whl" in result.stdout
    assert not (tmp_path / "work").exists()
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    plan = json.loads(as_json.stdout)
    assert [group["name"] for group in plan["groups"]] == ORDER and plan["probe_bound"] == 4
    listed = subprocess.run([*argv[:-1], "--list-groups"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert listed.stdout == result.stdout
