"""Rows 16-17 of the safety table: a probe that crashes (a Python traceback) or writes no result
is a skip, not "bad", so no innocent package is blamed; a BAD set that cannot be built ends with
"no culprit" and a non-zero exit. Real uv venvs from a wheelhouse the test writes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from envcheck.bisect.demo import DemoPackage, build_wheelhouse
from envcheck.bisect.runner import _not_a_verdict, expects_report

PROBE_SCRIPT = '''
import importlib.metadata as md, sys
if md.version("bravo") == "2.0":
    print("memory grew"); sys.exit(1)          # the real regression
if md.version("alpha") == "1.1":
    raise RuntimeError("the probe itself is broken here")   # a crash, not a verdict
'''


def write_sets(tmp_path: Path, good: dict[str, str], bad: dict[str, str], wheels: dict[str, list[str]]) -> tuple[Path, Path, Path]:
    packages = tuple(DemoPackage(name, version) for name, versions in wheels.items() for version in versions)
    wheelhouse = build_wheelhouse(tmp_path / "wheels", packages)
    (tmp_path / "good.txt").write_text("".join(f"{n}=={v}\n" for n, v in good.items()))
    (tmp_path / "bad.txt").write_text("".join(f"{n}=={v}\n" for n, v in bad.items()))
    return tmp_path / "good.txt", tmp_path / "bad.txt", wheelhouse


def bisect_args(tmp_path: Path, good: Path, bad: Path, wheelhouse: Path, probe: str, *extra: str) -> list[object]:
    return ["bisect", "--good", good, "--bad", bad, "--probe", probe, "--work-dir", tmp_path / "work",
            "--find-links", wheelhouse, "--no-index", "--offline", "--no-metadata", "--python", sys.executable,
            "--cache-dir", tmp_path / "uv-cache", "--json", *extra]


def test_a_crash_or_a_missing_result_is_not_a_verdict():
    crash = "Traceback (most recent call last):\n  File ...\nRuntimeError: x\n"
    assert _not_a_verdict(1, crash, wrote_report=False, wants_report=False) == "probe crashed"
    assert _not_a_verdict(1, "grew by 200 MiB", wrote_report=True, wants_report=True) == ""
    assert _not_a_verdict(1, "grew", wrote_report=False, wants_report=True) == "no probe result"
    assert _not_a_verdict(0, "", wrote_report=False, wants_report=False) == ""
    assert expects_report("{python} launcher.py probe --out {out}") and not expects_report("{python} x.py")


@pytest.mark.slow
def test_a_crashing_probe_is_skipped_and_the_innocent_is_not_blamed(cli, tmp_path):
    import json

    good, bad, wheelhouse = write_sets(tmp_path, {"alpha": "1.0", "bravo": "1.0", "charlie": "1.0"},
                                       {"alpha": "1.1", "bravo": "2.0", "charlie": "1.1"},
                                       {"alpha": ["1.0", "1.1"], "bravo": ["1.0", "2.0"], "charlie": ["1.0", "1.1"]})
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    result = cli(*bisect_args(tmp_path, good, bad, wheelhouse, f"{{python}} {script}"))
    assert result.code == 0, result.err
    report = json.loads(result.out)
    crashed = [step for step in report["steps"] if step["reason"] == "probe crashed"]
    assert crashed and all(step["result"] == "skip" and "alpha" in step["packages"] for step in crashed)
    assert "bravo" in report["culprit"]["packages"]
    assert report["culprit"]["packages"] != ["alpha"]


@pytest.mark.slow
@pytest.mark.parametrize("verify_bad", [False, True])
def test_a_bad_set_that_cannot_be_built_has_no_culprit(cli, tmp_path, verify_bad):
    good, bad, wheelhouse = write_sets(tmp_path, {"alpha": "1.0", "bravo": "1.0"},
                                       {"alpha": "1.1", "bravo": "1.0", "nosuchpkg": "9.9"},
                                       {"alpha": ["1.0", "1.1"], "bravo": ["1.0"]})
    extra = ["--verify-bad"] if verify_bad else []
    result = cli(*bisect_args(tmp_path, good, bad, wheelhouse, "{python} -c pass", *extra))
    assert result.code == 2 and "culprit:" not in result.out
    assert f"BAD ({bad}) cannot be built" in result.err and "no culprit" in result.err
