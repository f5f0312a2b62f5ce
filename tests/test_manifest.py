"""The run manifest: atomic, merged updates; a stage that runs again forgets how it last stopped."""
from __future__ import annotations

import json
import multiprocessing

from launcher_core.manifest import manifest_path, read_manifest, update_stage


def test_updates_merge_figures_and_survive_as_valid_json(tmp_path):
    update_stage(tmp_path, "generate", "running", selected=10)
    update_stage(tmp_path, "generate", None, completed=4)
    entry = read_manifest(tmp_path)["stages"]["generate"]
    assert entry["state"] == "running" and entry["selected"] == 10 and entry["completed"] == 4
    assert json.loads(manifest_path(tmp_path).read_text())["stages"]["generate"]["completed"] == 4


def test_a_failure_is_forgotten_once_the_stage_runs_again(tmp_path):
    update_stage(tmp_path, "generate", "failed", error="KeyboardInterrupt", completed=3)
    assert read_manifest(tmp_path)["stages"]["generate"]["error"] == "KeyboardInterrupt"
    update_stage(tmp_path, "generate", "running")
    update_stage(tmp_path, "generate", "done", completed=10)
    entry = read_manifest(tmp_path)["stages"]["generate"]
    assert "error" not in entry and entry["completed"] == 10 and entry["state"] == "done"


def _bump(run_dir, index):
    update_stage(run_dir, f"stage{index % 3}", None, **{f"k{index}": index})


def test_concurrent_writers_lose_no_update(tmp_path):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.starmap(_bump, [(tmp_path, i) for i in range(24)])
    stages = read_manifest(tmp_path)["stages"]
    keys = {key for entry in stages.values() for key in entry if key.startswith("k")}
    assert keys == {f"k{i}" for i in range(24)}
