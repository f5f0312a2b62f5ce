"""A plain training run carries no test machinery: building the rank's state and running the worker's own
loop (steps, a held-out measurement, checkpoints) installs no hook through any of torch's hook APIs from
the project's code, and the rank's progress has no listener. One kind is the training itself: the target's
hidden states are read by forward hooks on its tap layers that live for one target forward
(dflash.drafter.taps.TapCapture, removed as it returns); they are counted apart, and none is left. The
control: the fault-injection debugging option (dflash.train.rank.faults) installs its hooks through those same
APIs, and the counter sees them.

In one process (a process group of one gloo rank), on the tiny real Qwen3 target."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tests.train.conftest import write_dataset, write_profile

PROJECT = str(Path(__file__).resolve().parents[2] / "dflash")
HOOK_APIS = [(torch.Tensor, "register_hook"), (torch.Tensor, "register_post_accumulate_grad_hook"),
             (nn.Module, "register_forward_hook"), (nn.Module, "register_forward_pre_hook"),
             (nn.Module, "register_full_backward_hook"), (nn.Module, "register_full_backward_pre_hook"),
             (nn.Module, "register_backward_hook"), (FSDPModule, "set_custom_reduce_scatter"),
             (FSDPModule, "set_all_reduce_hook"), (FSDPModule, "set_custom_all_gather"),
             (torch.autograd.graph, "register_multi_grad_hook")]


@pytest.fixture
def installed(monkeypatch) -> list[str]:
    """Every hook installed from the project's code, as "file: API", while the test runs."""
    seen: list[str] = []
    for owner, name in HOOK_APIS:
        original = getattr(owner, name)

        def counting(*args, __original=original, __name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PROJECT):
                seen.append(f"{Path(caller).name}: {__name}")
            return __original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
    return seen


@pytest.fixture
def profile(tmp_path, tiny_qwen3_target):
    from launcher_core.profile import load_profile

    path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "dataset"),
                         tmp_path / "run", machine={"nproc_per_node": 1}, max_steps=4, save_every_steps=2,
                         validation_share=0.2, validation_every_steps=2)
    return load_profile(path)


def test_a_plain_run_installs_no_hook_and_no_listener(profile, installed, monkeypatch):
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_state
    from dflash.train.rank.worker import StopFlag, install_fault_injection, train_loop

    for variable in ("DFLASH_INJECT_OOM", "DFLASH_INJECT_STALL", "DFLASH_FAIL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    run_dir = Path(profile.paths.run_dir)
    state = build_state(profile, run_dir, WorkerEnv(0, 1, 0), resume=False)
    install_fault_injection(state)
    train_loop(state, profile, run_dir, StopFlag())
    assert state.step == 4 and (run_dir / "train" / "checkpoints" / "step-4").is_dir()
    assert "val_tau" in (run_dir / "train" / "metrics.jsonl").read_text()      # the held-out pass ran
    taps = [hook for hook in installed if hook == "taps.py: register_forward_hook"]
    assert [hook for hook in installed if hook not in taps] == [] and state.progress.listeners == []
    assert taps and not any(layer._forward_hooks for layer in state.target.model.layers)    # the taps' are gone
    installed.clear()
    assert state.progress.step == 4 and state.progress.step_s() is not None      # the marks the heartbeat reads

    monkeypatch.setenv("DFLASH_INJECT_OOM", "step=99,phase=sync;step=99,phase=backward")
    install_fault_injection(state)                                               # the control
    assert sorted(set(installed)) == ["faults.py: register_full_backward_pre_hook",
                                      "parallel.py: set_all_reduce_hook", "parallel.py: set_custom_reduce_scatter"]
    assert len(state.progress.listeners) == 1
