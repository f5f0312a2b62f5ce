"""The drafter built on the meta device and materialised on CUDA (not yet run on a GPU): one NCCL rank under
torchrun builds its drafter as the trainer does (`build_state`: meta build, FSDP2 sharding, `materialize` onto
the rank's GPU), for the random start with a draft vocabulary, drafter.init = "target" and DFlash 2, and every
gathered parameter and buffer must equal the whole build on the host for the same seed
(tests/train/test_meta_init.py holds the same on 1-3 gloo ranks on CPU)."""
from __future__ import annotations

import dataclasses

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_the_meta_build_materialised_on_cuda_is_the_whole_build(record, tmp_path, tiny_qwen3_target, tiny_dataset):
    import torch

    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile
    from tests.train.test_meta_init import VARIANTS, equal, run_ranks, whole_build

    machine = {"nproc_per_node": 1, "device": "cuda", "backend": "nccl", "gpu_count": 1}
    paths = [write_profile(tmp_path / f"{name}.toml", tiny_qwen3_target, tiny_dataset, tmp_path / f"run-{name}",
                           machine=machine, drafter=drafter) for name, drafter in VARIANTS.items()]
    out = run_ranks(tmp_path, 1, paths, backend="nccl")
    matched = {}
    for path in paths:
        profile = load_profile(str(path))
        cpu = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device="cpu", backend="gloo"))
        found = torch.load(out / f"{path.stem}.pt")["tensors"]
        matched[path.stem] = equal(found, whole_build(cpu))
    record.figure(variants=matched)
    assert all(matched.values()), matched
