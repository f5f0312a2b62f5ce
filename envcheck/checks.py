"""The preflight checks: pure functions of (snapshot, profile, baseline, pins) -> findings.

Each check returns one or more `Finding`s with an id, a status (PASS, WARN, FAIL, SKIP), a
message that names the GPU or package concerned, and a hint that says what to do. Nothing here
touches the machine, so every check is tested on recorded snapshots.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

from envcheck.engine_releases import sglang_drafter_problems
from envcheck.engine_venvs import ENGINE_SPECS
from envcheck.packages import FLASHINFER_FAMILY, public_version, version_matches_pin
from envcheck.snapshot import EngineVenvFacts, GpuFacts, Snapshot
from envcheck.target_architecture import TargetArchitecture
from launcher_core.layer_attention import profile_draft_layers
from launcher_core.schema import Profile

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
STATUS_ORDER: tuple[Status, ...] = ("FAIL", "WARN", "PASS", "SKIP")
MIN_NVCC_FOR_SM12X = (12, 9)
MIN_OPEN_FILES = 8192
# The oldest torch CUDA build that compiles kernels for an arch (sm_120 and sm_100 came with 12.8).
MIN_CUDA_FOR_MAJOR = {12: "12.8", 10: "12.8", 9: "11.8", 8: "11.0", 7: "10.0"}
# Gated DeltaNet kernels transformers uses when installed: (what to install, distributions providing it).
LINEAR_ATTENTION_KERNELS = (("flash-linear-attention", ("fla-core", "flash-linear-attention")),
                            ("causal-conv1d", ("causal-conv1d",)))
BACKEND_ARCHES = {   # attention backend -> predicate on (major, minor), with the valid arches in words
    "fa3": (lambda cc: (8, 0) <= cc < (10, 0), "SM80-SM90"),
    "trtllm": (lambda cc: cc in ((10, 0), (10, 3)), "SM100/SM103"),
    "flashinfer": (lambda cc: cc >= (7, 5), "SM75 and newer"),
    "triton": (lambda cc: cc >= (7, 5), "SM75 and newer"),
    "torch_sdpa": (lambda cc: True, "any"),
}


@dataclass(frozen=True)
class Finding:
    id: str
    status: Status
    message: str
    hint: str = ""


@dataclass(frozen=True)
class RamNeed:
    """The host RAM the workload's ranks on this node need at start (the workload computes it:
    dflash.memory.host_ram), and what it is made of."""

    mib: float
    what: str


@dataclass(frozen=True)
class CheckInput:
    """Everything a check may look at. `pins` are the profile's requirements-file pins."""

    snapshot: Snapshot
    profile: Profile
    baseline: Optional[Snapshot] = None
    pins: dict[str, str] = field(default_factory=dict)
    pins_file: str = ""
    target: Optional[TargetArchitecture] = None   # the profile's target's config.json (None: builtin)
    ram_at_start: Optional[RamNeed] = None        # the ranks' host RAM at start (None: not known to the caller)


def major_minor(text: str) -> tuple[int, ...]:
    """`12.9.86` -> (12, 9); `12.0` -> (12, 0): CUDA, driver and compute-capability versions compare by these."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def gpu_label(gpu: GpuFacts) -> str:
    return f"GPU {gpu.index} ({gpu.name}, {gpu.uuid})"


def _gpu_skip(check_id: str, ctx: CheckInput) -> Optional[Finding]:
    """A SKIP when there are no GPUs to check (CPU profile, or no NVML on this machine)."""
    if ctx.profile.machine.device == "cpu" and not ctx.snapshot.gpus:
        return Finding(check_id, "SKIP", f"profile {ctx.profile.name} runs on CPU")
    if not ctx.snapshot.nvml.available:
        return Finding(check_id, "SKIP", f"no GPU facts: {ctx.snapshot.nvml.error or 'NVML unavailable'}")
    return None


def _cuda_torch_skip(check_id: str, ctx: CheckInput) -> Optional[Finding]:
    torch = ctx.snapshot.torch
    if not torch.installed or torch.error:
        return Finding(check_id, "SKIP", f"torch facts unavailable: {torch.error or 'torch not installed'}")
    if not torch.cuda:
        if ctx.profile.machine.device == "cuda":
            return Finding(check_id, "FAIL", f"torch {torch.version} is a CPU build; profile {ctx.profile.name} needs CUDA {ctx.profile.machine.cuda}",
                           f"pip install -r {ctx.profile.machine.requirements}")
        return Finding(check_id, "SKIP", f"torch {torch.version} is a CPU build")
    return None


def check_gpu_count_and_model(ctx: CheckInput) -> list[Finding]:
    skip = _gpu_skip("gpu.count", ctx)
    if skip:
        return [skip]
    machine, gpus = ctx.profile.machine, ctx.snapshot.gpus
    findings = []
    if len(gpus) != machine.gpu_count:
        findings.append(Finding("gpu.count", "FAIL", f"{len(gpus)} GPU(s) visible, profile {ctx.profile.name} expects {machine.gpu_count}",
                                "check CUDA_VISIBLE_DEVICES and `nvidia-smi`, or pick the profile that matches this node"))
    wrong = [g for g in gpus if machine.gpu_name and machine.gpu_name.lower() not in g.name.lower()
             or machine.compute_capability and g.compute_capability != machine.compute_capability]
    for gpu in wrong:
        findings.append(Finding("gpu.model", "FAIL", f"{gpu_label(gpu)} is SM{gpu.compute_capability}, profile expects "
                                f"{machine.gpu_name!r} SM{machine.compute_capability}", "use the profile for this GPU model"))
    return findings or [Finding("gpu.count", "PASS", f"{len(gpus)} x {gpus[0].name} (SM{gpus[0].compute_capability})" if gpus else "no GPUs expected")]


def arch_covered(compute_capability: str, arch_list: list[str]) -> bool:
    """Does torch carry kernels for this GPU? sm_XY cubins run on the same major with minor >= Y
    (arch-specific `sm_90a` only on its own arch); compute_XY PTX JIT-compiles for any newer GPU."""
    target = major_minor(compute_capability)
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", arch)
        if not match:
            continue
        built = (int(match[2]), int(match[3]))
        if match[1] == "compute" and built <= target:
            return True
        if match[1] == "sm" and built[0] == target[0] and (built == target if match[4] else built[1] <= target[1]):
            return True
    return False


def check_torch_arch(ctx: CheckInput) -> list[Finding]:
    skip = _gpu_skip("torch.arch", ctx) or _cuda_torch_skip("torch.arch", ctx)
    if skip:
        return [skip]
    torch, findings = ctx.snapshot.torch, []
    for capability in sorted({g.compute_capability for g in ctx.snapshot.gpus}):
        if arch_covered(capability, torch.arch_list):
            continue
        gpus = ", ".join(str(g.index) for g in ctx.snapshot.gpus if g.compute_capability == capability)
        sm = "sm_" + capability.replace(".", "")
        need = MIN_CUDA_FOR_MAJOR.get(major_minor(capability)[0], "a newer")
        findings.append(Finding("torch.arch", "FAIL",
            f"GPUs {gpus} (SM{capability}): torch {torch.version} (CUDA {torch.cuda}) has no kernels for {sm}; its arch list is {' '.join(torch.arch_list) or '(empty)'}",
            f"install a torch built with CUDA >= {need}, e.g. the profile's pins: pip install -r {ctx.profile.machine.requirements}"))
    return findings or [Finding("torch.arch", "PASS", f"torch {torch.version} covers every GPU's arch ({' '.join(torch.arch_list)})")]


def check_torch_cuda(ctx: CheckInput) -> list[Finding]:
    """torch's CUDA build is the one the profile's pins name (a cu130 torch satisfies `torch==2.9.1` too)."""
    wanted = ctx.profile.machine.cuda
    skip = _cuda_torch_skip("torch.cuda", ctx)
    if skip or not wanted:
        return [skip or Finding("torch.cuda", "SKIP", f"profile {ctx.profile.name} names no CUDA version")]
    torch = ctx.snapshot.torch
    if major_minor(torch.cuda) != major_minor(wanted):
        return [Finding("torch.cuda", "FAIL", f"torch {torch.version} is built for CUDA {torch.cuda}, profile {ctx.profile.name} pins CUDA {wanted}",
                        f"pip install -r {ctx.profile.machine.requirements} (the CUDA {wanted} build), or use the profile for CUDA {torch.cuda}")]
    return [Finding("torch.cuda", "PASS", f"torch {torch.version} built for CUDA {torch.cuda}, as the profile pins")]


def check_driver_cuda(ctx: CheckInput) -> list[Finding]:
    skip = _gpu_skip("driver.cuda", ctx) or _cuda_torch_skip("driver.cuda", ctx)
    if skip:
        return [skip]
    driver, torch_cuda = ctx.snapshot.nvml.cuda_driver_version, ctx.snapshot.torch.cuda
    if major_minor(driver) < major_minor(torch_cuda):
        return [Finding("driver.cuda", "FAIL", f"driver {ctx.snapshot.nvml.driver_version} supports CUDA {driver}, torch needs CUDA {torch_cuda}",
                        f"upgrade the NVIDIA driver to one that supports CUDA {torch_cuda}, or install torch for CUDA <= {driver}")]
    return [Finding("driver.cuda", "PASS", f"driver {ctx.snapshot.nvml.driver_version} (CUDA {driver}) >= torch's CUDA {torch_cuda}")]


def check_toolkit(ctx: CheckInput) -> list[Finding]:
    skip = _cuda_torch_skip("toolkit.nvcc", ctx)
    if skip:
        return [skip]
    kit, torch_cuda = ctx.snapshot.toolkit, ctx.snapshot.torch.cuda
    if not kit.nvcc_version:
        return [Finding("toolkit.nvcc", "WARN", f"no nvcc found (CUDA_HOME={kit.cuda_home or 'unset'}); JIT builds (FlashInfer, extensions) will fail",
                        f"install the CUDA {torch_cuda} toolkit and set CUDA_HOME to it")]
    findings = [f for f in (_nvcc_vs_torch(kit, torch_cuda), _headers_vs_nvcc(kit), _nvcc_for_sm12x(ctx), _jit_files(kit)) if f]
    return findings or [Finding("toolkit.nvcc", "PASS", f"nvcc {kit.nvcc_version} and headers {kit.cudart_version} at {kit.cuda_home} ({kit.source}) match torch's CUDA {torch_cuda}")]


def _nvcc_vs_torch(kit, torch_cuda: str) -> Optional[Finding]:
    if major_minor(kit.nvcc_version) == major_minor(torch_cuda):
        return None
    return Finding("toolkit.nvcc", "FAIL", f"nvcc {kit.nvcc_version} at {kit.nvcc_path} (from {kit.source}) but torch is built with CUDA {torch_cuda}",
                   f"set CUDA_HOME to a CUDA {torch_cuda} toolkit (e.g. /usr/local/cuda-{torch_cuda}), or install torch built for CUDA {kit.nvcc_version}")


def _headers_vs_nvcc(kit) -> Optional[Finding]:
    if not kit.cudart_version or major_minor(kit.cudart_version) == major_minor(kit.nvcc_version):
        return None
    return Finding("toolkit.headers", "FAIL", f"CUDA headers in {kit.cuda_home} say CUDART_VERSION {kit.cudart_version}, nvcc is {kit.nvcc_version}",
                   "headers and nvcc come from different toolkits: point CUDA_HOME at one complete toolkit")


def _nvcc_for_sm12x(ctx: CheckInput) -> Optional[Finding]:
    sm12x = [g for g in ctx.snapshot.gpus if major_minor(g.compute_capability)[0] == 12]
    nvcc = ctx.snapshot.toolkit.nvcc_version
    if not sm12x or major_minor(nvcc) >= MIN_NVCC_FOR_SM12X or "flashinfer-jit-cache" in ctx.snapshot.packages:
        return None   # with flashinfer-jit-cache the kernels come precompiled: no JIT, no nvcc
    return Finding("toolkit.sm12x", "FAIL", f"nvcc {nvcc} cannot JIT FlashInfer kernels for SM{sm12x[0].compute_capability} (GPUs {', '.join(str(g.index) for g in sm12x)}); it needs nvcc >= 12.9",
                   "install flashinfer-jit-cache of the flashinfer version (precompiled kernels), or a CUDA toolkit >= 12.9 with torch of the same CUDA")


def _jit_files(kit) -> Optional[Finding]:
    missing = kit.headers_missing + kit.libraries_missing
    if not missing:
        return None
    return Finding("toolkit.files", "FAIL", f"{kit.cuda_home} lacks what JIT builds need: {', '.join(missing)}",
                   "install the full CUDA toolkit (headers and runtime libraries), not only nvcc")


def check_flashinfer_family(ctx: CheckInput) -> list[Finding]:
    installed = {name: ctx.snapshot.packages[name] for name in FLASHINFER_FAMILY if name in ctx.snapshot.packages}
    if not installed:
        return [Finding("packages.flashinfer", "SKIP", "flashinfer is not installed")]
    listing = ", ".join(f"{name}=={version}" for name, version in installed.items())
    if len({public_version(v) for v in installed.values()}) > 1:
        return [Finding("packages.flashinfer", "FAIL", f"flashinfer packages of different versions: {listing}",
                        f"install all three at one version: pip install -r {ctx.profile.machine.requirements}")]
    missing = [name for name in FLASHINFER_FAMILY if name not in installed]
    if missing:
        return [Finding("packages.flashinfer", "WARN", f"{listing} installed without {', '.join(missing)}",
                        "without the cubin/jit-cache companions FlashInfer JIT-compiles kernels at startup (needs nvcc)")]
    return [Finding("packages.flashinfer", "PASS", listing)]


def pin_differences(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """'name: installed X, pinned Y' for every pin the environment does not satisfy."""
    differences = []
    for name, pinned in sorted(pins.items()):
        have = installed.get(name)
        if have is None:
            differences.append(f"{name}: not installed, pinned {pinned}")
        elif not version_matches_pin(have, pinned):
            differences.append(f"{name}: installed {have}, pinned {pinned}")
    return differences


def check_pins(ctx: CheckInput) -> list[Finding]:
    if not ctx.pins:
        return [Finding("packages.pins", "SKIP", f"no pins read from {ctx.pins_file or ctx.profile.machine.requirements}")]
    differences = pin_differences(ctx.pins, ctx.snapshot.packages)
    if differences:
        return [Finding("packages.pins", "FAIL", f"{len(differences)} package(s) differ from {ctx.pins_file}: " + "; ".join(differences),
                        f"pip install -r {ctx.pins_file} (or update the pins deliberately and save a new baseline)")]
    return [Finding("packages.pins", "PASS", f"all {len(ctx.pins)} pins of {ctx.pins_file} installed")]


def check_linear_attention_kernels(ctx: CheckInput) -> list[Finding]:
    """A GPU profile whose target has linear-attention (Gated DeltaNet) layers needs their kernels:
    without them transformers runs those layers (48 of Qwen3.6-27B's 64) through a PyTorch loop."""
    target = ctx.target
    if ctx.profile.machine.device != "cuda":
        return [Finding("packages.linear_attention", "SKIP", f"profile {ctx.profile.name} runs on CPU (PyTorch path)")]
    if target is None or target.error:
        return [Finding("packages.linear_attention", "SKIP", target.error if target else "builtin target")]
    if not target.linear_attention_layers:
        return [Finding("packages.linear_attention", "PASS", f"target {target.path} has no linear-attention layers")]
    missing = [name for name, dists in LINEAR_ATTENTION_KERNELS if not any(d in ctx.snapshot.packages for d in dists)]
    layers = f"{len(target.linear_attention_layers)} of its {target.num_layers} layers"
    if not missing:
        return [Finding("packages.linear_attention", "PASS", f"target {target.path}: {layers} are linear attention; "
                        f"their kernels are installed")]
    return [Finding("packages.linear_attention", "FAIL",
                    f"target {target.path} ({target.model_type}): {layers} are linear attention (Gated DeltaNet), but "
                    f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: transformers runs "
                    f"those layers through its PyTorch reference loop, far slower", _kernel_install_hint(ctx, missing))]


def _kernel_install_hint(ctx: CheckInput, missing: list[str]) -> str:
    pinned = {name: ctx.pins.get(name) for name in ("flash-linear-attention", "fla-core", "causal-conv1d")}
    spec = lambda name: f"{name}=={pinned[name]}" if pinned.get(name) else name   # noqa: E731
    steps = []
    if "flash-linear-attention" in missing:
        steps.append(f"pip install {spec('flash-linear-attention')} {spec('fla-core')}")
    if "causal-conv1d" in missing:
        steps.append(f"MAX_JOBS=<see host.max_jobs> pip install --no-build-isolation {spec('causal-conv1d')} "
                     f"(source only: it compiles against the installed torch)")
    return "; then ".join(steps) + f" -- the pins of {ctx.pins_file or ctx.profile.machine.requirements}"


def check_sglang_serves_the_drafter(ctx: CheckInput) -> list[Finding]:
    """A profile served by SGLang: the SGLang that would serve (the venv of `launcher.py engine setup sglang`
    when the snapshot records it built from the current pins, else this environment's, installed or pinned)
    has DFLASH and runs the profile's draft layers with the attention they are trained with
    (envcheck/engine_releases.py), on a driver that runs its torch's CUDA."""
    evals = ctx.profile.eval
    if "sglang" not in (evals.engine, evals.serve_engine):
        return [Finding("engine.sglang", "SKIP", f"profile {ctx.profile.name} does not serve the drafter with SGLang")]
    if evals.engine_python:
        return [Finding("engine.sglang", "SKIP", f"served from eval.engine_python {evals.engine_python}: `eval --engine "
                        "sglang` checks that environment's SGLang before it starts")]
    venv = _current_engine_venv(ctx.snapshot, "sglang")
    version, where = _serving_sglang(ctx, venv)
    if not version:
        return [Finding("engine.sglang", "WARN", f"no SGLang to serve profile {ctx.profile.name}'s drafter: none installed, "
                        f"none pinned in {ctx.pins_file or '-'}, no engine venv built", _sglang_setup_hint(ctx.snapshot))]
    problems = sglang_drafter_problems(version, ctx.profile.drafter) + (_driver_problems(ctx.snapshot, "sglang") if venv else [])
    if problems:
        return [Finding("engine.sglang", "WARN", f"sglang {version} ({where}) would not serve profile "
                        f"{ctx.profile.name}'s drafter as trained: {'; '.join(problems)}",
                        _sglang_setup_hint(ctx.snapshot) if venv is None else
                        f"run the audit on a node whose driver runs CUDA {ENGINE_SPECS['sglang'].cuda} or later")]
    kinds = ", ".join(sorted(set(profile_draft_layers(ctx.profile.drafter).kinds())))
    return [Finding("engine.sglang", "PASS", f"sglang {version} ({where}) runs the drafter's {kinds} layers as trained")]


def _current_engine_venv(snapshot: Snapshot, engine: str) -> Optional[EngineVenvFacts]:
    """The engine's venv built from the current pins, if the snapshot records one."""
    return next((venv for venv in snapshot.engine_venvs or [] if venv.engine == engine and venv.current), None)


def _serving_sglang(ctx: CheckInput, venv: Optional[EngineVenvFacts]) -> tuple[str, str]:
    """(version, where it comes from) of the SGLang `eval --engine sglang` would start; ("", "") if none."""
    if venv is not None:
        return venv.packages.get("sglang", ""), f"engine venv {Path(venv.path).name}, `launcher.py engine setup sglang`"
    if ctx.snapshot.packages.get("sglang"):
        return ctx.snapshot.packages["sglang"], "installed"
    if ctx.pins.get("sglang"):
        return ctx.pins["sglang"], f"pinned in {ctx.pins_file}"
    return "", ""


def _driver_problems(snapshot: Snapshot, engine: str) -> list[str]:
    """The engine venv's torch needs a driver that runs its CUDA ([] when it does, or NVML says nothing)."""
    wanted, driver = ENGINE_SPECS[engine].cuda, snapshot.nvml.cuda_driver_version
    if not wanted or not snapshot.nvml.available or not driver or major_minor(driver) >= major_minor(wanted):
        return []
    return [f"its torch is built for CUDA {wanted} and the driver ({snapshot.nvml.driver_version}) runs CUDA {driver}"]


def _sglang_setup_hint(snapshot: Snapshot) -> str:
    """What to do where no engine venv of the current pins is recorded (and why, when the snapshot says)."""
    spec = ENGINE_SPECS["sglang"]
    why = ("this snapshot does not record engine venvs (taken by an older launcher: take it again); " if snapshot.engine_venvs is None
           else "the sglang venv built before is from older pins; " if any(v.engine == "sglang" for v in snapshot.engine_venvs)
           else "")
    return (f"{why}run `launcher.py engine setup sglang` (SGLang's own venv, from {spec.requirements}, torch for CUDA "
            f"{spec.cuda}): `eval --engine sglang` and the pipeline then serve from it; or set eval.engine_python to such "
            "an environment")


def check_attention_backend(ctx: CheckInput) -> list[Finding]:
    backend = ctx.profile.audit.attention_backend
    capabilities = [(gpu_label(g), g.compute_capability) for g in ctx.snapshot.gpus]
    if not capabilities and ctx.profile.machine.device == "cuda" and ctx.profile.machine.compute_capability:
        capabilities = [(f"profile {ctx.profile.name}", ctx.profile.machine.compute_capability)]
    if not capabilities:
        return [Finding("attention.backend", "SKIP", f"no GPU to run attention backend {backend!r} on")]
    runs_on, valid = BACKEND_ARCHES[backend]
    bad = [(label, cc) for label, cc in capabilities if not runs_on(major_minor(cc))]
    if bad:
        usable = ", ".join(name for name, (pred, _) in BACKEND_ARCHES.items() if pred(major_minor(bad[0][1])))
        return [Finding("attention.backend", "FAIL", f"attention backend {backend!r} runs on {valid}, not on SM{bad[0][1]} ({', '.join(name for name, _ in bad)})",
                        f"set [audit] attention_backend in the profile to one of: {usable}")]
    return [Finding("attention.backend", "PASS", f"{backend!r} runs on SM{capabilities[0][1]}")]


def check_free_memory(ctx: CheckInput) -> list[Finding]:
    skip = _gpu_skip("gpu.free_memory", ctx)
    if skip:
        return [skip]
    need_mib = int(ctx.profile.audit.min_free_gib_per_gpu * 1024)
    short = [g for g in ctx.snapshot.gpus if g.memory_free_mib < need_mib]
    findings = [Finding("gpu.free_memory", "FAIL", f"{gpu_label(g)}: {g.memory_free_mib} MiB free, profile needs {need_mib} MiB",
                        "free the GPU (see gpu.processes) or lower [audit] min_free_gib_per_gpu") for g in short]
    least = min(ctx.snapshot.gpus, key=lambda g: g.memory_free_mib, default=None)
    return findings or [Finding("gpu.free_memory", "PASS", f"least free: GPU {least.index} {least.memory_free_mib} MiB >= {need_mib} MiB" if least else "no GPUs")]


def check_foreign_processes(ctx: CheckInput) -> list[Finding]:
    skip = _gpu_skip("gpu.processes", ctx)
    if skip:
        return [skip]
    findings = []
    for gpu in ctx.snapshot.gpus:
        for proc in gpu.processes:
            used = f"{proc.used_mib} MiB" if proc.used_mib is not None else "unknown MiB"
            findings.append(Finding("gpu.processes", "FAIL", f"GPU {gpu.index}: process {proc.pid} ({proc.name}) holds {used}",
                                    f"stop it (kill {proc.pid}) if it is stale, or use another GPU"))
    return findings or [Finding("gpu.processes", "PASS", "no processes hold GPU memory")]


def check_gpu_health(ctx: CheckInput) -> list[Finding]:
    skip = _gpu_skip("gpu.health", ctx)
    if skip:
        return [skip]
    findings = [Finding("gpu.health", "FAIL", f"{gpu_label(g)}: {problem}",
                        "drain the node and reset the GPU (nvidia-smi -r) or have it serviced")
                for g in ctx.snapshot.gpus for problem in _health_problems(g)]
    return findings or [Finding("gpu.health", "PASS", "no ECC errors, pending page retirements or row remaps")]


def _health_problems(gpu: GpuFacts) -> list[str]:
    problems = []
    if gpu.ecc_uncorrected_volatile:
        problems.append(f"{gpu.ecc_uncorrected_volatile} uncorrected ECC error(s) since boot")
    if gpu.retired_pages_pending:
        problems.append("retired pages pending (takes effect at the next reset)")
    if gpu.remapped_rows_pending:
        problems.append("row remapping pending (takes effect at the next reset)")
    if gpu.remapped_rows_failed:
        problems.append("row remapping failed")
    return problems


def check_cuda_probe(ctx: CheckInput) -> list[Finding]:
    if not ctx.snapshot.cuda_probe_ran:
        return [Finding("gpu.kernel", "SKIP", "the CUDA probe did not run (--cuda-probe on a node with GPUs)")]
    bad = [g for g in ctx.snapshot.gpus if not g.kernel_ok]
    findings = [Finding("gpu.kernel", "FAIL", f"{gpu_label(g)}: a test kernel failed: {g.probe_error or 'wrong result'}",
                        f"install a torch whose arch list covers SM{g.compute_capability}, and check the driver") for g in bad]
    return findings or [Finding("gpu.kernel", "PASS", f"a kernel ran on every GPU; context cost {', '.join(f'GPU {g.index}: {g.context_mib} MiB' for g in ctx.snapshot.gpus)}")]


def check_baseline_memory(ctx: CheckInput) -> list[Finding]:
    if ctx.baseline is None:
        return [Finding("baseline.memory", "SKIP", "no baseline saved for this profile and host",
                        f"save one on a known-good state: launcher.py baseline save --profile {ctx.profile.name}")]
    skip = _gpu_skip("baseline.memory", ctx)
    if skip:
        return [skip]
    audit, findings = ctx.profile.audit, []
    unknown = [str(g.index) for g in ctx.snapshot.gpus if ctx.baseline.gpu_by_uuid(g.uuid) is None]
    if unknown:
        findings.append(Finding("baseline.memory", "WARN", f"GPUs {', '.join(unknown)} are not in the baseline (host {ctx.baseline.hostname}); their memory is not compared",
                                f"save a baseline on this node: launcher.py baseline save --profile {ctx.profile.name}"))
    for gpu in ctx.snapshot.gpus:
        base = ctx.baseline.gpu_by_uuid(gpu.uuid)
        if base is not None:
            findings.extend(_memory_regressions(gpu, base, audit.baseline_free_tolerance_mib, audit.baseline_context_tolerance_mib))
    return findings or [Finding("baseline.memory", "PASS", f"free memory and context cost within tolerance of the baseline from {ctx.baseline.created_at}")]


def _memory_regressions(gpu: GpuFacts, base: GpuFacts, free_tolerance: int, context_tolerance: int) -> list[Finding]:
    findings, hint = [], "find the change with `launcher.py baseline diff` (packages, driver) or `launcher.py bisect`"
    dropped = base.memory_free_mib - gpu.memory_free_mib
    if dropped > free_tolerance:
        findings.append(Finding("baseline.memory", "FAIL", f"GPU {gpu.index} ({gpu.uuid}): {dropped} MiB less free than the baseline "
                                f"({gpu.memory_free_mib} vs {base.memory_free_mib} MiB; tolerance {free_tolerance} MiB)", hint))
    if gpu.context_mib is not None and base.context_mib is not None and gpu.context_mib - base.context_mib > context_tolerance:
        findings.append(Finding("baseline.context", "FAIL", f"GPU {gpu.index} ({gpu.uuid}): CUDA context cost {gpu.context_mib} MiB, "
                                f"{gpu.context_mib - base.context_mib} MiB more than the baseline's {base.context_mib} MiB (tolerance {context_tolerance} MiB)", hint))
    return findings


def check_baseline_versions(ctx: CheckInput) -> list[Finding]:
    if ctx.baseline is None:
        return [Finding("baseline.versions", "SKIP", "no baseline saved for this profile and host")]
    changes = version_changes(ctx.baseline, ctx.snapshot)
    if changes:
        return [Finding("baseline.versions", "WARN", f"{len(changes)} change(s) since the baseline: " + "; ".join(changes),
                        "if intended, save a new baseline after a successful run: launcher.py baseline save")]
    return [Finding("baseline.versions", "PASS", "driver and packages as in the baseline")]


def version_changes(old: Snapshot, new: Snapshot) -> list[str]:
    """'driver: A -> B', 'torch: A -> B', 'pkg: added X', 'pkg: removed' between two snapshots."""
    changes = []
    if old.nvml.driver_version != new.nvml.driver_version:
        changes.append(f"driver: {old.nvml.driver_version or '-'} -> {new.nvml.driver_version or '-'}")
    for name in sorted(set(old.packages) | set(new.packages)):
        before, after = old.packages.get(name), new.packages.get(name)
        if before != after:
            changes.append(f"{name}: {before or 'absent'} -> {after or 'absent'}")
    return changes


def check_host(ctx: CheckInput) -> list[Finding]:
    host, audit = ctx.snapshot.host, ctx.profile.audit
    checks = [("host.shm", host.shm_total_mib, audit.min_shm_gib, "/dev/shm", "give the container more shared memory (docker --shm-size)"),
              ("host.ram", host.ram_total_mib, audit.min_ram_gib, "RAM (cgroup limit applied)", "use a node or container with more memory")]
    findings = [_minimum(*c) for c in checks]
    findings += [_minimum("host.disk", d.free_mib, audit.min_disk_gib, f"free disk at {d.path}", "free space or move paths.run_dir") for d in host.disks]
    return findings + _ram_at_start(host.ram_total_mib, ctx.ram_at_start)


def _ram_at_start(have_mib: int, need: Optional[RamNeed]) -> list[Finding]:
    """The node's RAM against what its ranks hold while they start (when the caller knows it)."""
    if need is None or have_mib <= 0:
        return []
    if have_mib < need.mib:
        return [Finding("host.ram_start", "FAIL", f"RAM (cgroup limit applied): {have_mib} MiB, the ranks need {need.mib:.0f} MiB at start ({need.what})",
                        "use a node or container with more memory, or fewer ranks (machine.nproc_per_node)")]
    return [Finding("host.ram_start", "PASS", f"RAM (cgroup limit applied): {have_mib} MiB >= {need.mib:.0f} MiB the ranks need at start ({need.what})")]


def _minimum(check_id: str, have_mib: int, need_gib: float, what: str, hint: str) -> Finding:
    need_mib = int(need_gib * 1024)
    if have_mib < need_mib:
        return Finding(check_id, "FAIL", f"{what}: {have_mib} MiB, profile needs {need_mib} MiB", hint)
    return Finding(check_id, "PASS", f"{what}: {have_mib} MiB >= {need_mib} MiB")


def check_build_jobs(ctx: CheckInput) -> list[Finding]:
    from envcheck.host import recommended_max_jobs

    host = ctx.snapshot.host
    jobs = recommended_max_jobs(host.cpu_count, host.ram_available_mib, ctx.profile.audit.gib_per_nvcc_job)
    basis = f"{host.cpu_count} cores, {host.ram_available_mib} MiB RAM available, ~{ctx.profile.audit.gib_per_nvcc_job:g} GiB per nvcc job"
    current = ctx.snapshot.env.get("MAX_JOBS", "")
    if current.isdigit() and int(current) > jobs:
        return [Finding("host.max_jobs", "WARN", f"MAX_JOBS={current} but only {jobs} nvcc jobs fit ({basis})", f"export MAX_JOBS={jobs}")]
    if not current and host.cpu_count > jobs and ctx.profile.machine.device == "cuda":
        return [Finding("host.max_jobs", "WARN", f"MAX_JOBS unset: extension builds start {host.cpu_count} nvcc jobs, only {jobs} fit ({basis})", f"export MAX_JOBS={jobs}")]
    return [Finding("host.max_jobs", "PASS", f"recommended MAX_JOBS={jobs} ({basis}); MAX_JOBS={current or 'unset'}")]


def check_environment(ctx: CheckInput) -> list[Finding]:
    env, findings = ctx.snapshot.env, []
    if env.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        findings.append(Finding("env.module_loading", "WARN", "CUDA_MODULE_LOADING=EAGER loads every kernel into each context (hundreds of MiB per GPU)",
                                "unset CUDA_MODULE_LOADING (LAZY is the default)"))
    soft = ctx.snapshot.host.open_files_soft
    if 0 <= soft < MIN_OPEN_FILES:
        findings.append(Finding("host.open_files", "WARN", f"open-file limit {soft} < {MIN_OPEN_FILES} (data loaders and NCCL open many)", f"ulimit -n {MIN_OPEN_FILES * 8}"))
    return findings or [Finding("env", "PASS", "no environment setting known to hurt")]


def check_allocator(ctx: CheckInput) -> list[Finding]:
    """Whether the ranks' CUDA caching allocator will run with expandable segments, and what decided it
    (envcheck.allocator: the profile's memory.expandable_segments and the snapshot's allocator variables)."""
    from envcheck.allocator import allocator_setting

    if ctx.profile.machine.device != "cuda":
        return [Finding("env.allocator", "SKIP", f"profile {ctx.profile.name} runs on CPU: no CUDA caching allocator")]
    setting = allocator_setting(ctx.profile.memory.expandable_segments, ctx.snapshot.env)
    if setting.conflict:
        return [Finding("env.allocator", "FAIL", setting.conflict, "unset one of the two variables")]
    if setting.expandable or not ctx.profile.memory.expandable_segments:
        return [Finding("env.allocator", "PASS", setting.describe())]
    return [Finding("env.allocator", "WARN", setting.describe() + "; variable-length batches fragment fixed segments "
                    "and the plan's default reserve assumes expandable ones",
                    "drop expandable_segments:False (or the cudaMallocAsync backend) from your allocator variable, or "
                    "set memory.expandable_segments = false so the plan counts the larger reserve")]


ALL_CHECKS: tuple[Callable[[CheckInput], list[Finding]], ...] = (
    check_gpu_count_and_model, check_torch_arch, check_torch_cuda, check_driver_cuda, check_toolkit, check_flashinfer_family,
    check_pins, check_linear_attention_kernels, check_sglang_serves_the_drafter, check_attention_backend, check_free_memory, check_foreign_processes, check_gpu_health,
    check_cuda_probe, check_baseline_memory, check_baseline_versions, check_host, check_build_jobs, check_environment, check_allocator,
)


def run_checks(ctx: CheckInput) -> list[Finding]:
    return [finding for check in ALL_CHECKS for finding in check(ctx)]
