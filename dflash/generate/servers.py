"""Generation servers: pure (argv, env) builders and a supervisor that runs one.

`sglang_server_command` and `transformers_server_command` only build the command line, so they
are tested without starting anything. `ServerSupervisor` starts the command in its own process
group with output appended to `{run_dir}/generate/server.log`, waits for `/health`, restarts it
(a bounded number of times) when it dies, and stops the whole group on exit or Ctrl-C.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping

from launcher_core.errors import ConfigError, RunFailed
from launcher_core.processes import child_tempdir, child_tempdir_env, stop_group
from launcher_core.schema import Profile

# our profile's audit.attention_backend -> SGLang's --attention-backend
SGLANG_ATTENTION_BACKENDS = {
    "flashinfer": "flashinfer",
    "fa3": "fa3",
    "trtllm": "trtllm_mha",
    "triton": "triton",
    "torch_sdpa": "torch_native",
}
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class ServerCommand:
    """A server to start: argv, the environment variables added to the parent's, and where it answers."""

    argv: list[str]
    env: dict[str, str]
    base_url: str
    name: str

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"


def client_host(bind_host: str) -> str:
    """Where the launcher connects to a server bound on `bind_host`."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host


def sglang_server_command(profile: Profile, model_path: Path, port: int | None = None,
                          python: str = sys.executable) -> ServerCommand:
    """`python -m sglang.launch_server` with the profile's model, parallelism, memory and parsers."""
    settings, host = profile.generate, profile.machine.bind_host
    port = settings.port if port is None else port
    argv = [python, "-m", "sglang.launch_server",
            "--model-path", str(model_path),
            "--host", host, "--port", str(port),
            "--tp-size", str(settings.tp_size), "--dp-size", str(settings.dp_size),
            "--mem-fraction-static", str(settings.mem_fraction_static),
            "--attention-backend", sglang_attention_backend(profile.audit.attention_backend),
            "--dtype", profile.model.dtype]
    if profile.model.tokenizer:
        argv += ["--tokenizer-path", profile.model.tokenizer]
    if settings.context_length > 0:
        argv += ["--context-length", str(settings.context_length)]
    if is_hybrid_target(model_path):     # linear-attention state: SGLang's radix cache needs the extra buffer
        argv += ["--mamba-scheduler-strategy", "extra_buffer"]
    if settings.reasoning_parser:
        argv += ["--reasoning-parser", settings.reasoning_parser]
    if settings.tool_call_parser:
        argv += ["--tool-call-parser", settings.tool_call_parser]
    return ServerCommand(argv, {}, f"http://{client_host(host)}:{port}", "sglang")


HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def is_hybrid_target(model_path: Path) -> bool:
    """True for targets with linear-attention (Gated DeltaNet / Mamba-style) layers, read from config.json."""
    import json

    from dflash.target_model import layer_types, text_config_dict

    path = Path(model_path) / "config.json"
    if not path.exists():
        return False
    config = json.loads(path.read_text(encoding="utf-8"))
    model_type = text_config_dict(config).get("model_type", config.get("model_type"))
    return bool({"linear_attention", "mamba"} & set(layer_types(config))) or model_type in HYBRID_MODEL_TYPES


def sglang_attention_backend(ours: str) -> str:
    if ours not in SGLANG_ATTENTION_BACKENDS:
        raise ConfigError(f"audit.attention_backend {ours!r} has no SGLang equivalent; "
                          f"valid: {', '.join(SGLANG_ATTENTION_BACKENDS)}")
    return SGLANG_ATTENTION_BACKENDS[ours]


def transformers_server_command(profile: Profile, model_path: Path, port: int | None = None,
                                python: str = sys.executable,
                                environ: Mapping[str, str] | None = None) -> ServerCommand:
    """`transformers serve MODEL` on the profile's device, preloaded, bound to the profile's host.

    `generate.continuous_batching` adds `--continuous-batching` (all requests in flight share one
    batched forward; same text at temperature 0); `generate.cb_num_blocks` caps its KV cache, which
    otherwise takes most of the free memory (12 GB of RAM on CPU). On CPU the server's OpenMP threads are
    `generate.server_threads`, else 1 unless `environ` (default: this process's) already sets
    OMP_NUM_THREADS: concurrent requests each spinning every core's thread starve each other.
    """
    settings, host = profile.generate, profile.machine.bind_host
    port = settings.port if port is None else port
    device = "cpu" if profile.machine.device == "cpu" else "auto"
    argv = [python, "-m", "transformers.cli.transformers", "serve", str(model_path),
            "--device", device, "--dtype", profile.model.dtype,
            "--host", host, "--port", str(port), "--log-level", "info"]
    if settings.continuous_batching:
        argv.append("--continuous-batching")
        if settings.cb_num_blocks > 0:
            argv += ["--cb-num-blocks", str(settings.cb_num_blocks)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **server_thread_env(profile, os.environ if environ is None else environ)}
    return ServerCommand(argv, env, f"http://{client_host(host)}:{port}", "transformers serve")


def server_thread_env(profile: Profile, environ: Mapping[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS for a CPU server: the profile's server_threads, else 1 unless already set."""
    if profile.machine.device != "cpu":
        return {}
    if profile.generate.server_threads > 0:
        return {"OMP_NUM_THREADS": str(profile.generate.server_threads)}
    return {} if "OMP_NUM_THREADS" in environ else {"OMP_NUM_THREADS": "1"}


def vllm_server_command(profile: Profile, model_path: Path, port: int | None = None) -> ServerCommand:
    """`python -m vllm.entrypoints.openai.api_server` from the engine's venv (`launcher.py engine setup vllm`,
    or eval.engine_python), bound to the profile's host; on CPU its KV cache is generate.vllm_cpu_kvcache_gib
    and the model runs in the engine process (vllm_server.vllm_env) on generate.server_threads threads
    (0: torch's default, every core; vLLM batches the requests in flight into one forward)."""
    import importlib.util

    from dflash.generate.vllm_server import LAUNCH_MODULES, engine_python, vllm_base_args, vllm_env

    settings, host = profile.generate, profile.machine.bind_host
    port = settings.port if port is None else port
    python = engine_python(profile, "vllm")
    if python == sys.executable and importlib.util.find_spec("vllm") is None:
        raise ConfigError("generate.backend 'vllm': vLLM is not installed here and eval.engine_python is not set; "
                          "run `launcher.py engine setup vllm` (its venv is then used) or set eval.engine_python")
    argv = [python, *LAUNCH_MODULES["vllm"], *vllm_base_args(profile, model_path, port, host)]
    env = vllm_env(profile, profile.generate.server_threads)
    return ServerCommand(argv, env, f"http://{client_host(host)}:{port}", "vllm")


def server_command_for(profile: Profile, model_path: Path, port: int | None = None) -> ServerCommand:
    """The command for the profile's `generate.backend` (sglang, transformers or vllm)."""
    builders = {"sglang": sglang_server_command, "transformers": transformers_server_command,
                "vllm": vllm_server_command}
    if profile.generate.backend not in builders:
        raise ConfigError(f"generate.backend {profile.generate.backend!r} starts no server; "
                          "pass --endpoint URL for an already-running one")
    return builders[profile.generate.backend](profile, model_path, port)


def health_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (loopback URL we built)
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class ServerSupervisor:
    """Runs one ServerCommand: start, wait for health, restart when it dies, stop its process group."""

    command: ServerCommand
    log_path: Path
    startup_timeout_s: float = 900.0
    max_restarts: int = 3
    restarts: int = 0
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _tempdir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start the server and block until /health answers (RunFailed if it exits or times out)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(self.command.argv)}\n".encode())
        self._log.flush()
        ensure_port_free(self.command.base_url, self.command.name)
        self._tempdir = child_tempdir("server")       # removed by stop(), after the whole group
        env = {**os.environ, **child_tempdir_env(self._tempdir.name), **self.command.env}
        self.process = subprocess.Popen(self.command.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RunFailed(f"{self.command.name} exited with code {self.exit_code()} while starting; "
                                f"see {self.log_path}")
            if health_ok(self.command.health_url):
                return
            time.sleep(0.25)
        self.stop()
        raise RunFailed(f"{self.command.name} did not answer {self.command.health_url} within "
                        f"{self.startup_timeout_s:.0f} s (generate.server_startup_timeout_s); see {self.log_path}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """The server's exit code; None while it runs or before it started."""
        return self.process.returncode if self.process is not None else None

    def restart(self) -> None:
        """Restart after the server died; RunFailed once generate.max_server_restarts is used up."""
        code = self.exit_code()
        if self.restarts >= self.max_restarts:
            raise RunFailed(f"{self.command.name} died (exit code {code}) and was already restarted "
                            f"{self.restarts} time(s) (generate.max_server_restarts); see {self.log_path}")
        self.restarts += 1
        print(f"warning: {self.command.name} died (exit code {code}); restart {self.restarts}/{self.max_restarts}",
              file=sys.stderr)
        self.stop()
        self.start()

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after a grace period; idempotent."""
        if self.process is not None:
            stop_group(self.process, STOP_GRACE_S)
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None
        if self._log is not None:
            self._log.close()
            self._log = None


def ensure_port_free(base_url: str, name: str) -> None:
    """RunFailed naming the port when something already listens there (e.g. a server left running)."""
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        if probe.connect_ex((parts.hostname, parts.port)) == 0:
            raise RunFailed(f"cannot start {name}: something already listens on {parts.hostname}:{parts.port}; "
                            "stop it, set generate.port to a free port, or use it with --endpoint "
                            f"{base_url}")


def _die_with_parent() -> None:
    """In the server's process (Linux): SIGTERM it if the launcher dies, even by SIGKILL."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
