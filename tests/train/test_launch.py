"""The torchrun command builder (pure: nothing starts) and the resolved-profile hand-over."""
from __future__ import annotations

import dataclasses

from dflash.train.supervisor.launch import build_torchrun_command, describe_command
from launcher_core.paths import REPO_ROOT as REPO
from launcher_core.profile import load_profile, profile_from_json, profile_to_json


def test_single_node_rendezvous_is_on_loopback_with_the_profile_nproc(tmp_path):
    profile = load_profile("cpu-demo")
    argv, env = build_torchrun_command(profile, tmp_path, resume=True, python="py", base_env={"PATH": "/bin"})
    assert argv[:3] == ["py", "-m", "dflash.train.supervisor.agent"] and "--standalone" not in argv
    assert argv[argv.index("--nnodes") + 1] == "1" and argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:PORT"      # filled in at launch
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    # ranks forked from torchrun's forkserver, which runs the worker script as a function entrypoint
    assert argv[argv.index("--start-method") + 1] == "forkserver" and argv[-1] == "--resume"
    assert argv[argv.index("--run-path") + 1] == str(REPO / "dflash" / "train" / "rank" / "worker.py")
    assert env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1" and int(env["OMP_NUM_THREADS"]) >= 1
    assert env["PYTHONFAULTHANDLER"] == "1"              # a rank's fatal signal leaves its Python stack in its log


def test_single_node_joins_the_launchers_loopback_store_and_keeps_the_ranks_on_loopback(tmp_path):
    from dflash.train.supervisor.rendezvous import STORE_ENV, loopback_interface

    argv, env = build_torchrun_command(load_profile("cpu-demo"), tmp_path, python="py", base_env={}, store="127.0.0.1:4242")
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:4242"
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=false"             # the agent is a client, it hosts nothing
    assert argv[argv.index("--local-addr") + 1] == "127.0.0.1"
    assert env[STORE_ENV] == "127.0.0.1:4242" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == loopback_interface()
    assert "DFLASH_RDZV_STORE=127.0.0.1:4242" in describe_command(argv, env)


def test_multi_node_uses_a_c10d_rendezvous(tmp_path):
    base = load_profile("cpu-demo")
    profile = dataclasses.replace(base, machine=dataclasses.replace(base.machine, nnodes=2, rdzv_endpoint="10.0.0.1:29400"))
    argv, env = build_torchrun_command(profile, tmp_path, python="py", base_env={})
    assert "--standalone" not in argv and "--rdzv-conf" not in argv         # torchrun's own store on the profile's host
    assert not {"DFLASH_RDZV_STORE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME"} & set(env)
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"


def test_printed_command_never_shows_secrets(tmp_path):
    argv, env = build_torchrun_command(load_profile("cpu-demo"), tmp_path, base_env={"HF_TOKEN": "hf_abc"},
                                       extra_env={"OMP_NUM_THREADS": "3"})
    line = describe_command(argv, env, keys=("OMP_NUM_THREADS", "HF_TOKEN"))
    assert "hf_abc" not in line and "OMP_NUM_THREADS=3" in line and "HF_TOKEN='<redacted>'" in line


def test_resolved_profile_round_trips_through_json(tmp_path):
    profile = load_profile("rtx6000-x8")
    path = tmp_path / "profile.json"
    path.write_text(profile_to_json(profile))
    assert profile_from_json(path) == profile


def test_train_print_command_starts_nothing_and_imports_no_torch(repo_root):
    import subprocess
    import sys

    code = ("import sys, launcher; code = launcher.main(['train', '--profile', 'cpu-demo', '--print-command']); "
            "assert 'torch' not in sys.modules, 'train --print-command imported torch'; sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "dflash.train.supervisor.agent --nnodes 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf is_host=false" in result.stdout
    assert "--start-method forkserver --run-path " in result.stdout and "dflash/train/rank/worker.py" in result.stdout


def _cuda_profile(expandable: bool = True):
    profile = load_profile("rtx6000-x8")
    return dataclasses.replace(profile, memory=dataclasses.replace(profile.memory, expandable_segments=expandable))


def test_cuda_ranks_get_expandable_segments_by_default_and_the_printed_command_shows_it(tmp_path):
    argv, env = build_torchrun_command(_cuda_profile(), tmp_path, python="py", base_env={})
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in describe_command(argv, env)


def test_the_profile_key_turns_expandable_segments_off(tmp_path):
    _, env = build_torchrun_command(_cuda_profile(expandable=False), tmp_path, python="py", base_env={})
    assert "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env


def test_a_users_own_allocator_variable_is_completed_in_place_never_overridden(tmp_path):
    """torch 2.9 and 2.13 each read the first allocator variable set (in opposite orders): the setting
    goes into the variable the user set, with the user's options kept."""
    _, env = build_torchrun_command(_cuda_profile(), tmp_path, python="py",
                                    base_env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in env
    _, env = build_torchrun_command(_cuda_profile(), tmp_path, python="py",
                                    base_env={"PYTORCH_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:64"})
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:False,max_split_size_mb:64"
    _, env = build_torchrun_command(_cuda_profile(), tmp_path, python="py",      # torch 2.9 would read the empty one
                                    base_env={"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert "PYTORCH_ALLOC_CONF" not in env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"


def test_users_allocator_variables_that_disagree_stop_the_launch(tmp_path):
    import pytest

    from launcher_core.errors import ConfigError

    with pytest.raises(ConfigError, match="disagree on expandable_segments"):
        build_torchrun_command(_cuda_profile(), tmp_path, python="py",
                               base_env={"PYTORCH_ALLOC_CONF": "expandable_segments:False",
                                         "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})


def test_cpu_ranks_get_no_allocator_variable(tmp_path):
    _, env = build_torchrun_command(load_profile("cpu-demo"), tmp_path, python="py", base_env={})
    assert "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env


def test_every_rank_runs_with_the_flight_recorder_and_cuda_ranks_dump_it_into_the_run(tmp_path):
    """torch's flight recorder on every rank (both variable names: torch 2.9 reads TORCH_NCCL_*), a user's own
    size kept; on CUDA, NCCL's dump (at a collective's timeout, or asked through the rank's dump pipe in
    train/ranks/) goes to train/failures/nccl-flight-recorder/."""
    from dflash.train.supervisor.launch import build_torchrun_command
    from launcher_core.profile import load_profile

    cuda = load_profile("rtx6000-x8")
    _, env = build_torchrun_command(cuda, tmp_path / "run", base_env={})
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "train" / "failures" / "nccl-flight-recorder" / "rank-")
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == str(tmp_path / "run" / "train" / "ranks" / "nccl-dump-rank-")
    _, own = build_torchrun_command(cuda, tmp_path / "run", base_env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"})
    assert own["TORCH_FR_BUFFER_SIZE"] == own["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    _, cpu = build_torchrun_command(load_profile("cpu-demo"), tmp_path / "run", base_env={})
    assert cpu["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_FR_DUMP_TEMP_FILE" not in cpu
    assert "TORCH_NCCL_DEBUG_INFO_PIPE_FILE" not in cpu
