"""The fault-injection debugging option (dflash.train.rank.faults): its switches' forms, each refused form named,
an injection already recovered from not firing again, and what it installs on a real FSDP2-sharded drafter
(a world of one gloo rank): hooks only for the points inside torch's work, none without a switch."""
from __future__ import annotations

import time

import pytest
import torch

from dflash.train.rank import faults
from dflash.train.supervisor.heartbeat import RankProgress
from launcher_core.errors import ConfigError


def test_no_switch_means_no_injection_and_each_form_parses():
    assert faults.FaultInjection.from_env(0, {}) is None
    assert faults.parse_injection("rank=1,step=3") == [faults.OomInjector(rank=1, step=3)]
    assert faults.parse_injection("above=2, phase=backward") == [faults.OomInjector(above=2, phase="backward")]
    assert faults.parse_injection("rank=1,step=2;rank=0,step=3,phase=sync") == \
        [faults.OomInjector(rank=1, step=2), faults.OomInjector(rank=0, step=3, phase="sync")]
    assert faults.parse_stalls("rank=1,step=3,phase=backward,seconds=600") == \
        [faults.StallInjector("backward", 600.0, rank=1, step=3)]
    assert faults.parse_fail_rank("1:3") == (1, 3, None) and faults.parse_fail_rank("1:3:0") == (1, 3, 0)


@pytest.mark.parametrize("variable,text,message", [
    ("DFLASH_INJECT_OOM", "rank=1", "say when"), ("DFLASH_INJECT_OOM", "rank=x,step=1", "take numbers"),
    ("DFLASH_INJECT_OOM", "when=3", "not one of"), ("DFLASH_INJECT_OOM", "step=1,phase=loss", "phase must be"),
    ("DFLASH_INJECT_STALL", "rank=1,step=2", "say how long"), ("DFLASH_INJECT_STALL", "phase=sync,seconds=1", "phase must"),
    ("DFLASH_FAIL_RANK", "one:3", "RANK:STEP")])
def test_a_bad_switch_is_refused_naming_the_variable(variable, text, message):
    with pytest.raises(ConfigError, match=message) as refused:
        faults.FaultInjection.from_env(0, {variable: text})
    assert variable in str(refused.value)


def test_step_injection_fires_once_on_its_rank_and_above_injection_persists():
    at_step = faults.OomInjector(rank=1, step=3)
    at_step.check(rank=0, step=3, micro_batch=4)            # other rank: nothing
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        at_step.check(rank=1, step=3, micro_batch=4)
    at_step.check(rank=1, step=3, micro_batch=2)            # the redone step goes through
    above = faults.OomInjector(rank=1, above=2)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            above.check(rank=1, step=0, micro_batch=3)
    above.check(rank=1, step=0, micro_batch=2)


def test_an_injection_already_recovered_from_does_not_fire_again_after_the_restart():
    """autobatch.json records the phase the step had reached: sync as backward, optimizer as update."""
    environ = {faults.INJECT_ENV: "rank=1,step=2;rank=1,step=3,phase=sync;rank=1,step=4,phase=optimizer"}
    recovered = [{"step": 2, "phase": "forward"}, {"step": 3, "phase": "backward"}]
    injection = faults.FaultInjection.from_env(1, environ, recovered)
    assert injection is not None and [i.fired for i in injection.ooms] == [True, True, False]
    flipped = faults.FaultInjection.from_env(1, environ, [{"step": 2, "phase": "update"}])
    assert flipped is not None and not flipped.ooms[0].fired       # another phase at that step: still due


def test_marks_fire_the_injections_at_their_phase_and_step_only():
    progress = RankProgress()
    injection = faults.FaultInjection.from_env(1, {faults.STALL_ENV: "rank=1,step=2,phase=reduction,seconds=0.3",
                                                   faults.FAIL_RANK_ENV: "1:3:0",
                                                   faults.INJECT_ENV: "rank=1,step=2,phase=optimizer"})
    assert injection is not None
    progress.listeners.append(injection.at_mark)
    for phase in ("data", "reduction", "forward", "update"):
        progress.enter(phase, 1)                         # step 1: nothing fires
    began = time.monotonic()
    progress.enter("data", 2)
    progress.enter("reduction")
    assert time.monotonic() - began >= 0.3               # the stall slept before the step's first collective
    with pytest.raises(torch.OutOfMemoryError, match="optimizer"):
        progress.enter("update")
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 3"):
        progress.enter("data", 3)


def sharded_drafter() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def test_only_the_points_inside_torchs_work_install_anything():
    """A forward OOM: a listener only, no hook on the drafter; backward and sync: a backward hook and
    FSDP2's reduce-scatter observer, which fire inside a real backward."""
    from dflash.train.rank.parallel import single_process_group

    single_process_group("gloo")
    plain = sharded_drafter()
    hooks_of = lambda m: sum(len(x._backward_pre_hooks) + len(x._forward_hooks) for x in m.modules())  # noqa: E731
    baseline = hooks_of(plain)
    progress = RankProgress()
    forward_only = faults.FaultInjection.from_env(0, {faults.INJECT_ENV: "step=1"})
    assert forward_only is not None
    forward_only.install(progress, plain, lambda: 1)
    assert hooks_of(plain) == baseline and progress.listeners == [forward_only.at_mark]

    for point in ("backward", "sync"):
        drafter, progress = sharded_drafter(), RankProgress()
        injection = faults.FaultInjection.from_env(0, {faults.INJECT_ENV: f"step=1,phase={point}"})
        assert injection is not None
        injection.install(progress, drafter, lambda: 1)
        progress.enter("forward", 1)
        loss = drafter(torch.ones(2, 4)).sum()
        progress.enter("backward")
        with pytest.raises(torch.OutOfMemoryError, match=point):
            loss.backward()
