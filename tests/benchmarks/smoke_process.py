"""A benchmark's smoke run as a process of its own, forked from multiprocessing's forkserver after the
server has imported torch, numpy and transformers once (PRELOAD), rather than each run importing them
again in a new interpreter (some 3 CPU s a benchmark, 15 of them import torch).

The child sees what `python benchmarks/NAME.py ARGS` would: its argv, the environment given, the
working directory, `sys.path` of a fresh interpreter with that environment (the script's folder first;
none of the test run's entries, so a script that stops putting the checkout on its path fails here as
it would for a user; no module of the project is preloaded), stdin from /dev/null, stdout and stderr
in files; the script runs as `__main__` (runpy), its atexit handlers run at its end, and its exit code
(SystemExit's, 1 on an exception) is the process's. The server forks every run from itself (as
torchrun's forkserver forks the ranks: dflash.train.supervisor.agent), so its preload must leave it one thread: it
does under the suite's OMP_NUM_THREADS=1 (tests/conftest.py; test_benchmarks.py counts the server's
threads from a child)."""
from __future__ import annotations

import atexit
import functools
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
from pathlib import Path

PRELOAD = ["torch", "numpy", "transformers", "transformers.modeling_utils"]


def fresh_sys_path(env: dict[str, str]) -> list[str]:
    """`sys.path` of a new interpreter of this venv under `env`, without its first entry (the script's folder)."""
    return list(_probed_sys_path(tuple(sorted(env.items()))))


@functools.lru_cache(maxsize=None)
def _probed_sys_path(env: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """Asked of a new interpreter once per environment (every smoke of a run has the same)."""
    probe = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                           env=dict(env), capture_output=True, text=True, check=True, cwd="/")
    return tuple(json.loads(probe.stdout))


def run_script(script: str, args: list[str], env: dict[str, str], cwd: str, base_path: list[str],
               stdout: str, stderr: str) -> None:
    """In the child: become `python script args` and run it (SystemExit ends the process with its code)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [script, *args]
    sys.path[:] = [str(Path(script).parent), *base_path]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def run_smoke_process(script: Path, args: list[str], env: dict[str, str], cwd: Path, scratch: Path,
                      timeout_s: float) -> subprocess.CompletedProcess:
    """`python script args` as a forkserver child; its exit code and output, as subprocess.run gives them
    (TimeoutExpired after `timeout_s`, the child killed)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    out, err = scratch / "smoke.stdout", scratch / "smoke.stderr"
    child = context.Process(target=run_script, name=script.name,
                            args=(str(script), args, env, str(cwd), fresh_sys_path(env), str(out), str(err)))
    child.start()
    child.join(timeout_s)
    argv = [sys.executable, str(script), *args]
    if child.exitcode is None:
        child.kill()
        child.join()
        raise subprocess.TimeoutExpired(argv, timeout_s, output=_read(out), stderr=_read(err))
    return subprocess.CompletedProcess(argv, child.exitcode, _read(out), _read(err))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
