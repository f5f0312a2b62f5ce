"""The gradient sum (dflash.train.dist): bounded buckets, in place, and the weight broadcast that
replaced DistributedDataParallel; the bucket planner in process, the collectives on 2 real gloo
ranks (mp.spawn, each rank writing its result for the parent)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from dflash.train import dist

BUCKET = 1000                                   # bytes


def test_large_tensors_are_their_own_in_place_bucket_small_ones_are_packed_within_the_bound():
    sizes = [300, 10, 40, 5, 600, 3, 3, 250]    # float32 elements: 1200 B, 40 B, ... 2400 B, ..., 1000 B
    tensors = [torch.zeros(n) for n in sizes] + [torch.zeros(7, dtype=torch.float64)]
    buckets = dist.plan_buckets(tensors, BUCKET, torch.device("cpu"))
    assert sorted(id(t) for b in buckets for t in b.tensors) == sorted(id(t) for t in tensors)   # each once
    assert [b.in_place for b in buckets] == [True, True, True, False, False]
    assert [b.nbytes for b in buckets if not b.in_place] == [244, 56]          # packing goes on past large ones
    assert all(b.nbytes <= BUCKET for b in buckets if not b.in_place)
    assert len({t.dtype for t in buckets[-1].tensors}) == 1                     # a dtype change starts a bucket
    assert dist.staging_bytes(buckets, BUCKET) == 300 == min(BUCKET, 244 + 56)
    assert dist.staging_bytes(buckets, 200) == 244                             # never below the largest packed bucket


def test_a_large_tensor_that_cannot_be_reduced_in_place_is_packed_alone():
    transposed = torch.zeros(40, 30).t()                                        # 4800 B, not contiguous
    buckets = dist.plan_buckets([torch.zeros(5), transposed, torch.zeros(5)], BUCKET, torch.device("cpu"))
    assert [(len(b.tensors), b.in_place) for b in buckets] == [(1, False), (1, False), (1, False)]


def test_without_a_process_group_the_sum_is_the_identity_and_allocates_nothing():
    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    called = []
    prepared = dist.prepare_gradient_sum(model.parameters(), bucket_mib=1e-6, before_staging=lambda: called.append(1))
    assert prepared.buckets == [] and prepared.staging is None and called == [1]
    dist.sync_gradients(model.parameters())
    dist.broadcast_module(model)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


# --- 2 real gloo ranks ----------------------------------------------------------------------

def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(100 + rank)                     # every rank starts different: the broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 10))
    model[1].weight.requires_grad_(False)             # a frozen parameter has no gradient to sum
    return model


def _rank_grads(model: torch.nn.Module, rank: int) -> None:
    torch.manual_seed(rank)
    model(torch.randn(8, 64)).pow(2).sum().backward()


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as torch_dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _model(rank)
    dist.broadcast_module(model, bucket_mib=300 / 2**20)
    _rank_grads(model, rank)
    local = {name: p.grad.clone().tolist() for name, p in model.named_parameters() if p.grad is not None}
    prepared = dist.prepare_gradient_sum(model.parameters(), bucket_mib=300 / 2**20)
    grad_pointers = [p.grad.data_ptr() for p in model.parameters() if p.grad is not None]
    prepared.run()
    record = {"weights": [p.detach().reshape(-1).tolist() for p in model.parameters()], "local": local,
              "summed": {name: p.grad.tolist() for name, p in model.named_parameters() if p.grad is not None},
              "same_storage": grad_pointers == [p.grad.data_ptr() for p in model.parameters() if p.grad is not None],
              "buckets": [[b.in_place, b.nbytes] for b in prepared.buckets], "staging_bytes": prepared.staging_bytes}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    torch_dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_start_from_rank_0s_weights_and_sum_their_gradients_in_place_in_buckets(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["weights"] == r1["weights"]                                       # the broadcast
    assert r0["summed"] == r1["summed"] and "1.weight" not in r0["summed"]
    for name, summed in r0["summed"].items():
        expected = torch.tensor(r0["local"][name]) + torch.tensor(r1["local"][name])
        assert torch.allclose(torch.tensor(summed), expected, rtol=1e-6, atol=1e-6), name
    assert r0["same_storage"] and r1["same_storage"]                            # .grad summed in place
    assert [b[0] for b in r0["buckets"]] == [True, True, False]                 # 64x32, 32x10, [the 3 biases]
    assert r0["staging_bytes"] == sum(b[1] for b in r0["buckets"] if not b[0]) <= 300
