"""The FSDP2 step equals the one-process step: on 2 real gloo ranks (torchrun) with float32
compute, the trainer's sharded step over step 0's global batch (each rank 2 micro-batches of its
rows; gradients reduce-scattered every micro-batch, or held unsharded until the last) gives the
loss and the gathered gradients of the unsharded drafter over the same 4 rows in one process,
within float32 precision. Negative controls: the gradients averaged over the ranks (FSDP2's default
divide factor) and the gradients of one rank's rows alone (no reduction) are far outside the
tolerance, so the comparison can fail."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def one_process_step(profile, rows_of_rank: int | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsharded drafter over step 0's global rows in one process (or one rank's share of them)."""
    from dflash.drafter.decay import default_gamma
    from dflash.drafter.loss import decay_weights
    from dflash.train.rank.data import TrainData
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import assemble_state, build_drafter, dataset_path, load_rank_target, resolve_layer_ids
    from dflash.train.rank.step import accumulate_step, micro_weight_sum, step_stats

    env, device = WorkerEnv(0, 1, 0), torch.device("cpu")
    target = load_rank_target(profile, device)
    layers = resolve_layer_ids(profile, target.config.num_hidden_layers)
    drafter = build_drafter(profile, target, layers, target.config.num_hidden_layers)
    target.model.layers = target.model.layers[: max(layers) + 1]
    data = TrainData(dataset_path(profile), profile, env)
    decay = decay_weights(profile.drafter.block_size, default_gamma(profile.drafter.block_size, profile.train.decay_gamma))
    state = assemble_state(profile, env, device, target, drafter, data, layers, decay)
    epoch, rows = data.step_rows(0)
    weight = micro_weight_sum(state, data.collate(rows, epoch))
    if rows_of_rank is not None:
        rows = rows[rows_of_rank::2]
    sums, tokens = accumulate_step(state, rows, epoch, len(rows), weight)
    return step_stats(state, sums, tokens, 0.0).loss, {n: p.grad.clone() for n, p in drafter.named_parameters()}


def close(found: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    return found.keys() == reference.keys() and all(
        torch.allclose(found[name], reference[name], rtol=1e-4, atol=1e-6) for name in reference)


def test_the_fsdp2_step_on_2_ranks_is_the_one_process_step(tmp_path, tiny_qwen3_target, tiny_dataset):
    profile_path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "run",
                                 drafter={"num_layers": 2, "target_layer_ids": [1, 2]}, compute_dtype="float32")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(HERE.parents[1])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "torchrun-logs"),      # not a torchelastic_* folder in /tmp
                           str(HERE / "fsdp_step_worker.py"), "--profile", str(profile_path), "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = torch.load(tmp_path / "out" / "fsdp.pt")
    profile = load_profile(str(profile_path))
    loss, reference = one_process_step(profile)
    for sync in ("every_micro_batch", "last_micro_batch"):
        assert found[sync]["micro_batches"] == 2                       # 2 of the 4 rows on each rank, one at a time
        assert found[sync]["loss"] == pytest.approx(loss, rel=1e-5), sync
        assert close(found[sync]["grads"], reference), sync
    averaged = {name: grad / 2 for name, grad in found["every_micro_batch"]["grads"].items()}
    assert not close(averaged, reference)                              # averaging over the ranks: caught
    _, rank_0_alone = one_process_step(profile, rows_of_rank=0)
    assert not close(rank_0_alone, reference)                          # no reduction: caught
