"""The flight recorder on NCCL (unproven until a GPU machine runs it). One GPU holds one NCCL rank, so the
stuck-rank drills themselves run on gloo (tests/safety/test_safety_stuck.py); what only a GPU shows is checked
here on a real one-rank CUDA run under `run_training`:

* the launcher turned the recorder on for the rank (its environment: tests/train/test_launch.py);
* a dump asked for mid-run (`request_dumps`, as the watchdog asks) writes the rank's stacks and a flight recorder
  dump whose entries are NCCL collectives with their states, which torch's `fr_trace` reads (the heartbeat's,
  from `_dump_nccl_trace`), and NCCL's monitor thread answers the rank's dump pipe with a dump of its own into
  train/failures/nccl-flight-recorder/;
* the heartbeat counts the rank's NCCL collectives once it is quiet (a stall injected in its reduction)."""
from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_the_nccl_flight_recorder_is_on_and_dumps_into_the_run(record, tmp_path, tiny_qwen3_target, tiny_dataset):
    from dflash.train.supervisor.heartbeat import flight_recorder_dir, nccl_flight_recorder_dir, rank_records
    from dflash.train.supervisor.launch import run_training
    from dflash.train.supervisor.watchdog import request_dumps
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_profile

    run_dir = tmp_path / "run"
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, run_dir,
                                             machine={"nproc_per_node": 1, "device": "cuda", "backend": "nccl",
                                                      "gpu_count": 1},
                                             max_steps=8, stuck_floor_s=4, stuck_after_steps=2)))
    asked: dict[str, object] = {}

    def ask_when_quiet() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            records = rank_records(run_dir)
            if records and records[0].progress.get("collectives"):        # quiet past half the floor: counted
                asked["record"] = records[0].progress
                asked["stacks"] = request_dumps(run_dir)
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=ask_when_quiet, daemon=True)
    watcher.start()
    code = run_training(profile, run_dir=run_dir, extra_env={"DFLASH_INJECT_STALL": "rank=0,step=4,phase=reduction,seconds=8"})
    watcher.join(timeout=5)
    assert code == 0
    progress = asked.get("record")
    assert isinstance(progress, dict) and progress["phase"] == "reduction" and progress["step"] == 4
    assert sum(progress["collectives"].values()) > 0 and "nccl" in str(progress.get("last_collective", "")).lower()
    dump = flight_recorder_dir(run_dir) / "rank-0"
    entries = pickle.loads(dump.read_bytes())["entries"]
    assert entries and all(entry["profiling_name"].startswith("nccl:") for entry in entries)
    assert {entry["state"] for entry in entries} <= {"scheduled", "started", "completed"}
    assert asked.get("stacks"), "the rank's stacks were not dumped"
    nccl_dump = nccl_flight_recorder_dir(run_dir) / "rank-0"
    assert nccl_dump.exists(), "NCCL's monitor thread did not answer the rank's dump pipe"
    assert all(e["profiling_name"].startswith("nccl:") for e in pickle.loads(nccl_dump.read_bytes())["entries"])
    analysis = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               str(flight_recorder_dir(run_dir)), "--prefix", "rank-", "-j"],
                              capture_output=True, text=True, timeout=120)
    assert analysis.returncode == 0, analysis.stderr
    record.figure(entries=len(entries), states=sorted({e["state"] for e in entries}), collectives=progress["collectives"])

