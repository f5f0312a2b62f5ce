"""Every benchmark in benchmarks/ at its smallest setting (`--smoke`), run as a real process (forked
from a server that imported torch and transformers once: smoke_process.py, tested below): it exits 0
and prints its figure lines. A benchmark that drifts from the package's entry points
(load_profile, build_state, run_step, the CLI) breaks here instead of on the next full-size run.

The figures at this size are not judged (BENCHMARKS.md holds the full-size ones), except where the
benchmark's result is deterministic: the steps lost to OOM (emulated budgets), the bisect's probes
and groups, and the loss decay the drafter variants train with (the profile's, through the trainer).
Benchmarks that start servers, ranks or venvs are `slow`; the ones that start vLLM are `engine`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.benchmarks.smoke_process import run_smoke_process

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
NUMBER = r"[\d,]+(?:\.\d+)?"


def profile_gamma(name: str) -> str:
    from launcher_core.profile import load_profile

    return f"{load_profile(name).train.decay_gamma:.2f}"


@dataclass(frozen=True)
class Smoke:
    """One benchmark's smoke run: its arguments, the figure lines it must print (regexes, each
    searched line by line in stdout), its marks and its time limit."""

    script: str
    figures: tuple[str, ...]
    args: tuple[str, ...] = ("--smoke",)
    marks: tuple[pytest.MarkDecorator, ...] = ()
    timeout_s: float = 540
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.script.removesuffix(".py")


SLOW, ENGINE = pytest.mark.slow, pytest.mark.engine
CASES = [
    Smoke("bench_audit.py", (rf"^audit +median {NUMBER} s", rf"^collect_env +median {NUMBER} s",
                             rf"^ratio audit/collect_env = {NUMBER}")),
    Smoke("bench_tokenize.py", (rf"^corpus: 10 conversations, \d+ samples, {NUMBER} tokens",
                                rf"^\[CPU time\] floor tokenizer\(text\) only: +{NUMBER} tokens/s \| ours .*: +{NUMBER} tokens/s",
                                rf"^ratio \(CPU time\) {NUMBER}x of the floor")),
    Smoke("bench_merge.py", (r"^datasets: base .*\(200 rows\) \+ added .*\(100 rows\)",
                             rf"^merge --output, dedup by content: +{NUMBER} s, .* peak RSS +{NUMBER} MiB",
                             rf"^merge --in-place \(verified backup\), no dedup: +{NUMBER} s, .* peak RSS +{NUMBER} MiB")),
    Smoke("bench_integrity.py", (rf"^dataset {NUMBER} MiB in \d+ shards", rf"^sizes only: +{NUMBER} ms",
                                 rf"^sizes \+ sha256: +{NUMBER} s = {NUMBER} s per GiB")),
    Smoke("bench_train.py", (rf"^extraction truncated .*: +{NUMBER} ms", rf"^full forward .*: +{NUMBER} ms",
                             rf"^time ratio truncated/full: {NUMBER}",
                             rf"^training throughput \(1-layer drafter, block 8, 8 anchors\): {NUMBER} tokens/s")),
    Smoke("bench_oom_steps.py", (r"^rtx6000-x8 baseline, calibrated +3 \| +3 +0 \| +4 +1$",
                                 r"^rtx6000-x8 cu130 upgrade \(GPU 6 -200 MiB\), calibrated +2 \| +2 +0 \| +4 +1$",
                                 r"^restarts after OOM in total: ours 0, halving from the maximum 2 ")),
    Smoke("bench_draft_cache.py", (rf"^context +32: +{NUMBER} tokens/s, draft +{NUMBER} ms/step over \d+ steps",)),
    Smoke("bench_step_cost.py", (rf"^plain decoding, the eval loop .*: CPU {NUMBER} ms a token",
                                 rf"^plain decoding, transformers generate: CPU {NUMBER} ms a token",
                                 rf"^dflash k=\d+: \d+ steps, tau {NUMBER}; CPU {NUMBER} ms a step = draft {NUMBER} \+ verify "
                                 rf"{NUMBER} \+ rollback {NUMBER} \+ rest -?{NUMBER} = {NUMBER}x a plain step.*identical to plain",
                                 rf"^one forward alone .*: 1 token {NUMBER} ms, 8 tokens {NUMBER} ms")),
    Smoke("bench_eval_rollback.py", (rf"^target only +{NUMBER} s",
                                     rf"^wrong every 4 \(tau {NUMBER}\) +snapshot +{NUMBER} s .* reprefill +{NUMBER} s")),
    Smoke("bench_memory_trace.py", (rf"^  micro-batches' peak \(forward/backward\) +{NUMBER} +{NUMBER} +[-+]{NUMBER}%",
                                    rf"^largest model-vs-trace difference: peak {NUMBER}%")),
    Smoke("bench_block_mask.py", (rf"^ +32 full +create_block_mask \(before\) +{NUMBER} +{NUMBER} +{NUMBER} +reference$",
                                  rf"^ +32 full +block_mask \(after\) +{NUMBER} +{NUMBER} +{NUMBER} +equal$",
                                  r"^built mask's transient within the model, tables equal: yes$")),
    Smoke("bench_drafter_variants.py", (rf"^prompt lookup +everyday +tau {NUMBER}",
                                        rf"^cpu-demo +everyday +tau {NUMBER} .* step 1$",
                                        rf"^cpu-demo +everyday +tau {NUMBER} .* step 2, 2 steps in .*the trainer's loss "
                                        rf"decay gamma {re.escape(profile_gamma('cpu-demo'))}, ")),
    Smoke("bench_drafter_variants.py", (rf"^dflash2 +everyday +tau {NUMBER} .* step 2, 2 steps in ",
                                        rf"^dflash2/unary +everyday +tau {NUMBER} .* step 2, 2 steps in ",
                                        r"^dflash2: saved .*/dflash2/train/checkpoints/step-2$"),
          args=("--smoke", "--variants", "dflash2", "--save-dir", "{tmp}"), marks=(SLOW,), name="bench_drafter_variants-dflash2"),
    Smoke("bench_train_to_tau.py", (rf"^prompt lookup everyday +tau {NUMBER}$", rf"^prompt lookup humaneval +tau {NUMBER}$",
                                    *(rf"^point {recipe} +cpu +0\.0 s +step +0 +loss - +everyday {NUMBER} +humaneval {NUMBER} "
                                      rf"+val {NUMBER}$" for recipe in ("ce", "dpace", "distill")),
                                    *(rf"^point {recipe} +cpu +{NUMBER} s +step +[1-3] +loss {NUMBER} " for recipe in
                                      ("ce", "dpace", "distill")),
                                    r"^wrote .*/train_to_tau\.json and .*/train_to_tau\.png$"),
          args=("--smoke", "--out", "{tmp}")),
    Smoke("bench_fsdp_step.py", (rf"^  every_micro_batch/reshard +{NUMBER} +{NUMBER} +{NUMBER} / {NUMBER} +{NUMBER}$",
                                 rf"^  last_micro_batch/reshard +{NUMBER} +{NUMBER} +{NUMBER} / {NUMBER} +{NUMBER}$"),
          marks=(SLOW,)),
    Smoke("bench_async_save.py", (rf"^async: run {NUMBER} s; a step {NUMBER} s; the ranks stood still per save median -?{NUMBER} s",
                                  rf"^ sync: run {NUMBER} s; a step {NUMBER} s; the ranks stood still per save median -?{NUMBER} s",
                                  rf"^stall per save: async -?{NUMBER} s vs sync -?{NUMBER} s$"), marks=(SLOW,)),
    Smoke("bench_start_rss.py", (rf"^drafter: {NUMBER} MiB in float32; 2 gloo ranks$",
                                 rf"^planned per rank: {NUMBER} MiB \(.*\); the order before: {NUMBER} MiB$",
                                 rf"^before \(whole drafter on the host\): peak RSS per rank {NUMBER} / {NUMBER} MiB",
                                 rf"^after \(meta, sharded\): peak RSS per rank {NUMBER} / {NUMBER} MiB"), marks=(SLOW,)),
    Smoke("bench_test_suite.py", (rf"^The test command: exit 0, wall \*\*{NUMBER} s\*\*, CPU {NUMBER} s",
                                  rf"^\| tests/test_profile\.py \| gw\d \| \d+ \| {NUMBER} \| {NUMBER} \| ",
                                  r"^\| `tests/test_manifest\.py::test_\w+` \| ")),
    Smoke("bench_interpreters.py", (rf"^\S+ \(3\.11\.\d+\): rank imports CPU {NUMBER} s \(1\.00x\), 3 eager steps CPU "
                                    rf"{NUMBER} s ",), marks=(SLOW,)),
    Smoke("bench_rank_start.py", (rf"^forkserver launch 1: 2 ranks x 1 steps: wall {NUMBER} s, machine CPU {NUMBER} s$",
                                  rf"^forkserver median of 1: wall {NUMBER} s, machine CPU {NUMBER} s$"), marks=(SLOW,)),
    Smoke("bench_bisect.py", (r"^ +128 +8 +8\.00 +8$",                      # pure search: worst / mean / bound
                              r"^ +foo +metadata +8 +4 +4 +0 +0 +0 +True .* foo$",
                              rf"^ +2 +2 +2 +memhog +{NUMBER} ", rf"^ +uv: median {NUMBER} s", rf"^ pip: median {NUMBER} s"),
          marks=(SLOW,)),
    Smoke("bench_client.py", (rf"^completed 200 requests in {NUMBER} s, failed 0$",
                              rf"^client throughput: {NUMBER} requests/s"), marks=(SLOW,)),
    Smoke("bench_gen_backends.py", (rf"^transformers +1 prompts: setup +{NUMBER} s, generation +{NUMBER} s, .* tokens/s",),
          marks=(SLOW,), name="bench_gen_backends-transformers"),
    Smoke("bench_gen_backends.py", (rf"^vllm +1 prompts: setup +{NUMBER} s, generation +{NUMBER} s, .* tokens/s",),
          args=("--smoke", "--backends", "vllm"), marks=(SLOW, ENGINE), timeout_s=1500, name="bench_gen_backends-vllm"),
    Smoke("bench_served_cpu.py", (rf"^prompt_lookup +the launcher's env +decode +{NUMBER} s, \d+ tokens, +{NUMBER} tokens/s, "
                                  rf"tau {NUMBER}, server CPU +{NUMBER} s$",),
          marks=(SLOW, ENGINE), timeout_s=1500),
    Smoke("bench_parity_gate.py", (r"^in-process: \d+ steps, margins \[", rf"^chosen: near-tie margins {NUMBER} \(drafter\)",
                                   r"^  served as trained  final +false failures +\d+ of 50 ",
                                   r"^  negative control   dead for weak +detected +\d+ of 50 ")),
    Smoke("bench_parity_dtype.py", (r"^2 prompts; tau float32 " + NUMBER + ", bfloat16 " + NUMBER,
                                    r"^apart on \d+ prompts \(\d+ with other tokens\)",
                                    rf"^ +0\.15 / 0\.02 +\d+ of 2 +{NUMBER} +{NUMBER}")),
    Smoke("bench_parity_three_way.py", (r"^1 prompts$", r"^  inprocess/reference +apart on 0, before the in-process first "
                                        r"near-tie on 0"), marks=(SLOW,)),
    Smoke("bench_pipeline.py", (r"^pipeline --profile cpu-demo \(smoke\): exit 0, ",
                                *(rf"^  {stage} +done +{NUMBER} s" for stage in ("audit", "generate", "tokenize", "train", "eval")),
                                rf"^  DFlash tau {NUMBER} vs prompt lookup {NUMBER}"), marks=(SLOW,), timeout_s=1500),
]


def run_smoke(case: Smoke, scratch: Path) -> subprocess.CompletedProcess:
    """The benchmark as a process of its own, forked from a server that imported torch and transformers once
    (smoke_process.py: it sees the argv, environment, path and folder `python benchmarks/NAME.py` would);
    "{tmp}" in its arguments is the test's own scratch directory."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [arg.replace("{tmp}", str(scratch)) for arg in case.args]
    output = scratch / ".smoke"
    output.mkdir()
    return run_smoke_process(BENCHMARKS / case.script, args, env, REPO_ROOT, output, case.timeout_s)


def test_every_benchmark_has_a_smoke_run():
    scripts = {path.name for path in BENCHMARKS.glob("bench_*.py")}
    assert scripts == {case.script for case in CASES}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[*c.marks, pytest.mark.timeout(c.timeout_s + 60)], id=c.id)
                                  for c in CASES])
def test_benchmark_smoke_prints_its_figures(case: Smoke, request: pytest.FixtureRequest, tmp_path: Path):
    if ENGINE in case.marks:
        request.getfixturevalue("vllm_python")
    done = run_smoke(case, tmp_path)
    tail = f"\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{case.script} {' '.join(case.args)} exited {done.returncode}{tail}"
    missing = [figure for figure in case.figures if not re.search(figure, done.stdout, re.MULTILINE)]
    assert missing == [], f"{case.script} did not print {missing}{tail}"


SCRIPT_CASES = {
    "exit 3": ("import sys\nsys.exit(3)\n", 3, "", ""),
    "an exception": ("raise ValueError('bad figure')\n", 1, "", "ValueError: bad figure"),
    "the checkout not on its path": ("import launcher_core\n", 1, "", "No module named 'launcher_core'"),
    "atexit at its end": ("import atexit, sys\natexit.register(lambda: print('at exit'))\nprint(sys.argv[1:])\n",
                          0, "['--smoke']\nat exit", ""),
}


@pytest.mark.parametrize("name", list(SCRIPT_CASES))
def test_a_forked_smoke_is_the_script_run_as_a_fresh_python_would_run_it(name: str, tmp_path: Path):
    """The forkserver child behaves as `python script.py --smoke`: its exit code, its exception, no import
    from the test run's path (the checkout is not on a fresh interpreter's path unless the script puts it
    there, as every benchmark does), its atexit handlers."""
    code, returncode, stdout, stderr = SCRIPT_CASES[name]
    (tmp_path / "script.py").write_text(code, encoding="utf-8")
    (tmp_path / "out").mkdir()
    done = run_smoke_process(tmp_path / "script.py", ["--smoke"], dict(os.environ), tmp_path, tmp_path / "out", 60)
    assert (done.returncode, done.stdout.strip()) == (returncode, stdout), done.stderr
    assert stderr in done.stderr


def test_a_smoke_past_its_time_is_killed(tmp_path: Path):
    (tmp_path / "script.py").write_text("import time\ntime.sleep(60)\n", encoding="utf-8")
    (tmp_path / "out").mkdir()
    with pytest.raises(subprocess.TimeoutExpired):
        run_smoke_process(tmp_path / "script.py", [], dict(os.environ), tmp_path, tmp_path / "out", 2)


def threads_of(pid: str) -> str:
    """A script that prints the number of threads of the process `pid` (a Python expression) names."""
    return f"import os\nprint(len(os.listdir(f'/proc/{{{pid}}}/task')))\n"


def test_the_preloaded_server_has_one_thread_to_fork_from(tmp_path: Path):
    """The forkserver that runs the smokes (its preload, PRELOAD, done under the suite's environment) is one
    thread: a script forked from it counts its parent's threads (the server itself, not a second interpreter
    importing PRELOAD again). Control: the count sees a second thread where one is started (numpy's OpenBLAS
    pool, in a fresh interpreter without OMP_NUM_THREADS)."""
    (tmp_path / "script.py").write_text(threads_of("os.getppid()"), encoding="utf-8")
    (tmp_path / "out").mkdir()
    assert os.environ["OMP_NUM_THREADS"] == "1"
    done = run_smoke_process(tmp_path / "script.py", [], dict(os.environ), tmp_path, tmp_path / "out", 120)
    assert (done.returncode, done.stdout.strip()) == (0, "1"), done.stderr
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    control = subprocess.run([sys.executable, "-c", "import numpy\n" + threads_of("os.getpid()")], env=env,
                             capture_output=True, text=True, check=True)
    assert int(control.stdout) > 1
