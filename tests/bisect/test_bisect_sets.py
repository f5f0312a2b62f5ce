"""Requirement sets from requirements files, pip freeze output and snapshots; change groups."""
from __future__ import annotations

import json

import pytest

from envcheck.bisect.changes import apply_groups, diff_sets, group_changes
from envcheck.bisect.reqsets import load_requirement_set, requirements_text
from launcher_core.errors import InputError


def test_requirements_file_with_comments_options_extras_markers_and_includes(tmp_path):
    (tmp_path / "base.txt").write_text("numpy==2.4.6\n")
    path = tmp_path / "requirements-cu128.txt"
    path.write_text(
        "# pinned\n--extra-index-url https://example.invalid/cu128\n-r base.txt\n\n"
        "torch==2.9.1+cu128  # the CUDA build\n"
        "transformers[serving]==5.24.0\n"
        "Flash_Infer.Python==0.5.3 ; platform_machine == 'x86_64'\n"
    )
    pins = load_requirement_set(path)
    assert {name: pin.version for name, pin in pins.items()} == {
        "numpy": "2.4.6", "torch": "2.9.1+cu128", "transformers": "5.24.0", "flash-infer-python": "0.5.3"}
    assert pins["transformers"].spec == "transformers[serving]==5.24.0"
    assert pins["flash-infer-python"].spec == "Flash_Infer.Python==0.5.3; platform_machine == 'x86_64'"


def test_pip_freeze_with_a_direct_reference(tmp_path):
    path = tmp_path / "freeze.txt"
    path.write_text("memhog==1.0\nlocalpkg @ file:///wheels/localpkg-0.1-py3-none-any.whl\n")
    pins = load_requirement_set(path)
    assert pins["localpkg"].version == "@ file:///wheels/localpkg-0.1-py3-none-any.whl"
    assert pins["localpkg"].spec.startswith("localpkg @ file://")


def test_snapshot_json_packages_mapping(tmp_path):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps({"host": {}, "packages": {"Torch": "2.10.0", "nvidia_nccl_cu13": "2.28.3"}}))
    pins = load_requirement_set(path)
    assert {name: pin.version for name, pin in pins.items()} == {"torch": "2.10.0", "nvidia-nccl-cu13": "2.28.3"}
    assert requirements_text(pins) == "nvidia_nccl_cu13==2.28.3\nTorch==2.10.0\n"


@pytest.mark.parametrize("text, needle", [
    ("memhog==1.0\ntorch>=2.9\n", ":2: 'torch>=2.9' is not an exact pin"),
    ("-e git+https://example.invalid/x.git#egg=x\n", ":1: editable install"),
])
def test_unpinned_lines_are_rejected_with_file_and_line(tmp_path, text, needle):
    path = tmp_path / "reqs.txt"
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        load_requirement_set(path)
    assert str(path) in str(caught.value) and needle in str(caught.value)


def test_snapshot_without_packages_is_rejected(tmp_path):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps({"host": {}}))
    with pytest.raises(InputError, match="packages"):
        load_requirement_set(path)


def _sets(tmp_path, good: str, bad: str):
    (tmp_path / "good.txt").write_text(good)
    (tmp_path / "bad.txt").write_text(bad)
    return load_requirement_set(tmp_path / "good.txt"), load_requirement_set(tmp_path / "bad.txt")


def test_torch_moves_with_nvidia_and_triton_and_flashinfer_companions_together(tmp_path):
    good, bad = _sets(
        tmp_path,
        "torch==2.9.1+cu128\ntriton==3.5.1\nnvidia-nccl-cu12==2.27.5\nnvidia-ml-py==13.580.82\n"
        "flashinfer-python==0.5.2\nflashinfer-cubin==0.5.2\nsglang==0.5.5\nnumpy==2.4.6\n",
        "torch==2.10.0+cu130\ntriton==3.6.0\nnvidia-nccl-cu13==2.28.3\nnvidia-ml-py==13.590.44\n"
        "flashinfer-python==0.5.3\nflashinfer-cubin==0.5.3\nflashinfer-jit-cache==0.5.3\nsglang==0.5.6\nnumpy==2.4.6\n")
    groups = {group.name: sorted(change.name for change in group.changes) for group in group_changes(diff_sets(good, bad))}
    assert groups == {
        "flashinfer": ["flashinfer-cubin", "flashinfer-jit-cache", "flashinfer-python"],
        "nvidia-ml-py": ["nvidia-ml-py"],
        "sglang": ["sglang"],
        "torch": ["nvidia-nccl-cu12", "nvidia-nccl-cu13", "torch", "triton"],
    }


def test_user_groups_glue_packages_and_apply_reaches_bad(tmp_path):
    good, bad = _sets(tmp_path, "a==1\nb==1\nc==1\nold==1\n", "a==2\nb==2\nc==2\nnew==1\n")
    groups = group_changes(diff_sets(good, bad), extra_groups=["A,b"])
    assert [group.name for group in groups] == ["a+b", "c", "new", "old"]
    assert apply_groups(good, groups) == bad
    first = apply_groups(good, groups[:1])
    assert {name: pin.version for name, pin in first.items()} == {"a": "2", "b": "2", "c": "1", "old": "1"}
