"""Merge peak memory vs dataset size: merging must stream, never load the datasets.

Builds two synthetic tokenized datasets (random token rows of ~2-4K tokens, the real on-disk
format), then runs `launcher.py merge` as a fresh process, in place (verified backup included)
and with content de-duplication, and reads the process's peak RSS (VmHWM; ru_maxrss would
include the parent's pages across exec). Prints peak RSS next to the data size; the target is a
dataset several times larger than the peak.

    .venv/bin/python benchmarks/bench_merge.py [--base-rows 120000 --add-rows 40000] [--dir DIR]
    .venv/bin/python benchmarks/bench_merge.py --smoke      (200 + 100 rows)
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
PEAK_RSS_SCRIPT = """
import re, runpy, sys
sys.argv = ["launcher.py", *sys.argv[1:]]
try:
    runpy.run_path("launcher.py", run_name="__main__")
finally:
    peak = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1]
    print(f"peak_rss_kib {peak}", file=sys.stderr)
"""


def build(directory: Path, rows: int, seed: int, prefix: str) -> Path:
    import numpy as np

    from dflash.data import dataset_io
    from dflash.data.tokenize import TokenizedSample, samples_to_batch
    from launcher_core.fileio import atomic_directory

    rng = np.random.default_rng(seed)
    with atomic_directory(directory) as staging:
        writer = dataset_io.ShardWriter(staging, dataset_io.dataset_schema(), 20000)
        for start in range(0, rows, 500):
            samples = []
            for index in range(start, min(rows, start + 500)):
                length = int(rng.integers(2000, 4000))
                samples.append(TokenizedSample(f"{prefix}{index}", f"{prefix}{index}",
                                               rng.integers(0, 151000, length, dtype=np.int32),
                                               np.ones(length, dtype=np.uint8), 0, "stop", 0, False))
            writer.write(samples_to_batch(samples))
        meta = {"tokenizer": {"fingerprint": "bench", "chat_template_fingerprint": "bench", "path": "synthetic"},
                "max_length": 8192, "settings": {}, "sources": [{"path": f"synthetic-{seed}"}],
                "rejects": {"total": 0, "by_reason": {}}, "history": []}
        dataset_io.finalize_dataset(staging, writer.close(), dataset_io.dataset_schema(), meta)
    return directory


def size_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def run_merge(args: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, "merge", "--no-progress", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"merge failed: {done.stderr}")
    peak = int(done.stderr.rsplit("peak_rss_kib", 1)[1].split()[0]) * 1024
    return seconds, peak, done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-rows", type=int, default=120_000)
    parser.add_argument("--add-rows", type=int, default=40_000)
    parser.add_argument("--dir", type=Path, help="scratch directory (default: a temporary one; needs ~4x the data)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 200 + 100 rows")
    args = parser.parse_args()
    if args.smoke:
        args.base_rows, args.add_rows = 200, 100
    scratch = Path(tempfile.mkdtemp(prefix="bench-merge-", dir=args.dir))
    try:
        base = build(scratch / "base", args.base_rows, 1, "b")
        add = build(scratch / "add", args.add_rows, 2, "a")
        data = size_of(base) + size_of(add)
        print(f"datasets: base {size_of(base) / 2**30:.2f} GiB ({args.base_rows:,} rows) + "
              f"added {size_of(add) / 2**30:.2f} GiB ({args.add_rows:,} rows) = {data / 2**30:.2f} GiB")
        runs = {"--output, dedup by content": ["--base", str(base), "--add", str(add), "--output",
                                               str(scratch / "merged"), "--dedup", "content"],
                "--in-place (verified backup), no dedup": ["--base", str(base), "--add", str(add), "--in-place",
                                                           "--backup-dir", str(scratch)]}
        for label, merge_args in runs.items():
            seconds, peak, _ = run_merge(merge_args)
            print(f"merge {label}: {seconds:6.1f} s, {data / 2**20 / seconds:6.0f} MiB/s, peak RSS "
                  f"{peak / 2**20:6.0f} MiB; the data is {data / peak:5.1f}x the peak")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
