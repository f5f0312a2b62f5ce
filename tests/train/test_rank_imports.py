"""The forkserver's preload (the agent's RANK_IMPORTS) against what a rank imports.

torchrun's forkserver imports RANK_IMPORTS once and forks every rank from it; it swallows an import that
fails, so a misspelt or moved name would silently cost each rank the import again. The rank's own import
graph (tests/compat/torch_lane.py, from dflash/train/rank/worker.py) must, once the preload ran, bring in no
third-party module outside the standard library: whatever heavy module a rank needs is in the preload.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("dflash", "envcheck", "launcher_core", "tests")

PROBE = r"""
import importlib, json, sys, time
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
from dflash.train.supervisor.agent import RANK_IMPORTS
from tests.compat.torch_lane import import_graph, module_name

failed = {}
for name in RANK_IMPORTS:
    try:
        importlib.import_module(name)
    except Exception as error:  # the forkserver swallows these: the probe reports them
        failed[name] = f"{type(error).__name__}: {error}"
before = set(sys.modules)
started = time.process_time()
graph = sorted(module_name(path, root) for path in import_graph([root / "dflash/train/rank/worker.py"], root))
for name in graph:
    importlib.import_module(name)
print(json.dumps({"failed": failed, "graph": graph, "cpu_s": time.process_time() - started,
                  "new": sorted(set(sys.modules) - before)}))
"""


def probe() -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(REPO_ROOT)], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def third_party(modules: list[str]) -> list[str]:
    """The modules that are neither the project's nor the standard library's."""
    return [name for name in modules
            if name.split(".")[0] not in PROJECT and name.split(".")[0] not in sys.stdlib_module_names
            and not name.startswith("_")]


def test_every_preloaded_name_imports_and_the_rank_needs_nothing_heavy_beyond_them():
    found = probe()
    assert found["failed"] == {}, f"RANK_IMPORTS names that do not import: {found['failed']}"
    assert "dflash.train.rank.step" in found["graph"] and "dflash.drafter.loss" in found["graph"]
    assert third_party(found["new"]) == [], (
        "the rank imports these after the forkserver's preload (add them, or what imports them, to "
        f"dflash/train/supervisor/agent.py RANK_IMPORTS): {third_party(found['new'])}")


def test_the_check_names_a_third_party_module_and_spares_the_standard_library():
    assert third_party(["tomllib", "json.decoder", "dflash.target_model", "numpy.linalg", "_io"]) == ["numpy.linalg"]
