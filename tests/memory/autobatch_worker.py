"""A torchrun harness for AutoBatch alone: a small self-contained training loop (plain torch) whose
exact parameters are known (`reference_run`), so agreement and OOM recovery can be held to the
unreduced run to 1e-5. It plans nothing itself: each rank's starting micro-batch is given
(`--planned-by-rank`); the real trainer's plan-at-launch path is tested in tests/train/test_plan_launch.py.
Each rank writes what it did to --out.

Data are a deterministic function of the global sample index; every step takes the next
global_batch samples and rank r trains on its contiguous share, split into micro-batches. Each
micro-batch's loss is divided by the GLOBAL weight of the step, so the parameters after a step do
not depend on the micro-batch size or the rank count (`reference_run` computes them in one process).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash.train import autobatch  # noqa: E402
from dflash.train.dist import global_weight, init_process_group  # noqa: E402

POSITIONS, FEATURES, CLASSES = 6, 8, 5


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features, labels and a loss weight per position (a varying number of positions count)."""
    generator = torch.Generator().manual_seed(1000 + index)
    features = torch.randn(POSITIONS, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (POSITIONS,), generator=generator)
    weights = (torch.arange(POSITIONS) < 2 + index % (POSITIONS - 1)).float()
    return features, labels, weights


def batch(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = [sample(i) for i in indices]
    return tuple(torch.stack([p[k] for p in parts]) for k in range(3))


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def weighted_loss_sum(model: torch.nn.Module, indices: list[int]) -> torch.Tensor:
    features, labels, weights = batch(indices)
    logits = model(features)
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1), reduction="none")
    return (losses * weights.reshape(-1)).sum()


def step_indices(step: int, global_batch: int) -> list[int]:
    return list(range(step * global_batch, (step + 1) * global_batch))


def flat_params(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def reference_run(steps: int, global_batch: int, micro_batch: int) -> list[float]:
    """One process, the whole global batch per step, split into micro-batches of `micro_batch`."""
    model = build_model()
    optimizer = build_optimizer(model)
    for step in range(steps):
        indices = step_indices(step, global_batch)
        total = float(batch(indices)[2].sum())
        for start in range(0, len(indices), micro_batch):
            (weighted_loss_sum(model, indices[start:start + micro_batch]) / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return flat_params(model)


def planned_micro_batch(args: argparse.Namespace, rank: int) -> int:
    """This rank's starting micro-batch: `--planned-by-rank 4,2` (one per rank), else --micro-batch."""
    if not args.planned_by_rank:
        return args.micro_batch
    return int(args.planned_by_rank.split(",")[rank])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--planned-by-rank", default="", help="each rank's planned micro-batch, e.g. 4,2")
    parser.add_argument("--state", default="")
    parser.add_argument("--grad-bucket-mib", type=float, default=autobatch.DEFAULT_GRAD_BUCKET_MIB,
                        help="the gradient sum's bucket (tiny values split the model into several buckets)")
    parser.add_argument("--crash-after-first-attempt", action="store_true",
                        help="attempt 0 exits(1) after its last step, so torchrun --max-restarts restarts the ranks")
    args = parser.parse_args()

    init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    planned = planned_micro_batch(args, rank)
    lines: list[str] = []
    auto = autobatch.AutoBatch.start(planned, args.state or None, rank, log=lines.append,
                                     grad_bucket_mib=args.grad_bucket_mib)
    record = {"rank": rank, "attempt": attempt, "planned": planned, "agreed": auto.micro_batch, "steps": []}
    model = build_model()
    optimizer = build_optimizer(model)
    share = args.global_batch // world

    for step in range(args.steps):
        mine = step_indices(step, args.global_batch)[rank * share:(rank + 1) * share]
        total = global_weight(float(batch(mine)[2].sum()))

        def accumulate(micro_batch: int) -> None:
            for start in range(0, share, micro_batch):
                if start > 0:                       # OOM after some gradients have accumulated
                    auto.inject("forward")
                (weighted_loss_sum(model, mine[start:start + micro_batch]) / total).backward()

        outcome = auto.run_step(step, accumulate, optimizer)
        record["steps"].append({"step": step, "micro_batch": outcome.micro_batch, "attempts": outcome.attempts})
    record.update(params=flat_params(model), log=lines, reductions=auto.reductions)
    write(args.out / f"rank{rank}-attempt{attempt}.json", record)
    if attempt == 0 and args.crash_after_first_attempt:
        sys.exit(1)
    torch.distributed.destroy_process_group()


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


if __name__ == "__main__":
    main()
