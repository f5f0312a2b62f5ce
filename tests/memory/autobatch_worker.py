"""A torchrun harness for AutoBatch's agreement alone: each rank starts AutoBatch with its own
planned micro-batch (`--planned-by-rank`) over one run directory (which may hold OOM records of an
earlier attempt) and writes what it agreed on to --out. The real trainer's recovery by restart is
tested end to end in tests/train/test_torchrun.py."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash.train.rank import autobatch  # noqa: E402
from dflash.train.rank.parallel import init_process_group  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--planned-by-rank", required=True, help="each rank's planned micro-batch, e.g. 4,2")
    args = parser.parse_args()

    init_process_group("gloo")
    rank = torch.distributed.get_rank()
    planned = int(args.planned_by_rank.split(",")[rank])
    lines: list[str] = []
    auto = autobatch.AutoBatch.start(planned, args.run_dir, rank, log=lines.append)
    record = {"rank": rank, "planned": planned, "agreed": auto.micro_batch, "log": lines}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
