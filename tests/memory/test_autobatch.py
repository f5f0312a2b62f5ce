"""Agreement and OOM recovery: in-process for the single-rank rules, real torchrun gloo ranks for
the cross-rank ones (each rank runs tests/memory/autobatch_worker.py and writes what it did)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.train import autobatch
from dflash.train.dist import global_weight
from launcher_core.errors import ConfigError, RunFailed

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import autobatch_worker as worker  # noqa: E402

# --- fault-injection switch ---------------------------------------------------------------

def test_injection_switch_is_off_by_default_and_parses_its_forms():
    assert autobatch.injector_from_env({}) is None
    assert autobatch.parse_injection("rank=1,step=3") == autobatch.OomInjector(rank=1, step=3)
    assert autobatch.parse_injection("above=2, phase=backward") == autobatch.OomInjector(above=2, phase="backward")
    assert autobatch.parse_injection("rank=1,step=3,phase=sync") == autobatch.OomInjector(rank=1, step=3, phase="sync")
    for bad, message in [("rank=1", "say when"), ("rank=x,step=1", "integers"), ("when=3", "not one of"),
                         ("step=1,phase=loss", "phase must be")]:
        with pytest.raises(ConfigError, match=message):
            autobatch.parse_injection(bad)


def test_step_injection_fires_once_on_its_rank_and_above_injection_persists():
    import torch

    at_step = autobatch.OomInjector(rank=1, step=3)
    at_step.check(rank=0, step=3, micro_batch=4)            # other rank: nothing
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        at_step.check(rank=1, step=3, micro_batch=4)
    at_step.check(rank=1, step=3, micro_batch=2)            # the redone step goes through
    above = autobatch.OomInjector(rank=1, above=2)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            above.check(rank=1, step=0, micro_batch=3)
    above.check(rank=1, step=0, micro_batch=2)


# --- single process: the recovery rules ---------------------------------------------------

def single_rank_run(tmp_path: Path, injector, steps: int = 3, micro_batch: int = 4, global_batch: int = 8):
    model = worker.build_model()
    optimizer = worker.build_optimizer(model)
    auto = autobatch.AutoBatch.start(micro_batch, tmp_path / "state.json", 0, injector=injector, log=lambda _: None)
    outcomes = []
    for step in range(steps):
        indices = worker.step_indices(step, global_batch)
        total = global_weight(float(worker.batch(indices)[2].sum()))

        def accumulate(m: int) -> None:
            for start in range(0, global_batch, m):
                auto.inject("forward")
                (worker.weighted_loss_sum(model, indices[start:start + m]) / total).backward()

        outcomes.append(auto.run_step(step, accumulate, optimizer))
    return auto, outcomes, worker.flat_params(model)


def test_oom_halves_redoes_the_step_without_an_update_and_persists(tmp_path):
    auto, outcomes, params = single_rank_run(tmp_path, autobatch.OomInjector(above=2))
    assert [(o.micro_batch, o.attempts) for o in outcomes] == [(2, 2), (2, 1), (2, 1)]
    assert params == pytest.approx(worker.reference_run(3, 8, 2), rel=1e-5)    # no extra update happened
    state = autobatch.load_run_state(tmp_path / "state.json")
    assert state.micro_batch == 2 and state.reductions[0]["from"] == 4
    assert autobatch.resume_micro_batch(4, tmp_path / "state.json") == 2


def test_oom_inside_the_gradient_sum_is_recovered_like_one_of_the_backward(tmp_path):
    auto, outcomes, params = single_rank_run(tmp_path, autobatch.OomInjector(step=1, phase="sync"))
    assert [(o.micro_batch, o.attempts) for o in outcomes] == [(4, 1), (2, 2), (2, 1)]
    assert params == pytest.approx(worker.reference_run(3, 8, 4), rel=1e-5)    # the failed sum left no update


def test_oom_at_micro_batch_one_stops_with_advice(tmp_path):
    with pytest.raises(RunFailed, match="micro-batch 1.*lower data.max_length"):
        single_rank_run(tmp_path, autobatch.OomInjector(above=0))


def test_oom_inside_optimizer_step_is_fatal_with_a_reason(tmp_path):
    with pytest.raises(RunFailed, match="step 1: out of memory inside optimizer.step.*memory.margin"):
        single_rank_run(tmp_path, autobatch.OomInjector(step=1, phase="optimizer"))


# --- real ranks: torchrun, gloo, 2 processes ----------------------------------------------

def run_in_own_group(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run torchrun in its own process group; on timeout kill the whole group, ranks included."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"torchrun hung for {timeout} s (ranks killed):\n{stdout[-2000:]}{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def torchrun(tmp_path: Path, *args: str, inject: str = "", max_restarts: int = 0) -> dict[str, dict]:
    """Records by name (`rank1-attempt0`), plus `rank0-last`/`rank1-last`: the last attempt's."""
    env = {k: v for k, v in os.environ.items() if k != autobatch.INJECT_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]), **({autobatch.INJECT_ENV: inject} if inject else {}))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(max_restarts), str(HERE / "autobatch_worker.py"), "--out", str(out), *args]
    result = run_in_own_group(command, env, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))}
    for rank in (0, 1):
        records[f"rank{rank}-last"] = max((r for r in records.values() if r["rank"] == rank), key=lambda r: r["attempt"])
    return records


def relative_difference(a: list[float], b: list[float]) -> float:
    import torch

    a_, b_ = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a_ - b_).norm() / b_.norm())


@pytest.mark.slow
def test_smaller_budget_on_rank_1_sets_both_ranks_and_matches_the_unreduced_run(tmp_path):
    profile = tmp_path / "node.toml"
    profile.write_text('[machine]\ndevice = "cuda"\nnproc_per_node = 2\nbackend = "gloo"\n[model]\n'
                       'target = "no-such-dir"\n[train]\nglobal_batch = 16\nmax_micro_batch = 4\n'
                       '[memory]\noverhead_mib = 500\n')
    from dflash.memory import model as memory
    from dflash.memory.calibration import fit_calibration
    from launcher_core.profile import load_profile

    workload = memory.workload_from_profile(load_profile(str(profile)))
    calibration = fit_calibration({1: 3_500.0, 2: 5_000.0}, workload)   # 2000 + 1500 MiB per sequence
    from dflash.memory.plan import make_plan
    from envcheck.snapshot import GpuFacts, Snapshot

    snapshot = Snapshot(gpus=[GpuFacts(index=i, uuid=f"GPU-{i}", name="test GPU", compute_capability="12.0",
                                       memory_total_mib=12_000, memory_free_mib=free, memory_used_mib=12_000 - free)
                              for i, free in enumerate([10_000, 6_500])])           # budgets 8500, 5350 MiB

    plan = make_plan(load_profile(str(profile)), snapshot, calibration=calibration)
    planned = ",".join(str(rank.feasible_micro_batch) for rank in plan.ranks)
    ranks = torchrun(tmp_path, "--planned-by-rank", planned, "--steps", "4", max_restarts=1)
    r0, r1 = ranks["rank0-last"], ranks["rank1-last"]
    assert (r0["planned"], r1["planned"]) == (4, 2)
    assert r0["agreed"] == r1["agreed"] == 2
    assert all(s["micro_batch"] == 2 for s in r0["steps"] + r1["steps"])
    assert r0["params"] == r1["params"]
    assert relative_difference(r0["params"], worker.reference_run(4, 16, 4)) <= 1e-5


@pytest.mark.slow
def test_injected_oom_on_rank_1_at_step_3_halves_both_ranks_and_a_restart_resumes_reduced(tmp_path):
    state = tmp_path / "state.json"
    ranks = torchrun(tmp_path, "--state", str(state), "--steps", "5", "--crash-after-first-attempt",
                     inject="rank=1,step=3", max_restarts=2)
    first0, first1 = ranks["rank0-attempt0"], ranks["rank1-attempt0"]
    for first in (first0, first1):                          # both reduced at step 3, the step was redone
        assert [(s["micro_batch"], s["attempts"]) for s in first["steps"]] == [(4, 1), (4, 1), (4, 1), (2, 2), (2, 1)]
    assert any("out of memory at step 3" in line for line in first1["log"])
    assert first0["params"] == first1["params"]
    reduced_from_the_start = worker.reference_run(5, 16, 2)
    assert relative_difference(first0["params"], reduced_from_the_start) <= 1e-5
    assert autobatch.load_run_state(state).reductions[0]["step"] == 3
    retry0, retry1 = ranks["rank0-last"], ranks["rank1-last"]           # torchrun restarted the ranks
    assert retry0["attempt"] >= 1
    assert retry0["planned"] == retry1["planned"] == 4
    assert retry0["agreed"] == retry1["agreed"] == 2
    assert [(s["micro_batch"], s["attempts"]) for s in retry1["steps"]] == [(2, 1)] * 5


@pytest.mark.slow
def test_injected_oom_inside_the_gradient_sum_on_rank_1_halves_both_ranks_and_redoes_the_step(tmp_path):
    """The sum runs in buckets of 100 bytes here (the model's weights in place, its biases packed
    into the staging buffer); rank 1 runs out of memory as it allocates that buffer at step 2.
    Both ranks halve and redo the step (no hang: torchrun's timeout is not reached), and the
    parameters are those of the whole global batch at every step."""
    ranks = torchrun(tmp_path, "--steps", "4", "--grad-bucket-mib", str(100 / 2**20), inject="rank=1,step=2,phase=sync")
    r0, r1 = ranks["rank0-last"], ranks["rank1-last"]
    for record in (r0, r1):
        assert [(s["micro_batch"], s["attempts"]) for s in record["steps"]] == [(4, 1), (4, 1), (2, 2), (2, 1)]
        assert record["reductions"][0]["step"] == 2 and record["reductions"][0]["failed_ranks"] == 1
    assert any("out of memory at step 2" in line for line in r1["log"])
    assert not any("out of memory at step" in line for line in r0["log"])      # rank 0 halved because rank 1 failed
    assert r0["params"] == r1["params"]
    assert relative_difference(r0["params"], worker.reference_run(4, 16, 4)) <= 1e-5
