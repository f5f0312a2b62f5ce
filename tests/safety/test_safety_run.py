"""A run survives its own processes (issue table "faults of the run itself"), on 2 real gloo ranks.

One run directory goes through every fault in turn, each run resuming the last (the tiny random
Qwen3 target, a 1-layer drafter, a checkpoint every step); after each, nothing of the run is
left running, the manifest says how it ended, and the final metrics.jsonl counts every step once:

1. kill -9 the launcher during the save of step 2;
2. `train --resume` at once: the partial save is removed (said), it resumes from step-1; the
   torchrun agent is killed -9 during the save of step 3;
3. kill -9 rank 0 during the save of step 4: rank 0 is named;
4. kill -9 rank 1 in a step: rank 1 is named, not the rank that noticed;
5. SIGSTOP rank 0: named within train.heartbeat_timeout_s, the run ended;
6. the latest checkpoint truncated: the resume falls back to the one before, says so, and
   finishes; meanwhile a second `train`, `--resume` and `--force` on the live run are refused
   (exit 2, the holder's pid named) and change nothing.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.safety.runs import REPO, finish, metrics_steps, role, run_processes, start_train, wait_for, wait_for_ranks, wait_for_save, wait_until_gone
from tests.train.conftest import DATA_VOCAB, write_dataset, write_profile

pytestmark = pytest.mark.slow
STEPS = 10
HEARTBEAT_S = 10
# Wide attention (32 x 128 heads on the tiny target's hidden 64): each checkpoint is ~50 MB, a save
# that lasts long enough to be caught in the middle. The head proposes from the data's 50 tokens (DATA_VOCAB:
# cheap; what the faults do to the run does not depend on the head's width).
WIDE_DRAFTER = {"num_layers": 2, "target_layer_ids": [1, 2], "num_attention_heads": 32, "num_key_value_heads": 32,
                "head_dim": 128, **DATA_VOCAB}


def hold_rank_0_in_save(run_dir: Path, step: int) -> str:
    """Stop rank 0 (SIGSTOP) the moment its save of `step` has begun, so that the kill that follows
    lands inside the save on every run: the staging directory is there and not yet renamed."""
    ranks = wait_for_ranks(run_dir)
    staging = wait_for_save(run_dir / "train" / "checkpoints", step)
    os.kill(ranks[0], signal.SIGSTOP)
    assert (run_dir / "train" / "checkpoints" / staging).is_dir(), "the save finished before rank 0 was held"
    return staging


def manifest_train(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]


def latest(run_dir: Path) -> str:
    return (run_dir / "train" / "checkpoints" / "latest").read_text().strip()


def partial_saves(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "train" / "checkpoints").glob(".step-*"))


class Chain:
    def __init__(self, root: Path, target: Path, dataset: Path):
        self.run_dir = root / "run"
        settings = {"max_steps": STEPS, "save_every_steps": 1, "collective_timeout_s": 600, "drafter": WIDE_DRAFTER}
        self.profile = write_profile(root / "p.toml", target, dataset, self.run_dir, heartbeat_timeout_s=120, **settings)
        # the stopped-rank run: a short heartbeat timeout (the others keep the default, safe on a loaded machine)
        self.short_heartbeat = write_profile(root / "stall.toml", target, dataset, self.run_dir,
                                             heartbeat_timeout_s=HEARTBEAT_S, **settings)
        self.outputs: dict[str, tuple[int, str]] = {}

    def tree(self, process) -> list[psutil.Process]:
        wait_for_ranks(self.run_dir)
        return [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_qwen3_target) -> Chain:
    root = tmp_path_factory.mktemp("faults")
    return Chain(root, tiny_qwen3_target, write_dataset(root / "dataset"))


def test_1_kill_9_of_the_launcher_mid_save_leaves_no_process_and_says_how_the_run_ended(chain):
    process = start_train(chain.profile, chain.run_dir)
    members = chain.tree(process)
    assert {role(p) for p in members} >= {"launcher", "agent", "rank"}
    hold_rank_0_in_save(chain.run_dir, 2)
    os.kill(process.pid, signal.SIGKILL)
    assert wait_until_gone(chain.run_dir, members) == [], "processes of the run outlived its launcher"
    entry = manifest_train(chain.run_dir)
    assert entry["state"] == "failed" and entry["ended_by"] == "launcher gone"
    assert f"the launcher (pid {process.pid}) ended while training" in entry["error"] and "--resume" in entry["error"]
    # its 2 ranks, not every process the agent ended (the forkserver and the resource tracker besides)
    assert "its torchrun agent stopped the 2 rank process(es) before exiting" in entry["error"], entry["error"]
    assert latest(chain.run_dir) == "step-1" and metrics_steps(chain.run_dir) == [1, 2]
    time.sleep(2)                                              # nothing writes after the launcher's death
    assert latest(chain.run_dir) == "step-1" and metrics_steps(chain.run_dir) == [1, 2]
    assert not (chain.run_dir / "train" / "checkpoints" / "step-2").exists()
    status = subprocess.run([sys.executable, "launcher.py", "status", str(chain.run_dir)], cwd=REPO, text=True,
                            capture_output=True, timeout=120)
    assert status.returncode == 0 and (f"note: train failed (launcher gone); its last checkpoint is step-1: "
                                       f"`launcher.py train --profile {chain.profile.stem} --run-dir {chain.run_dir} --resume` "
                                       "continues from it") in status.stdout, status.stdout + status.stderr
    chain.outputs["partial"] = (0, " ".join(partial_saves(chain.run_dir)))


def test_2_resume_at_once_clears_the_partial_save_and_a_killed_agent_takes_its_ranks(chain):
    process = start_train(chain.profile, chain.run_dir, "--resume")
    members = chain.tree(process)
    hold_rank_0_in_save(chain.run_dir, 3)
    agent = next(p for p in members if role(p) == "agent")
    agent.kill()
    code, out = finish(process)
    assert code == 5, out
    assert f"error: the torchrun agent (pid {agent.pid}) was killed by SIGKILL; its ranks died with it" in out
    assert "the last complete checkpoint is step-2: continue from it with --resume" in out
    assert wait_until_gone(chain.run_dir, members) == []
    partial = chain.outputs["partial"][1]
    assert partial.startswith(".step-2.") and f"removed {chain.run_dir}/train/checkpoints/{partial}" in out
    assert "a partial checkpoint an interrupted save left behind" in out
    assert "resumed from" in out and "(step 1)" in out
    entry = manifest_train(chain.run_dir)
    assert entry["state"] == "failed" and entry["ended_by"] == "agent killed" and entry["exit_code"] == 5
    assert latest(chain.run_dir) == "step-2" and metrics_steps(chain.run_dir) == [1, 2, 3]
    assert not (chain.run_dir / "train" / "stopped.json").exists()


def test_3_kill_9_of_rank_0_mid_save_names_rank_0(chain):
    process = start_train(chain.profile, chain.run_dir, "--resume")
    members, ranks = chain.tree(process), wait_for_ranks(chain.run_dir)
    hold_rank_0_in_save(chain.run_dir, 4)
    os.kill(ranks[0], signal.SIGKILL)
    code, out = finish(process)
    assert code == 5, out
    assert f"error: rank 0 (pid {ranks[0]}) was killed by SIGKILL from outside the run" in out
    assert "out-of-memory killer" in out and "the last complete checkpoint is step-3" in out
    assert wait_until_gone(chain.run_dir, members) == []
    entry = manifest_train(chain.run_dir)
    assert entry["state"] == "failed" and entry["ended_by"] == "rank killed" and entry["failed_rank"] == 0
    assert latest(chain.run_dir) == "step-3" and partial_saves(chain.run_dir)


def test_4_kill_9_of_one_rank_mid_step_names_that_rank(chain):
    process = start_train(chain.profile, chain.run_dir, "--resume")
    members, ranks = chain.tree(process), wait_for_ranks(chain.run_dir)
    wait_for(lambda: 4 in metrics_steps(chain.run_dir) and latest(chain.run_dir) == "step-4", what="step 4")
    os.kill(ranks[1], signal.SIGKILL)
    code, out = finish(process)
    assert code == 5, out
    assert f"error: rank 1 (pid {ranks[1]}) was killed by SIGKILL from outside the run" in out
    assert "rank 0 failed first" not in out
    assert wait_until_gone(chain.run_dir, members) == []
    assert manifest_train(chain.run_dir)["failed_rank"] == 1


def test_5_a_stopped_rank_is_named_within_the_heartbeat_timeout(chain):
    process = start_train(chain.short_heartbeat, chain.run_dir, "--resume")
    members, ranks = chain.tree(process), wait_for_ranks(chain.run_dir)
    resumed = int(latest(chain.run_dir).split("-")[1])
    record = chain.run_dir / "train" / "ranks" / "rank-0.json"
    wait_for(lambda: json.loads(record.read_text()).get("step", 0) > resumed + 1, what="training under way")
    os.kill(ranks[0], signal.SIGSTOP)
    stopped_at = time.monotonic()
    code, out = finish(process, timeout=HEARTBEAT_S * 6)
    assert code == 5, out
    assert time.monotonic() - stopped_at < HEARTBEAT_S * 6
    assert re.search(rf"error: rank 0 \(pid {ranks[0]}\) stopped responding in its \w+ at step \d+: no heartbeat for", out), out
    assert (chain.run_dir / "train" / "failures" / "stacks-rank-0.txt").read_text().strip()     # continued to dump it
    assert "its process is stopped (SIGSTOP" in out and "The launcher ended the run" in out
    assert wait_until_gone(chain.run_dir, members) == []
    entry = manifest_train(chain.run_dir)
    assert entry["ended_by"] == "rank stopped" and entry["failed_rank"] == 0


def test_6_a_truncated_latest_falls_back_and_a_second_run_is_refused_while_it_lives(chain, cli):
    from dflash.train.supervisor.resume import remove_partial_saves

    checkpoints = chain.run_dir / "train" / "checkpoints"
    # the newest whole checkpoint, which a resume takes: `latest` may lag it, and an async save whose shards were
    # all written before rank 0 was stopped in test 5 is put in place first, as the launcher would
    remove_partial_saves(checkpoints, log=lambda line: None)
    damaged = max(checkpoints.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    before = int(damaged.name.split("-")[1])
    shard = damaged / "dcp" / "__0_0.distcp"                  # an intermediate checkpoint: its weights are in dcp/
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    process = start_train(chain.profile, chain.run_dir, "--resume")
    members = chain.tree(process)
    prevs = sorted(chain.run_dir.glob("train.prev-*"))
    for flags in ((), ("--resume",), ("--force",)):
        refused = cli("train", "--profile", chain.profile, "--run-dir", chain.run_dir, "--skip-preflight", *flags)
        assert refused.code == 2, (flags, refused.err)
        assert f"run directory {chain.run_dir} is in use by `launcher.py train` (pid {process.pid}" in refused.err
    assert sorted(chain.run_dir.glob("train.prev-*")) == prevs
    code, out = finish(process)
    assert code == 0, out
    assert f"skipped {damaged.name}: damaged:" in out and "an item needs bytes up to" in out and "(truncated)" in out
    assert f"resuming from step-{before - 1}, the newest whole checkpoint" in out
    assert metrics_steps(chain.run_dir) == list(range(1, STEPS + 1))       # every step once, in order
    assert manifest_train(chain.run_dir)["state"] == "done" and latest(chain.run_dir) == f"step-{STEPS}"
    assert not partial_saves(chain.run_dir) and wait_until_gone(chain.run_dir, members) == []
    assert run_processes(chain.run_dir) == []
