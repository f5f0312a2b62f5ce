"""Memory probe: what an environment costs per GPU (or, without a GPU, in host RSS).

The launcher process never creates a CUDA context: `run_probe` starts one child per rank
(`python -m envcheck.memprobe --rank-child ...`, the torchrun environment contract: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Each child records its memory

* `init`       after CUDA init (or after the imports, on CPU),
* `collective` after a first all_reduce (NCCL on GPU, gloo on CPU),
* `model`      after building a small random model (plain torch, self-contained),
* `train_peak` the peak over a few AdamW training steps,

plus versions (torch, CUDA, NCCL, driver) and the environment switches that change memory.
Everything here is standard library at module level, so the probe runs with any candidate
environment's python, with or without torch (without torch only `init` is measured).

`compare_reports` judges a report against a baseline: `good`, `bad` (a stage grew beyond the
tolerance, or a rank ran out of memory) or `cannot_test` -- `git bisect run`'s 0 / 1 / 125.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from envcheck.host import nvidia_driver_version
from envcheck.packages import installed_versions
from launcher_core.processes import exit_without_finalization, free_port

PROBE_STAGES = ("init", "collective", "model", "train_peak")
MEMORY_SWITCHES = ("CUDA_MODULE_LOADING", "NCCL_CUMEM_ENABLE", "CUBLAS_WORKSPACE_CONFIG",
                   "PYTORCH_CUDA_ALLOC_CONF")
REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
Verdict = Literal["good", "bad", "cannot_test"]


@dataclass
class ProbeOptions:
    """What to measure and how (the CLI's flags)."""

    imports: list[str] = field(default_factory=list)   # modules imported before `init`
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nproc: int = 0                                       # 0: one rank per visible GPU, 1 on CPU
    steps: int = 3
    hidden: int = 1024
    layers: int = 8
    batch: int = 64
    timeout_s: float = 600.0
    python: str = sys.executable


@dataclass
class RankMemory:
    """One rank's measurements in MiB (device memory in use on GPU, process RSS on CPU)."""

    rank: int
    device: str
    stages: dict[str, Optional[float]]
    oom: bool = False
    torch_peak_reserved_mib: Optional[float] = None
    error: str = ""


@dataclass
class ProbeReport:
    kind: str                                            # "cuda" (device memory) or "cpu" (RSS)
    ranks: list[RankMemory]
    versions: dict[str, Any]
    switches: dict[str, Optional[str]]
    imports: list[str]
    packages: dict[str, str]
    seconds: float = 0.0

    def headline_mib(self) -> Optional[float]:
        """The largest figure of any rank at any stage: the number a bisect reports deltas of."""
        figures = [value for rank in self.ranks for value in rank.stages.values() if value is not None]
        return max(figures) if figures else None

    def to_json(self) -> dict[str, Any]:
        document = dataclasses.asdict(self)
        document["headline_mib"] = self.headline_mib()
        return document


@dataclass
class Comparison:
    verdict: Verdict
    tolerance_mib: float
    worst_delta_mib: Optional[float] = None
    worst_where: str = ""
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- parent side


def report_from_json(document: dict[str, Any]) -> ProbeReport:
    """A saved probe report (JSON) -> ProbeReport; KeyError/TypeError on a malformed one."""
    ranks = [RankMemory(**rank) for rank in document["ranks"]]
    fields = {name: document[name] for name in ("kind", "versions", "switches", "imports", "packages")}
    return ProbeReport(ranks=ranks, seconds=document.get("seconds", 0.0), **fields)


def load_report(path: str | os.PathLike) -> ProbeReport:
    from launcher_core.errors import InputError
    from launcher_core.fileio import read_json

    try:
        return report_from_json(read_json(path))
    except (KeyError, TypeError) as error:
        raise InputError(f"{path}: not a probe report ({error}); make one with `launcher.py probe --out FILE`") from None


def visible_gpu_count() -> int:
    """GPUs this process could use, counted without a CUDA context or any library."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([item for item in visible.split(",") if item.strip() and item.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return len(list(gpus.iterdir()))
    return _nvml_gpu_count()


def _nvml_gpu_count() -> int:
    """GPUs NVML sees (no CUDA context); 0 without nvidia-ml-py or without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # not installed, or NVMLError_LibraryNotFound / DriverNotLoaded
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def default_world_size(options: ProbeOptions) -> int:
    if options.nproc > 0:
        return options.nproc
    if options.device == "cpu":
        return 1
    return max(1, visible_gpu_count())


def rank_command(options: ProbeOptions, rank: int, world: int, port: int, out_dir: Path,
                 base_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of one measuring child: pure, so it is testable without starting anything."""
    argv = [options.python, "-m", "envcheck.memprobe", "--rank-child", "--out-dir", str(out_dir),
            "--device", options.device, "--steps", str(options.steps), "--hidden", str(options.hidden),
            "--layers", str(options.layers), "--batch", str(options.batch)]
    for module in options.imports:
        argv += ["--import", module]
    env = dict(base_env)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base_env.get("PYTHONPATH", "")]))
    return argv, env


def run_probe(options: ProbeOptions) -> ProbeReport:
    """Measure in child processes (one per rank) and gather their results."""
    from launcher_core.errors import CannotTest

    world = default_world_size(options)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="memprobe-") as tmp:
        out_dir = Path(tmp)
        port = free_port()
        children = [_start_rank(options, rank, world, port, out_dir) for rank in range(world)]
        failures = _wait_all(children, options.timeout_s)
        ranks = [_read_rank(out_dir, rank, failures.get(rank, "")) for rank in range(world)]
        meta = _read_json_or_none(out_dir / "meta.json")
    if meta is None or any(rank.error for rank in ranks):
        errors = "; ".join(f"rank {rank.rank}: {rank.error}" for rank in ranks if rank.error)
        raise CannotTest(f"the probe could not measure this environment: {errors or 'no result'}")
    return ProbeReport(ranks=ranks, seconds=round(time.monotonic() - started, 3), **meta)


def _start_rank(options: ProbeOptions, rank: int, world: int, port: int, out_dir: Path) -> subprocess.Popen:
    argv, env = rank_command(options, rank, world, port, out_dir, dict(os.environ))
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_all(children: list[subprocess.Popen], timeout_s: float) -> dict[int, str]:
    """Wait for every child; rank -> error text for those that failed or timed out."""
    deadline = time.monotonic() + timeout_s
    failures: dict[int, str] = {}
    for rank, child in enumerate(children):
        try:
            _, stderr = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
            child.communicate()
            failures[rank] = f"timed out after {timeout_s:.0f} s"
            continue
        if child.returncode != 0:
            tail = (stderr or "").strip().splitlines()[-3:]
            failures[rank] = f"exit code {child.returncode}: {' | '.join(tail)}"
    return failures


def _read_json_or_none(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _read_rank(out_dir: Path, rank: int, failure: str) -> RankMemory:
    document = _read_json_or_none(out_dir / f"rank-{rank}.json")
    if document is None:
        return RankMemory(rank=rank, device="?", stages={}, error=failure or "no result written")
    record = RankMemory(**document)
    if failure and not record.error and not record.oom:
        record.error = failure
    return record


def compare_reports(baseline: ProbeReport, current: ProbeReport, tolerance_mib: float) -> Comparison:
    """Judge `current` against `baseline`: bad if any rank's stage grew more than the tolerance."""
    result = Comparison(verdict="good", tolerance_mib=tolerance_mib)
    if baseline.kind != current.kind:
        result.verdict = "cannot_test"
        result.notes.append(f"baseline measured {baseline.kind} memory, this run {current.kind}: not comparable")
        return result
    deltas = _stage_deltas(baseline, current)
    if not deltas:
        result.verdict = "cannot_test"
        result.notes.append("no stage was measured in both the baseline and this run")
        return result
    where, worst = max(deltas.items(), key=lambda item: item[1])
    result.worst_delta_mib, result.worst_where = round(worst, 1), where
    if worst > tolerance_mib:
        result.verdict = "bad"
    result.notes += _oom_notes(current) + _switch_notes(baseline, current) + _version_notes(baseline, current)
    if any(rank.oom for rank in current.ranks):
        result.verdict = "bad"
    return result


def _stage_deltas(baseline: ProbeReport, current: ProbeReport) -> dict[str, float]:
    before = {rank.rank: rank for rank in baseline.ranks}
    deltas: dict[str, float] = {}
    for rank in current.ranks:
        old = before.get(rank.rank)
        for stage, value in rank.stages.items():
            old_value = old.stages.get(stage) if old else None
            if value is not None and old_value is not None:
                deltas[f"rank {rank.rank} {stage}"] = value - old_value
    return deltas


def _oom_notes(current: ProbeReport) -> list[str]:
    return [f"rank {rank.rank} ran out of memory during the training steps" for rank in current.ranks if rank.oom]


def _switch_notes(baseline: ProbeReport, current: ProbeReport) -> list[str]:
    return [f"{name}: {baseline.switches.get(name)!r} -> {current.switches.get(name)!r}"
            for name in MEMORY_SWITCHES if baseline.switches.get(name) != current.switches.get(name)]


def _version_notes(baseline: ProbeReport, current: ProbeReport) -> list[str]:
    keys = sorted(set(baseline.versions) | set(current.versions))
    return [f"{key}: {baseline.versions.get(key)} -> {current.versions.get(key)}"
            for key in keys if baseline.versions.get(key) != current.versions.get(key)]


def format_report(report: ProbeReport) -> str:
    """A readable table: one line per rank, one column per stage."""
    unit = "device MiB in use" if report.kind == "cuda" else "host RSS MiB"
    lines = [f"memory probe ({unit}; {len(report.ranks)} rank(s), {report.seconds:.1f} s)",
             f"{'rank':<6}{'device':<10}" + "".join(f"{stage:>12}" for stage in PROBE_STAGES) + "  oom"]
    for rank in report.ranks:
        cells = "".join(f"{_cell(rank.stages.get(stage)):>12}" for stage in PROBE_STAGES)
        lines.append(f"{rank.rank:<6}{rank.device:<10}{cells}  {'yes' if rank.oom else 'no'}")
    versions = ", ".join(f"{key} {value}" for key, value in report.versions.items() if value)
    switches = ", ".join(f"{key}={value}" for key, value in report.switches.items() if value is not None)
    lines.append(f"versions: {versions or '-'}")
    lines.append(f"switches: {switches or '(none set)'}")
    return "\n".join(lines)


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


# ----------------------------------------------------------------------------- child side


def host_rss_mib(field_name: str = "VmRSS") -> float:
    """This process's resident (VmRSS) or peak resident (VmHWM) memory, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024.0
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m envcheck.memprobe")
    parser.add_argument("--rank-child", action="store_true", required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--import", dest="imports", action="append", default=[])
    for name, default in (("steps", 3), ("hidden", 1024), ("layers", 8), ("batch", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    return parser


@dataclass
class _RankContext:
    rank: int
    world: int
    local_rank: int
    args: argparse.Namespace


def child_main(argv: list[str]) -> int:
    """One measuring rank. Writes rank-N.json (and meta.json on rank 0) into --out-dir."""
    args = _child_parser().parse_args(argv)
    context = _RankContext(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                           int(os.environ.get("LOCAL_RANK", 0)), args)
    try:
        record, meta = _measure(context)
    except Exception as error:  # anything unexpected: this environment cannot be tested
        record, meta = RankMemory(rank=context.rank, device="?", stages={}, error=f"{type(error).__name__}: {error}"), None
    _write_child_json(args.out_dir / f"rank-{context.rank}.json", dataclasses.asdict(record))
    if meta is not None and context.rank == 0:
        _write_child_json(args.out_dir / "meta.json", meta)
    return 0 if not record.error else 3


def _write_child_json(path: Path, document: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document), encoding="utf-8")
    os.replace(tmp, path)


def _measure(context: _RankContext) -> tuple[RankMemory, dict[str, Any]]:
    for module in context.args.imports:
        importlib.import_module(module)
    try:
        importlib.import_module("torch")
    except ImportError:                      # an environment without torch: the imports' RSS only
        record = RankMemory(rank=context.rank, device="cpu", stages=dict.fromkeys(PROBE_STAGES))
        record.stages["init"] = round(host_rss_mib(), 1)
        return record, _meta("cpu", {}, context.args.imports)
    return _measure_with_torch(context)


def _measure_with_torch(context: _RankContext) -> tuple[RankMemory, dict[str, Any]]:
    import torch

    use_cuda = context.args.device == "cuda" or (context.args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", context.local_rank) if use_cuda else torch.device("cpu")
    record = RankMemory(rank=context.rank, device=str(device), stages=dict.fromkeys(PROBE_STAGES))
    measure = _cuda_used_mib if use_cuda else (lambda _device: host_rss_mib())
    if use_cuda:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    record.stages["init"] = round(measure(device), 1)
    _first_collective(context, device, use_cuda)
    record.stages["collective"] = round(measure(device), 1)
    model = _build_model(context, device)
    record.stages["model"] = round(measure(device), 1)
    record.stages["train_peak"], record.oom = _train_steps(context, model, device, use_cuda, measure)
    if use_cuda:
        record.torch_peak_reserved_mib = round(torch.cuda.max_memory_reserved(device) / MIB, 1)
    _shutdown_collectives()
    return record, _meta("cuda" if use_cuda else "cpu", _torch_versions(use_cuda), context.args.imports)


def _cuda_used_mib(device: Any) -> float:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / MIB


def _first_collective(context: _RankContext, device: Any, use_cuda: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=context.rank,
                            world_size=context.world, device_id=device if use_cuda else None)
    tensor = torch.ones(1024, device=device)
    dist.all_reduce(tensor)
    dist.barrier()
    if use_cuda:
        torch.cuda.synchronize(device)
    assert float(tensor[0]) == context.world, "all_reduce returned a wrong sum"


def _build_model(context: _RankContext, device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    hidden = context.args.hidden
    blocks = []
    for _ in range(context.args.layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    model: torch.nn.Module = torch.nn.Sequential(*blocks).to(device)
    if context.world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def _train_steps(context: _RankContext, model: Any, device: Any, use_cuda: bool, measure: Any) -> tuple[float, bool]:
    """A few AdamW steps; (peak MiB over them, whether a step ran out of memory)."""
    import torch

    before = measure(device)
    reserved_before = torch.cuda.memory_reserved(device) if use_cuda else 0
    oom = _run_steps(context, model, device)
    if use_cuda:
        torch.cuda.synchronize(device)
        grown = (torch.cuda.max_memory_reserved(device) - reserved_before) / MIB
        return round(max(measure(device), before + grown), 1), oom
    return round(host_rss_mib("VmHWM"), 1), oom


def _run_steps(context: _RankContext, model: Any, device: Any) -> bool:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    try:
        for _ in range(context.args.steps):
            batch = torch.randn(context.args.batch, context.args.hidden, device=device)
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        return True
    return False


def _shutdown_collectives() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _torch_versions(use_cuda: bool) -> dict[str, Any]:
    import torch

    versions: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if use_cuda:
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        versions["gpu"] = torch.cuda.get_device_name()
    versions["driver"] = nvidia_driver_version()
    return versions


def _meta(kind: str, versions: dict[str, Any], imports: list[str]) -> dict[str, Any]:
    versions = {"python": ".".join(map(str, sys.version_info[:3])), **versions}
    return {"kind": kind, "versions": versions, "imports": list(imports),
            "switches": {name: os.environ.get(name) for name in MEMORY_SWITCHES},
            "packages": installed_versions()}


if __name__ == "__main__":
    exit_without_finalization(child_main(sys.argv[1:]))
