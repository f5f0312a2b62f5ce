"""`generate.backend = "vllm"`: the argv and environment (no server), and a real generation run on
vLLM's CPU build (-m engine; its venv from `launcher.py engine setup vllm`) with the demo target; and
`--endpoint` against one vLLM CPU server started with `--api-key`: the key from the URL, `--api-key` or
DFLASH_API_KEY goes as a bearer header, a wrong or missing one is exit 2 before any prompt is sent, and
requests that all fail the same way stop the run early."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dflash.generate.servers import ServerSupervisor, server_command_for
from dflash.generate.vllm_server import SEPARATE_WORKER_LOG_MARKS
from launcher_core.errors import ConfigError
from launcher_core.profile import load_profile
from tests.generate.gen_helpers import free_port, read_output_ids, run_launcher, write_profile, write_prompts

API_KEY = "vllm-k3y-5ecret-0123"


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


@pytest.fixture(scope="module")
def vllm_with_key(tmp_path_factory, smollm2_dir, vllm_python):
    """One vLLM CPU server serving the demo target, started with `--api-key API_KEY` (its /health is open,
    its /v1 paths want `Authorization: Bearer API_KEY`), shared by this module's key tests; its base URL."""
    profile = vllm_profile(str(vllm_python))
    profile = dataclasses.replace(profile, generate=dataclasses.replace(profile.generate, vllm_enforce_eager=True))
    command = server_command_for(profile, smollm2_dir, port=free_port())
    command = dataclasses.replace(command, argv=[*command.argv, "--api-key", API_KEY])
    supervisor = ServerSupervisor(command, tmp_path_factory.mktemp("vllm-key") / "server.log",
                                  startup_timeout_s=900.0, max_restarts=0)
    supervisor.start()
    try:
        yield command.base_url
    finally:
        supervisor.stop()


def endpoint_run(tmp_path: Path, name: str, smollm2_dir: Path, count: int) -> tuple[Path, list[str]]:
    """A profile of `count` prompts whose run directory is tmp_path/name; (its path, the prompt ids)."""
    prompts = tmp_path / f"{name}.jsonl"
    ids = write_prompts(prompts, count, tools_every=0)
    return write_profile(tmp_path / f"{name}.toml", smollm2_dir, tmp_path / name, prompts, backend="endpoint",
                         concurrency=2, max_tokens=6, retries=0), ids


def written_anywhere(folder: Path, text: str) -> bool:
    return any(text in path.read_text(errors="replace") for path in folder.rglob("*") if path.is_file())


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("where", ["url", "flag", "environment"])
def test_a_key_from_the_url_the_flag_or_the_environment_authenticates_with_vllm(tmp_path, smollm2_dir,
                                                                               vllm_with_key, where):
    """vLLM's --api-key reads only `Authorization: Bearer`: each way of giving the key completes every prompt,
    and the key is printed and written nowhere."""
    profile_path, ids = endpoint_run(tmp_path, "run", smollm2_dir, 3)
    url = f"{vllm_with_key}/v1" + (f"?api_key={API_KEY}" if where == "url" else "")
    extra = ["--api-key", API_KEY] if where == "flag" else []
    env = {"DFLASH_API_KEY": API_KEY} if where == "environment" else {"DFLASH_API_KEY": ""}
    done = run_launcher(profile_path, "--endpoint", url, *extra, env=env)
    assert done.returncode == 0, done.stderr
    assert "completed 3, failed 0" in done.stdout and sorted(read_output_ids(tmp_path / "run" / "completions.jsonl")) == ids
    assert API_KEY not in done.stdout + done.stderr and not written_anywhere(tmp_path / "run", API_KEY)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_wrong_or_missing_key_is_exit_2_before_any_prompt_is_sent(tmp_path, smollm2_dir, vllm_with_key):
    """vLLM answers 401 to the start-up probe of /v1/models: exit 2 naming the endpoint (no key shown) and where
    the key came from, or that none was given; no completion nor failure is recorded."""
    wrong = "wr0ng-k3y-9876"
    for name, extra, env, says in (
            ("wrong", ["--endpoint", f"{vllm_with_key}/v1?api_key={wrong}"], {}, "refused the API key from ?api_key="),
            ("wrong-env", ["--endpoint", f"{vllm_with_key}/v1"], {"DFLASH_API_KEY": wrong},
             "refused the API key from DFLASH_API_KEY"),
            ("missing", ["--endpoint", f"{vllm_with_key}/v1"], {"DFLASH_API_KEY": ""},
             "wants an API key and none was given")):
        profile_path, _ids = endpoint_run(tmp_path, name, smollm2_dir, 3)
        failed = run_launcher(profile_path, *extra, env=env)
        assert failed.returncode == 2, failed.stderr
        assert f"error: --endpoint {vllm_with_key}: the server {says} (HTTP 401 on /v1/models); no prompt was sent." \
            in failed.stderr, failed.stderr
        assert wrong not in failed.stdout + failed.stderr and "Traceback" not in failed.stderr
        output = tmp_path / name / "completions.jsonl"
        assert not output.exists() or output.read_text() == ""
        assert not (tmp_path / name / "generate" / "failures.jsonl").exists()
        assert not written_anywhere(tmp_path / name, wrong)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_requests_all_failing_the_same_way_at_vllm_stop_the_run_early(tmp_path, smollm2_dir, vllm_with_key):
    """A wrong path under the right key: vLLM answers 404 to every chat request. The run stops after the first
    3 (one endpoint: `early_stop_bound`), exit 5 naming the error, the others left for a rerun, instead of
    waiting for the endpoint to come back."""
    from dflash.generate.workers import early_stop_bound

    bound = early_stop_bound(1)
    profile_path, _ids = endpoint_run(tmp_path, "run", smollm2_dir, 10)
    failed = run_launcher(profile_path, "--endpoint", f"{vllm_with_key}/nowhere/v1", "--api-key", API_KEY)
    assert failed.returncode == 5, failed.stderr
    assert (f"error: stopped early: the first {bound} requests all failed the same way (HTTP 404: "
            in failed.stderr), failed.stderr
    assert f"the other {10 - bound} prompt(s) are left for a rerun" in failed.stderr
    failures = (tmp_path / "run" / "generate" / "failures.jsonl").read_text().splitlines()
    assert len(failures) == bound and API_KEY not in failed.stderr
