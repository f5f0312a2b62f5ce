"""What the integrity check on read costs: sha256 of a dataset's shards, per GB.

A real tokenized dataset (random token rows, the columns `tokenize` writes) of about --mib MiB is
built in a temporary directory, then `dflash.data.dataset_io.verify_shards` runs on it: sizes only
(what every training rank does) and sizes + sha256 (inspect, merge, training rank 0). The files
are read once before timing, so the figure is hashing from the page cache: the CPU cost, the part
that does not depend on the disk. The best of --repeat runs is reported.

    .venv/bin/python benchmarks/bench_integrity.py [--mib 512] [--repeat 3]
    .venv/bin/python benchmarks/bench_integrity.py --smoke      (8 MiB, one run)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
ROW_TOKENS = 4096


def build(directory: Path, mib: int) -> int:
    """A dataset of about `mib` MiB (int32 ids + uint8 mask: 5 bytes per token); returns bytes."""
    import numpy as np

    from dflash.data import dataset_io
    from dflash.data.tokenize import TokenizedSample, samples_to_batch
    from launcher_core.fileio import atomic_directory

    rng = np.random.default_rng(0)
    rows = max(1, mib * (1 << 20) // (5 * ROW_TOKENS))
    with atomic_directory(directory) as staging:
        writer = dataset_io.ShardWriter(staging, dataset_io.dataset_schema(), 2000)
        for start in range(0, rows, 100):
            samples = [TokenizedSample(f"r{i}", f"r{i}", rng.integers(0, 150000, ROW_TOKENS, dtype=np.int32),
                                       np.ones(ROW_TOKENS, np.uint8), 0, "stop", 0, False)
                       for i in range(start, min(rows, start + 100))]
            writer.write(samples_to_batch(samples))
        meta = {"tokenizer": {}, "max_length": ROW_TOKENS, "settings": {}, "sources": [], "history": []}
        dataset_io.finalize_dataset(staging, writer.close(), dataset_io.dataset_schema(), meta)
    return sum(p.stat().st_size for p in directory.glob("*.arrow"))


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    from dflash.data import dataset_io

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 8 MiB, one run")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.repeat = 8, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        size = build(path, args.mib)
        meta = dataset_io.read_meta(path)
        dataset_io.verify_shards(path, meta, hashes=True)          # warm the page cache
        sizes = min(timed(lambda: dataset_io.verify_shards(path, meta, hashes=False)) for _ in range(args.repeat))
        hashed = min(timed(lambda: dataset_io.verify_shards(path, meta, hashes=True)) for _ in range(args.repeat))
    gib = size / (1 << 30)
    print(f"dataset {size / (1 << 20):.0f} MiB in {len(meta['shards'])} shards")
    print(f"sizes only:      {sizes * 1000:.2f} ms")
    print(f"sizes + sha256:  {hashed:.3f} s = {hashed / gib:.2f} s per GiB ({gib / hashed * 1024:.0f} MiB/s)")


if __name__ == "__main__":
    main()
