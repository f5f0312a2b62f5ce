"""`generate.backend = "vllm"`: the argv and environment (no server), and a real generation run on
vLLM's CPU build (-m engine; its venv from `launcher.py engine setup vllm`) with the demo target."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dflash.generate.servers import server_command_for
from dflash.generate.vllm_server import SEPARATE_WORKER_LOG_MARKS
from launcher_core.errors import ConfigError
from launcher_core.profile import load_profile
from tests.generate.gen_helpers import read_output_ids, write_profile, write_prompts


def vllm_profile(engine_python: str = ""):
    base = load_profile("cpu-demo")
    return dataclasses.replace(base, generate=dataclasses.replace(base.generate, backend="vllm"),
                               eval=dataclasses.replace(base.eval, engine_python=engine_python))


def test_the_vllm_backend_runs_the_engine_python_on_the_bind_host_with_a_cpu_kv_cache():
    command = server_command_for(vllm_profile("/engine/bin/python"), Path("/m"), port=9000)
    argv = command.argv
    assert argv[:3] == ["/engine/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--served-model-name") + 1] == "default" and "--gpu-memory-utilization" not in argv
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and command.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert command.argv[command.argv.index("--distributed-executor-backend") + 1] == "uni"
    assert command.env["OMP_NUM_THREADS"] == "2"         # cpu-demo's generate.server_threads: both cores
    base = vllm_profile("/engine/bin/python")
    unset = dataclasses.replace(base, generate=dataclasses.replace(base.generate, server_threads=0))
    assert "OMP_NUM_THREADS" not in server_command_for(unset, Path("/m"), port=9000).env   # torch's default
    assert command.base_url == "http://127.0.0.1:9000"


def test_the_vllm_backend_binds_the_profiles_host_once():
    profile = vllm_profile("/engine/bin/python")
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, bind_host="0.0.0.0"))
    command = server_command_for(profile, Path("/m"), port=9000)
    assert command.argv.count("--host") == 1 and command.argv[command.argv.index("--host") + 1] == "0.0.0.0"
    assert command.base_url == "http://127.0.0.1:9000"      # the client still talks to loopback


def test_without_the_engine_venv_the_error_names_engine_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="launcher.py engine setup vllm"):
        server_command_for(vllm_profile(), Path("/m"))
    assert sys.executable      # the fallback python has no vllm (the engine lives in its own venv)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_generation_through_vllm_on_cpu_writes_every_completion(tmp_path, smollm2_dir, vllm_python):
    from dflash.generate import generate_from_profile
    ids = write_prompts(tmp_path / "prompts.jsonl", 4, tools_every=0)
    path = write_profile(tmp_path / "p.toml", smollm2_dir, tmp_path / "run", tmp_path / "prompts.jsonl",
                         backend="vllm", concurrency=4, max_tokens=12, vllm_enforce_eager=True,
                         server_startup_timeout_s=900.0)
    summary = generate_from_profile(load_profile(str(path)), progress=False)
    assert summary.selected == 4 and sorted(read_output_ids(Path(summary.output_path))) == ids
    records = [json.loads(line) for line in Path(summary.output_path).read_text().splitlines()]
    assert all(r["completion_tokens"] > 0 and r["messages"][-1]["content"] for r in records), records[0]
    log = (tmp_path / "run" / "generate" / "server.log").read_text()
    assert "http://127.0.0.1:" in log and "vllm" in log.lower()
    assert "(EngineCore pid=" in log and not [mark for mark in SEPARATE_WORKER_LOG_MARKS if mark in log]
