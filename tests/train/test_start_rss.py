"""A rank's host RAM at start is what the plan says (dflash.memory.host_ram): on 2 real gloo ranks
(torchrun), a drafter of 284 M parameters (10 layers 1024 wide with a 8192-wide MLP, the width of a
small target: 1.1 GB in float32) built in the trainer's order (`build_state`: on the meta device, sharded,
materialised per shard; the target loaded up to its deepest tap) peaks below the plan's per-rank figure
and near it; built in the order before (the whole target, the whole drafter on the host, then sharded)
it peaks above the figure. Measured: the rank's peak RSS (ru_maxrss) after its state is built."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile
from tests.train.start_rss_worker import wide_target

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
DRAFTER = {"num_layers": 10, "target_layer_ids": [0], "mask_token_id": 2000}


def peak_rss_mib(tmp_path: Path, profile: Path, order: str) -> list[float]:
    out = tmp_path / order
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(HERE.parents[1])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / f"torchrun-logs-{order}"), str(HERE / "start_rss_worker.py"),
                           "--profile", str(profile), "--order", order, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank-{rank}.json").read_text())["peak_rss_mib"] for rank in (0, 1)]


def test_a_rank_starts_within_the_planned_host_ram_and_the_whole_build_did_not(tmp_path, tiny_dataset):
    from dflash.memory.budget import make_plan
    from dflash.memory.host_ram import host_ram_at_start

    path = write_profile(tmp_path / "p.toml", wide_target(tmp_path / "target"), tiny_dataset, tmp_path / "run",
                         drafter=DRAFTER)
    profile = load_profile(str(path))
    planned = host_ram_at_start(profile, make_plan(profile))
    assert 1000 < planned.whole_drafter_mib < 1150 and planned.ranks == 2
    sharded, whole = peak_rss_mib(tmp_path, path, "sharded"), peak_rss_mib(tmp_path, path, "whole")
    print(f"planned per rank {planned.per_rank_mib:.0f} MiB ({planned.terms()}); measured peak RSS: sharded "
          f"{sharded[0]:.0f} / {sharded[1]:.0f} MiB, whole {whole[0]:.0f} / {whole[1]:.0f} MiB")
    assert all(0.7 * planned.per_rank_mib < rss <= planned.per_rank_mib for rss in sharded), (sharded, planned)
    assert all(rss > planned.per_rank_mib for rss in whole), (whole, planned)
    assert min(whole) - max(sharded) > 0.35 * planned.whole_drafter_mib      # the whole drafter's half, and more
