"""How a vLLM server starts: its python (the engine venv `launcher.py engine setup vllm` built, or
eval.engine_python), its flags without speculation and its environment. Shared by generation
(`generate.backend = "vllm"`, dflash.generate.servers) and the engine eval (dflash.eval.engines)."""
from __future__ import annotations

import sys
from pathlib import Path

from launcher_core.errors import ConfigError
from launcher_core.schema import Profile

SERVED_MODEL_NAME = "default"      # the model name our requests carry (vLLM: --served-model-name)
CPU_MAX_MODEL_LEN = 1024           # vLLM on CPU without a configured length: prompt + completion of the eval
# vLLM 0.32 on CPU binds its model worker to one core and keeps another for an engine process that
# spins waiting for it; the uniprocess executor (kept by platforms/cpu.py only with this variable 0) runs
# the model in the engine process on our threads. docs/serving.md "vLLM on CPU";
# benchmarks/results/vllm-cpu-one-process_cpu-2core_2026-12-05.md.
CPU_ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The n-gram proposer (prompt lookup) runs numba on at most one thread, but numba's pool starts one per
# core and the idle ones spin beside the decoding thread. docs/serving.md "vLLM on CPU";
# benchmarks/results/vllm-cpu-numba-thread_cpu-2core_2026-12-05.md.
CPU_NUMBA_THREADS = {"NUMBA_NUM_THREADS": "1"}
CPU_EXECUTOR_ARGS = ["--distributed-executor-backend", "uni"]
SEPARATE_WORKER_LOG_MARKS = ("(Worker pid=", "OpenMP thread binding info")   # what vLLM's default layout logs
LAUNCH_MODULES = {"sglang": ["-m", "sglang.launch_server"], "vllm": ["-m", "vllm.entrypoints.openai.api_server"]}


def engine_python(profile: Profile, engine: str = "") -> str:
    """eval.engine_python, else the venv `launcher.py engine setup ENGINE` built, else this python."""
    from envcheck.engine_venvs import built_engine_python

    if profile.eval.engine_python:
        return profile.eval.engine_python
    built = built_engine_python(engine) if engine else None
    return str(built) if built else sys.executable


def runnable_engine_python(python: str) -> str:
    """eval.engine_python as set when it runs (a path, or a name on PATH); ConfigError naming the key otherwise."""
    import os
    import shutil

    if shutil.which(python) is not None:
        return python
    what = "not an executable file" if os.path.exists(python) else "no such file (or command on PATH)"
    raise ConfigError(f"eval.engine_python = {python!r}: {what}; set it to the python of the environment that has "
                      f"the engine (its venv's bin/python), or to \"\" to use the venv `launcher.py engine setup "
                      f"ENGINE` builds")


def vllm_env(profile: Profile, cpu_threads: int = 0) -> dict[str, str]:
    """vLLM's environment: offline, no usage reports; on CPU the KV cache size in GiB, one numba thread
    (CPU_NUMBA_THREADS), the model run inside the engine process (CPU_ONE_PROCESS) and `cpu_threads`
    torch threads (0: torch's default)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if profile.machine.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(profile.generate.vllm_cpu_kvcache_gib)
        env.update(CPU_NUMBA_THREADS)
    if runs_in_one_process(profile):
        env.update(CPU_ONE_PROCESS)
        if cpu_threads > 0:
            env["OMP_NUM_THREADS"] = str(cpu_threads)
    return env


def runs_in_one_process(profile: Profile) -> bool:
    """vLLM on CPU with one tensor-parallel rank: the model runs in the engine process (CPU_ONE_PROCESS)."""
    return profile.machine.device == "cpu" and profile.generate.tp_size == 1


def vllm_base_args(profile: Profile, target: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """vLLM's server flags without speculation: model, `host` (loopback unless the caller binds the
    profile's machine.bind_host), dtype, the served name, memory, length."""
    args = ["--model", str(target), "--host", host, "--port", str(port), "--dtype", profile.model.dtype,
            "--served-model-name", SERVED_MODEL_NAME, "--tensor-parallel-size", str(profile.generate.tp_size)]
    if profile.machine.device != "cpu":     # on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE (vllm_env)
        args += ["--gpu-memory-utilization", str(profile.generate.mem_fraction_static)]
    if runs_in_one_process(profile):
        args += CPU_EXECUTOR_ARGS
    length = profile.generate.vllm_max_model_len or profile.generate.context_length
    length = length or (CPU_MAX_MODEL_LEN if profile.machine.device == "cpu" else 0)
    if length > 0:
        args += ["--max-model-len", str(length)]
    if profile.generate.vllm_enforce_eager:
        args.append("--enforce-eager")
    return args
