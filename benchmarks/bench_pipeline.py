"""The README's first command, measured: `launcher.py pipeline --profile cpu-demo` end to end.

Runs the pipeline as a fresh process in a run directory (a new temporary one unless --run-dir;
an existing one resumes, so its finished stages are skipped), then prints each stage's wall
time, the total, and the eval's figures on each prompt set it measured (the out-of-template
held-out set, the in-distribution one where the profile's `eval.also_prompts` names it, and each
benchmark of `eval.benchmarks`): the DFlash drafter's mean tau and speedup over target-only
decoding next to prompt lookup's on the same prompts. Targets: the drafter's tau above prompt
lookup's on the out-of-template set; at most 25 minutes in total on 2 cores (docs/cpu-demo.md says
what buys what).

    .venv/bin/python benchmarks/bench_pipeline.py [--profile cpu-demo] [--run-dir DIR] [--keep]
    .venv/bin/python benchmarks/bench_pipeline.py --smoke     (a profile extending cpu-demo: 8 prompts x 8 tokens,
                                                               2 training steps on 2 gloo ranks, 1 eval prompt and 1 sample
                                                               of each benchmark x 4 tokens)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dflash.eval.report_schema import MethodFigures, read_report  # noqa: E402  (after the path insert)
from launcher_core.manifest import STAGES  # noqa: E402

TARGET_TOTAL_S = 25 * 60
# --smoke: every stage for real at its smallest (answers cut at 8 tokens are all "degenerate": allowed),
# generating with transformers serve (vLLM, cpu-demo's backend, needs its engine venv: tests/generate/test_gen_vllm.py)
SMOKE_PROFILE = """extends = "cpu-demo"
[generate]
backend = "transformers"
max_prompts = 8
max_tokens = 8
[data]
max_degenerate_share = 1.0
[train]
epochs = 1
max_steps = 2
global_batch = 4
max_micro_batch = 2
save_every_steps = 2
log_every_steps = 1
[eval]
num_prompts = 1
max_new_tokens = 4
also_prompts = []
bench_samples = 1
serve_engine = ""
"""


def smoke_profile(directory: Path) -> str:
    """The smoke profile's file (it extends the shipped cpu-demo)."""
    from launcher_core.fileio import write_text_atomic

    return str(write_text_atomic(directory / "cpu-demo-smoke.toml", SMOKE_PROFILE))


def run_pipeline(profile: str, run_dir: Path) -> tuple[int, float]:
    argv = [sys.executable, str(REPO_ROOT / "launcher.py"), "pipeline", "--profile", profile, "--run-dir", str(run_dir)]
    started = time.perf_counter()
    code = subprocess.run(argv, cwd=REPO_ROOT, check=False).returncode
    return code, time.perf_counter() - started


def stage_lines(manifest: dict) -> list[str]:
    lines = []
    for name in STAGES:
        entry = manifest["stages"].get(name, {})
        wall = entry.get("pipeline_wall_s")
        took = f"{wall:7.1f} s" if wall is not None else "    - (not run by this pipeline)"
        lines.append(f"  {name:<9} {entry.get('state', 'pending'):<8} {took}")
    return lines


def eval_lines(methods: dict[str, MethodFigures], num_prompts: int, label: str) -> list[str]:
    """The methods' figures on one prompt set (a report, or an entry of its `also_sets`)."""
    lines = [f"{num_prompts} prompts, {label}:",
             f"  {'method':<14} {'mean tau':>8} {'tokens/s':>9} {'speedup':>8}  lossless"]
    for name, method in methods.items():
        tau = f"{method.mean_tau or 0:8.3f}" if name != "target" else f"{'-':>8}"
        lossless = {None: "-", True: "yes", False: "NO"}[method.identical_to_target]
        lines.append(f"  {name:<14} {tau} {method.tokens_per_s:9.1f} {method.speedup or 0:7.2f}x  {lossless}")
    ours, lookup = methods["dflash"].mean_tau or 0, methods["prompt_lookup"].mean_tau or 0
    lines.append(f"  DFlash tau {ours:.3f} vs prompt lookup {lookup:.3f}: {'beats' if ours > lookup else 'DOES NOT beat'} it")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu-demo")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: every stage on a few prompts and tokens")
    args = parser.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-profile-") as profiles:
        profile = smoke_profile(Path(profiles)) if args.smoke else args.profile
        code, total_s = run_pipeline(profile, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").exists() else {"stages": {}}
    print(f"\npipeline --profile {'cpu-demo (smoke)' if args.smoke else args.profile}: exit {code}, {total_s:.0f} s in total "
          f"(the demo's budget: about {TARGET_TOTAL_S // 60} min on 2 cores), run dir {run_dir}")
    print("\n".join(stage_lines(manifest)))
    report_path = run_dir / "eval" / "report.json"
    if report_path.exists():
        report = read_report(report_path)
        print(f"eval: block size {report.block_size}, {report.context.max_new_tokens} new tokens, "
              f"temperature {report.temperature}")
        print("\n".join(eval_lines(report.methods, report.num_prompts, report.context.prompt_set or str(report_path))))
        for extra in report.also_sets:
            print("\n".join(eval_lines(extra.methods, extra.num_prompts, extra.label)))
    if args.run_dir is None and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
