"""The GPU requirement sets pin what their SGLang requires (its own Requires-Dist, read as `bisect` reads
metadata and recorded in tests/fixtures/engines/gpu-pins-metadata.json by make_pin_metadata.py),
and the audit's engine.sglang check says whether the SGLang of a node serves the profile's drafter
layers as trained, naming the release where it does not."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from envcheck.bisect.metadata import read_cache
from envcheck.bisect.reqsets import load_requirement_set
from envcheck.checks import CheckInput, check_sglang_serves_the_drafter
from envcheck.engine_releases import sglang_config_problems, sglang_drafter_problems, sglang_problems
from envcheck.packages import normalize
from envcheck.snapshot import load_snapshot
from launcher_core.layer_attention import DraftLayers
from launcher_core.profile import load_profile

REPO = Path(__file__).resolve().parents[2]
METADATA = REPO / "tests" / "fixtures" / "engines" / "gpu-pins-metadata.json"
MARKERS = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
           "python_version": "3.12", "extra": ""}


def engine_requirements(requirements: str) -> tuple[dict, list[Requirement]]:
    pins = load_requirement_set(REPO / requirements)
    wanted = {(name, pin.version): pin for name, pin in pins.items() if name in ("sglang", "sglang-kernel")}
    metadata = read_cache(METADATA, wanted)
    assert set(metadata) == set(wanted), f"run tests/fixtures/engines/make_pin_metadata.py: {set(wanted) - set(metadata)}"
    required = [Requirement(line) for entry in metadata.values() for line in entry.requires]
    return pins, [r for r in required if r.marker is None or r.marker.evaluate(MARKERS)]


def unmet(pins: dict, required: list[Requirement]) -> tuple[list[str], list[str]]:
    """(pins outside what the engine requires, the pinned names checked)."""
    wrong, checked = [], []
    for requirement in required:
        pin = pins.get(normalize(requirement.name))
        if pin is not None:
            checked.append(normalize(requirement.name))
            if not requirement.specifier.contains(pin.version.split("+")[0], prereleases=True):
                wrong.append(f"{pin.name}=={pin.version} (needs {requirement})")
    return wrong, checked


@pytest.mark.parametrize("requirements", ["requirements-cu128.txt", "requirements-cu130.txt"])
def test_every_pin_satisfies_what_the_pinned_sglang_requires(requirements):
    pins, required = engine_requirements(requirements)
    wrong, checked = unmet(pins, required)
    assert wrong == []
    assert {"torch", "sglang-kernel", "transformers", "flashinfer-python"} <= set(checked), checked


def test_a_pin_the_sglang_does_not_accept_is_caught():
    pins, required = engine_requirements("requirements-cu130.txt")
    stale = {**pins, "torch": dataclasses.replace(pins["torch"], version="2.11.0")}    # the torch of sglang 0.5.11
    assert unmet(stale, required)[0] == ["torch==2.11.0 (needs torch==2.13.0)"]


def test_the_cu130_set_is_a_cuda_13_stack_whose_sglang_runs_the_flagship_drafter():
    pins, required = engine_requirements("requirements-cu130.txt")
    assert any(r.name == "cuda-python" and r.specifier.contains("13.0") and not r.specifier.contains("12.9") for r in required)
    drafter = load_profile("rtx6000-x8").drafter
    layers = DraftLayers(drafter.num_layers, list(drafter.layer_types), drafter.sliding_window)
    assert layers.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    release = tuple(int(part) for part in pins["sglang"].version.split(".")[:3])
    assert sglang_problems(release, layers) == []
    assert sglang_problems(release, dataclasses.replace(layers, is_causal=False)) == []    # 0.5.18+: is_causal honoured


def test_the_cu128_sglang_has_no_dflash_and_any_dflash_sglang_requires_cuda_13():
    pins, _ = engine_requirements("requirements-cu128.txt")
    assert pins["sglang"].version == "0.5.10.post1" and pins["torch"].version == "2.9.1"
    assert sglang_problems((0, 5, 10), DraftLayers(5)) == ["SGLang 0.5.10 has no DFLASH speculative algorithm (from 0.5.11 on)"]
    _, cu130 = engine_requirements("requirements-cu130.txt")        # the lowest DFLASH release to raise to is CUDA 13 too
    assert any(r.name == "torch" and r.specifier.contains("2.13.0") for r in cu130)


@pytest.fixture(scope="module")
def rtx_fresh(fixtures_dir):
    return load_snapshot(fixtures_dir / "snapshots" / "rtx6000-x8-fresh.json")    # before `engine setup sglang`


def test_the_audit_warns_that_the_cu128_node_cannot_serve_the_flagship_drafter(rtx_fresh):
    profile = load_profile("rtx6000-x8")
    [finding] = check_sglang_serves_the_drafter(CheckInput(rtx_fresh, profile, pins_file="requirements-cu128.txt"))
    assert finding.status == "WARN" and "sglang 0.5.10.post1 (installed)" in finding.message
    assert "has no DFLASH" in finding.message and finding.hint.startswith("run `launcher.py engine setup sglang`")


@pytest.mark.parametrize("version, status, named", [
    ("0.5.11", "WARN", "layer 0 (sliding_attention): trained causal, window 2048, served bidirectional, no window"),
    ("0.5.13.post1", "WARN", "sglang 0.5.13.post1 (installed)"),
    ("0.5.14", "PASS", "runs the drafter's full_attention, sliding_attention layers as trained"),
    ("0.5.19", "PASS", "sglang 0.5.19 (installed)")])
def test_the_audit_names_the_sglang_release_that_runs_sliding_layers_otherwise(rtx_fresh, version, status, named):
    snapshot = dataclasses.replace(rtx_fresh, packages={**rtx_fresh.packages, "sglang": version})
    [finding] = check_sglang_serves_the_drafter(CheckInput(snapshot, load_profile("rtx6000-x8")))
    assert finding.status == status and named in finding.message, finding


@pytest.mark.parametrize("version, status", [("0.5.18", "WARN"), ("0.5.19", "PASS")])
def test_the_audit_warns_for_a_dflash2_drafter_on_an_sglang_before_0_5_19(rtx_fresh, version, status):
    profile = load_profile("rtx6000-x8")
    dflash2 = dataclasses.replace(profile, drafter=dataclasses.replace(profile.drafter, kind="dflash2"))
    snapshot = dataclasses.replace(rtx_fresh, packages={**rtx_fresh.packages, "sglang": version})
    [finding] = check_sglang_serves_the_drafter(CheckInput(snapshot, dflash2))
    assert finding.status == status, finding
    assert ("a DFlash 2 drafter (DFlash2DraftModel), which SGLang serves from 0.5.19 on" in finding.message) is (
        status == "WARN"), finding
    assert check_sglang_serves_the_drafter(CheckInput(snapshot, profile))[0].status == "PASS"   # the DFlash drafter


def test_the_audit_skips_where_the_engine_is_not_sglang_or_lives_elsewhere(rtx_fresh):
    profile = load_profile("rtx6000-x8")
    elsewhere = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_python="/opt/serve/bin/python"))
    assert check_sglang_serves_the_drafter(CheckInput(rtx_fresh, elsewhere))[0].status == "SKIP"
    assert check_sglang_serves_the_drafter(CheckInput(rtx_fresh, load_profile("cpu-demo")))[0].status == "SKIP"


def exact_pins(required: list[Requirement]) -> list[Requirement]:
    return [r for r in required if len(r.specifier) == 1 and next(iter(r.specifier)).operator == "=="]


def test_the_cu130_set_pins_every_version_its_sglang_fixes_with_the_extras_it_asks_for():
    """torchaudio, cuda-tile, flashinfer's cu13 extra, ...: each `==` of sglang 0.5.19's Requires-Dist is a pin here."""
    pins, required = engine_requirements("requirements-cu130.txt")
    missing = [str(r) for r in exact_pins(required) if normalize(r.name) not in pins]
    assert missing == []
    for requirement in exact_pins(required):
        pin = pins[normalize(requirement.name)]
        assert requirement.specifier.contains(pin.version, prereleases=True), (pin.spec, str(requirement))
        assert requirement.extras <= Requirement(pin.spec).extras, (pin.spec, str(requirement))
    assert {"torchaudio", "cuda-tile", "flashinfer-python"} <= {normalize(r.name) for r in exact_pins(required)}


ENGINE_LOCK = "requirements-engine-sglang-cu130.txt"
LEFT_OUT_OF_THE_LOCK = {"flashinfer-cubin", "flashinfer-jit-cache", "causal-conv1d"}


def test_sglangs_own_venv_pins_the_cu130_set_and_everything_its_sglang_requires():
    """The engine venv's file (`launcher.py engine setup sglang`) is the cu130 set, every package pinned: each pin of
    requirements-cu130.txt at its version (but the lines setup installs otherwise), and every Requires-Dist of its
    sglang and sglang-kernel present and satisfied (the file is complete: setup installs nothing unpinned)."""
    from envcheck.engine_venvs import ENGINE_SPECS

    cu130, required = engine_requirements("requirements-cu130.txt")
    lock = load_requirement_set(REPO / ENGINE_LOCK)
    differ = [f"{pin.spec} vs {lock[name].spec if name in lock else 'absent'}" for name, pin in cu130.items()
              if name not in LEFT_OUT_OF_THE_LOCK and (name not in lock or lock[name].version != pin.version)]
    assert differ == []
    assert LEFT_OUT_OF_THE_LOCK.isdisjoint(lock)
    wrong, checked = unmet(lock, required)
    assert wrong == [] and sorted(checked) == sorted({normalize(r.name) for r in required}), \
        sorted({normalize(r.name) for r in required} - set(checked))
    indexed = {normalize(w.requirement.split("==")[0]): w.requirement.split("==")[1] for w in ENGINE_SPECS["sglang"].index_wheels}
    assert indexed == {"cuda-tile": lock["cuda-tile"].version, "flashinfer-cubin": cu130["flashinfer-cubin"].version,
                       "flashinfer-jit-cache": cu130["flashinfer-jit-cache"].version + "+cu130"}


def test_a_drafters_config_and_its_profile_get_the_same_answer_from_each_sglang_release():
    """`export --for sglang` and `eval --engine sglang` ask with the drafter's config.json, the audit with the profile."""
    drafter = load_profile("rtx6000-x8").drafter
    config = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": drafter.num_layers,
              "layer_types": list(drafter.layer_types), "sliding_window": drafter.sliding_window}
    for version in ("0.5.10", "0.5.11", "0.5.13.post1", "0.5.14", "0.5.18", "0.5.19"):
        assert sglang_config_problems(version, config) == sglang_drafter_problems(version, drafter), version
    assert sglang_config_problems("0.5.13", config) and not sglang_config_problems("0.5.14", config)
    dflash2 = {**config, "architectures": ["DFlash2DraftModel"]}
    assert sglang_config_problems("0.5.18", dflash2) == ["a DFlash 2 drafter (DFlash2DraftModel), which SGLang serves from 0.5.19 on"]
    assert sglang_config_problems("0.5.19", dflash2) == []
