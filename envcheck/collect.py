"""Collecting this machine's snapshot. Collection never creates a CUDA context in this process:
GPU facts come from NVML, torch facts from a child process (cached, keyed by the installed
torch), and the optional CUDA probe runs in child processes too. The serving engines' own venvs
(`launcher.py engine setup`) are read from their dist-info folders, nothing imported."""
from __future__ import annotations

import os
import socket
import sys
import time
import typing
from pathlib import Path

from envcheck.snapshot import Snapshot


def collect_snapshot(disk_paths: typing.Sequence[Path] = (), *, cuda_probe: bool = False,
                     environ: typing.Mapping[str, str] | None = None) -> Snapshot:
    """This machine's facts. No CUDA context is created in this process."""
    from envcheck import engine_venvs, host, nvml_facts, packages, toolkit, torch_facts
    from launcher_core import redact

    environ = os.environ if environ is None else environ
    nvml, gpus = nvml_facts.collect()
    snapshot = Snapshot(
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), hostname=socket.gethostname(),
        python=".".join(map(str, sys.version_info[:3])),
        nvml=nvml, gpus=gpus, torch=torch_facts.collect(), toolkit=toolkit.collect(environ),
        packages=packages.installed_versions(), host=host.collect(disk_paths),
        env=redact.gpu_environment(environ), engine_venvs=engine_venvs.collect(),
    )
    if cuda_probe and gpus:
        from envcheck import cuda_probe as probe

        probe.apply(snapshot, probe.run_all(snapshot.gpus))
    return snapshot
