"""A rank alive but stuck is named by its progress (dflash.train.supervisor.watchdog), on 2 real gloo ranks under
`launcher.py train`, well before the process group's timeout (train.collective_timeout_s = 600 s here):

1. rank 1 sleeps inside its backward (DFLASH_INJECT_STALL, a hook at the start of the drafter's backward):
   named with "its backward at step 4", rank 0 having entered more collectives;
2. rank 1 stuck before the step's first collective (the loss weight's all-reduce): "its reduction";
3. rank 0 SIGSTOPped (its heartbeat timeout is 120 s, longer than the stuck bound): named by progress,
   "its process is stopped", with its phase;
4. the control: rank 1 slow but progressing (2 s in every forward, longer than a plain step by far)
   is not named; the run ends 0.

Each stuck run ends with exit 5, the manifest's ended_by "rank stuck" and the blamed rank, every rank's
Python stack in train/failures/stacks-rank-R.txt (faulthandler), the flight recorder's dumps in
train/failures/flight-recorder/, and no process left. The bound: max(train.stuck_floor_s = 10 s, 3 x the measured step).

Runs 1, 2 and 4 need nothing from the test while they run: the module starts them together and each test
waits for its own (most of their time is the stall and the bound, waited out side by side); run 3 starts in
its test, which stops its rank. The drafter proposes from the data's 50 tokens (DATA_VOCAB: a cheap head;
what the watchdog names does not depend on the head's width).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.safety.runs import finish, kill_session, metrics_steps, start_train, wait_for, wait_for_ranks, wait_until_gone
from tests.train.conftest import DATA_VOCAB, write_dataset, write_profile

pytestmark = pytest.mark.slow
FLOOR_S = 10
SETTINGS = {"max_steps": 10, "save_every_steps": 100, "collective_timeout_s": 600, "heartbeat_timeout_s": 120,
            "stuck_floor_s": FLOOR_S, "stuck_after_steps": 3, "drafter": DATA_VOCAB}
NAMED_WITHIN_S = 120          # from the stall to the launcher's exit: the bound, a step, the dumps; far below 600 s


STALLS = {"backward": {"DFLASH_INJECT_STALL": "rank=1,step=4,phase=backward,seconds=900"},
          "collective": {"DFLASH_INJECT_STALL": "rank=1,step=4,phase=reduction,seconds=900"}}
SLOW_STEPS = 6                # 3 steps with the watchdog armed (stuck_after_steps = 3), each ~2 x 2 s


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen3_target):
    root = tmp_path_factory.mktemp("stuck")
    return root, tiny_qwen3_target, write_dataset(root / "dataset")


@pytest.fixture(scope="module")
def started(setup) -> dict[str, tuple[Path, subprocess.Popen]]:
    """The runs that need no action from the test, started together: name -> (run dir, launcher process)."""
    runs = {"slow": run(setup, "slow", {"DFLASH_INJECT_STALL": "rank=1,phase=forward,seconds=2"}, max_steps=SLOW_STEPS)}
    runs.update((name, run(setup, name, env)) for name, env in STALLS.items())
    yield runs
    for _, process in runs.values():
        kill_session(process)


def run(setup, name: str, env: dict[str, str] | None = None, **settings: object):
    root, target, dataset = setup
    run_dir = root / name
    profile = write_profile(root / f"{name}.toml", target, dataset, run_dir, **{**SETTINGS, **settings})
    return run_dir, start_train(profile, run_dir, env=env)


def step_ended_at(run_dir: Path, step: int) -> float:
    """When the rank logged `step` (metrics.jsonl's time, seconds since the epoch)."""
    lines = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    return next(line["time"] for line in lines if line["step"] == step)


def ended_at(run_dir: Path) -> float:
    """When the launcher recorded how the run ended (the manifest's last write)."""
    return (run_dir / "manifest.json").stat().st_mtime


def assert_named(run_dir: Path, out: str, code: int, rank: int, where: str) -> float:
    """Exit 5 naming `rank` stuck in `where`, the stacks of both ranks dumped; returns the quiet seconds."""
    assert code == 5, out
    found = re.search(rf"error: rank {rank} \(pid \d+\) is stuck in {re.escape(where)}: no progress for (\d+) s "
                      rf"\(bound: 3 x the [\d.]+ s step, at least train.stuck_floor_s = {FLOOR_S} s\)", out)
    assert found, out
    assert "Traceback" not in out.split("error:")[-1]
    stacks = sorted(p.name for p in (run_dir / "train" / "failures").glob("stacks-rank-*.txt"))
    assert stacks == ["stacks-rank-0.txt", "stacks-rank-1.txt"], out
    assert "every rank's Python stack:" in out
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert entry["ended_by"] == "rank stuck" and entry["failed_rank"] == rank
    assert wait_until_gone(run_dir) == []
    return float(found.group(1))


def test_1_a_rank_sleeping_inside_its_backward_is_named_with_its_phase(started):
    run_dir, process = started["backward"]
    code, out = finish(process, timeout=NAMED_WITHIN_S * 2)
    assert metrics_steps(run_dir) == [1, 2, 3], out             # the stall is in step 4
    assert ended_at(run_dir) - step_ended_at(run_dir, 3) < NAMED_WITHIN_S
    quiet = assert_named(run_dir, out, code, 1, "its backward at step 4")
    assert FLOOR_S <= quiet < FLOOR_S + 15
    assert "it has entered" in out and "rank 0" in out
    stack = (run_dir / "train" / "failures" / "stacks-rank-1.txt").read_text()
    assert "faults.py" in stack and "backward" in stack            # where it sleeps, inside the backward
    recorded = sorted(p.name for p in (run_dir / "train" / "failures" / "flight-recorder").iterdir())
    assert recorded == ["rank-0", "rank-1"] and "fr_trace" in out


def test_2_a_rank_stuck_before_a_collective_is_named_in_its_reduction(started):
    run_dir, process = started["collective"]
    code, out = finish(process, timeout=NAMED_WITHIN_S * 2)
    assert metrics_steps(run_dir) == [1, 2, 3], out
    assert ended_at(run_dir) - step_ended_at(run_dir, 3) < NAMED_WITHIN_S
    assert_named(run_dir, out, code, 1, "its reduction at step 4")
    assert re.search(r"rank 0 waits in \w+", out), out


def test_3_a_stopped_rank_is_named_by_its_progress_with_its_phase(setup):
    run_dir, process = run(setup, "stopped")
    ranks = wait_for_ranks(run_dir)
    wait_for(lambda: 3 in metrics_steps(run_dir), what="step 3")
    os.kill(ranks[0], signal.SIGSTOP)
    code, out = finish(process, timeout=NAMED_WITHIN_S)
    assert code == 5, out
    assert re.search(rf"error: rank 0 \(pid {ranks[0]}\) is stuck in its \w+ at step \d+: no progress", out), out
    assert "its process is stopped (SIGSTOP, Ctrl-Z or a debugger holds it)" in out
    assert (run_dir / "train" / "failures" / "stacks-rank-0.txt").read_text().strip()    # continued to dump it
    assert wait_until_gone(run_dir) == []


def test_4_a_slow_but_progressing_rank_is_not_named(started):
    run_dir, process = started["slow"]
    code, out = finish(process, timeout=600)
    assert code == 0, out
    assert "stuck" not in out and metrics_steps(run_dir) == list(range(1, SLOW_STEPS + 1))
    steps = [json.loads(line)["time"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert min(b - a for a, b in zip(steps, steps[1:])) >= 2.0      # every step waited for the slow rank
