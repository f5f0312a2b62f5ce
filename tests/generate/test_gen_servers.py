"""Server commands are pure (argv, env) builders: their arguments are checked without starting anything."""
from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from dflash.generate.servers import ensure_port_free, server_command_for, sglang_server_command, transformers_server_command
from launcher_core.errors import ConfigError, RunFailed
from launcher_core.profile import load_profile
from launcher_core.redact import redact_env


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_sglang_command_carries_the_profile():
    profile = load_profile("rtx6000-x8")
    command = sglang_server_command(profile, Path("/models/target"), python="python3")
    argv = command.argv
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/models/target"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "30000"
    assert flag(argv, "--tp-size") == "1" and flag(argv, "--dp-size") == "8"
    assert flag(argv, "--mem-fraction-static") == "0.85"
    assert flag(argv, "--attention-backend") == "flashinfer"
    assert flag(argv, "--reasoning-parser") == "qwen3"
    assert flag(argv, "--dtype") == "bfloat16"
    assert "--tool-call-parser" not in argv
    assert command.base_url == "http://127.0.0.1:30000" and command.health_url.endswith("/health")


def test_sglang_maps_our_attention_backend_names():
    profile = load_profile("b200-x8")  # audit.attention_backend = "trtllm"
    assert flag(sglang_server_command(profile, Path("m")).argv, "--attention-backend") == "trtllm_mha"
    cpu = load_profile("cpu-demo")     # torch_sdpa
    assert flag(sglang_server_command(cpu, Path("m")).argv, "--attention-backend") == "torch_native"


def test_sglang_optional_flags_and_bind_host():
    profile = load_profile("h200-x1")
    generate = dataclasses.replace(profile.generate, tool_call_parser="qwen25", reasoning_parser="", tp_size=2)
    machine = dataclasses.replace(profile.machine, bind_host="0.0.0.0")
    command = sglang_server_command(dataclasses.replace(profile, generate=generate, machine=machine), Path("m"), port=31000)
    assert flag(command.argv, "--tool-call-parser") == "qwen25" and "--reasoning-parser" not in command.argv
    assert flag(command.argv, "--tp-size") == "2" and flag(command.argv, "--host") == "0.0.0.0"
    assert command.base_url == "http://127.0.0.1:31000"  # the client still talks to loopback


def test_transformers_serve_command():
    base = load_profile("cpu-demo")
    profile = dataclasses.replace(base, generate=dataclasses.replace(base.generate, backend="transformers"))
    command = server_command_for(profile, Path("/cache/smollm2"))
    assert command.argv[1:5] == ["-m", "transformers.cli.transformers", "serve", "/cache/smollm2"]
    assert flag(command.argv, "--device") == "cpu" and flag(command.argv, "--host") == "127.0.0.1"
    assert flag(command.argv, "--port") == "8765" and flag(command.argv, "--dtype") == "float32"
    assert command.env["HF_HUB_OFFLINE"] == "1"
    assert transformers_server_command(profile, Path("m"), port=9999).base_url == "http://127.0.0.1:9999"


def test_endpoint_backend_starts_nothing():
    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, generate=dataclasses.replace(profile.generate, backend="endpoint"))
    with pytest.raises(ConfigError, match="--endpoint"):
        server_command_for(profile, Path("m"))


def test_busy_port_is_refused_with_its_number():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(RunFailed, match=f"127.0.0.1:{port}"):
            ensure_port_free(f"http://127.0.0.1:{port}", "transformers serve")
    ensure_port_free(f"http://127.0.0.1:{port}", "transformers serve")  # closed again: fine


def test_secrets_are_redacted_in_plans():
    env = redact_env({"HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "sk", "HF_HUB_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false"})
    assert env == {"HF_TOKEN": "<redacted>", "OPENAI_API_KEY": "<redacted>", "HF_HUB_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}


def test_transformers_serve_continuous_batching_flag():
    profile = load_profile("h200-x1")
    assert "--continuous-batching" not in transformers_server_command(profile, Path("m")).argv
    generate = dataclasses.replace(profile.generate, continuous_batching=True)
    argv = transformers_server_command(dataclasses.replace(profile, generate=generate), Path("m")).argv
    assert argv.count("--continuous-batching") == 1
    assert "--cb-num-blocks" not in argv
    generate = dataclasses.replace(generate, cb_num_blocks=64)
    argv = transformers_server_command(dataclasses.replace(profile, generate=generate), Path("m")).argv
    assert flag(argv, "--cb-num-blocks") == "64"


def test_cpu_server_threads_default_one_unless_set_and_profile_wins():
    cpu = load_profile("cpu-demo")
    plain = dataclasses.replace(cpu, generate=dataclasses.replace(cpu.generate, server_threads=0))
    assert transformers_server_command(plain, Path("m"), environ={}).env["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in transformers_server_command(plain, Path("m"), environ={"OMP_NUM_THREADS": "2"}).env
    pinned = dataclasses.replace(cpu, generate=dataclasses.replace(cpu.generate, server_threads=3))
    assert transformers_server_command(pinned, Path("m"), environ={"OMP_NUM_THREADS": "1"}).env["OMP_NUM_THREADS"] == "3"
    gpu = load_profile("h200-x1")
    assert "OMP_NUM_THREADS" not in transformers_server_command(gpu, Path("m"), environ={}).env
