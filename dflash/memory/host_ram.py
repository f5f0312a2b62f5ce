"""The host RAM a node needs while its ranks start (every rank of the node at once): `launcher.py plan`
prints it, and `train` and the preflight hold it against the node's RAM.

A starting rank holds: the runtime (interpreter, torch, transformers, datasets, the trainer:
`RUNTIME_MIB`, measured on a CPU rank; on a GPU node also `CUDA_RUNTIME_MIB`, an estimate); the
target, on a GPU rank one tensor at a time on its way to the GPU (the largest), on a CPU rank its
weights up to the deepest tap (an upper bound there: memory-mapped pages are shared by the ranks);
the drafter's largest init unit twice in float32 while it is materialised
(dflash.train.rank.materialize) and, on a CPU rank, its float32 shards. `whole_*` is the order
before (drafter built whole on the host, target loaded whole), for comparison.
tests/train/test_start_rss.py holds a CPU rank below the figure. No torch import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from dflash.memory.attention_masks import MIB
from dflash.memory.checkpoint_costs import gib
from dflash.memory.peak_estimate import MASTER_BYTES

if TYPE_CHECKING:
    from dflash.memory.budget import Plan
    from dflash.memory.workload import Workload
    from launcher_core.schema import Profile

RUNTIME_MIB = 512.0             # a CPU rank before its models: interpreter, torch, transformers, datasets, gloo (~420 measured)
CUDA_RUNTIME_MIB = 1536.0       # a GPU rank's extra: CUDA context host side, cuBLAS, NCCL (estimate)


@dataclass(frozen=True)
class HostRamAtStart:
    """One rank's host RAM at start, by term, and the node's (MiB)."""

    ranks: int                      # ranks on this node
    device: str                     # machine.device: "cuda" or "cpu"
    runtime_mib: float
    target_mib: float               # GPU: the largest tensor on its way; CPU: the loaded target's weights
    drafter_init_mib: float         # twice the largest init unit in float32 (transient)
    drafter_shards_mib: float       # CPU: this rank's float32 shards (0 on a GPU rank)
    whole_drafter_mib: float        # built whole on the host: the whole drafter in float32
    whole_target_mib: float         # built whole on the host, CPU: the whole target (GPU: as target_mib)

    @property
    def per_rank_mib(self) -> float:
        return self.runtime_mib + self.target_mib + self.drafter_init_mib + self.drafter_shards_mib

    @property
    def node_mib(self) -> float:
        return self.ranks * self.per_rank_mib

    @property
    def whole_per_rank_mib(self) -> float:
        """A rank's host RAM at start in the order before: the whole drafter on the host (FSDP2 then shards it
        one unit at a time, freeing the whole tensors as it goes) and the whole target."""
        return self.runtime_mib + self.whole_target_mib + self.whole_drafter_mib

    @property
    def whole_node_mib(self) -> float:
        return self.ranks * self.whole_per_rank_mib

    def terms(self) -> str:
        target = "target weights" if self.device == "cpu" else "largest target tensor on its way to the GPU"
        shards = f" + {gib(self.drafter_shards_mib)} drafter shards" if self.drafter_shards_mib else ""
        return (f"runtime {gib(self.runtime_mib)} + {target} {gib(self.target_mib)} + drafter init units "
                f"{gib(self.drafter_init_mib)} (the largest, twice, transient){shards}")

    def line(self, ram_mib: Optional[float] = None) -> str:
        node = f" of the node's {gib(ram_mib)}" if ram_mib else ""
        node += " (DOES NOT FIT)" if self.problem(ram_mib) else ""
        return (f"host RAM at start: {self.ranks} rank(s) x {gib(self.per_rank_mib)} = {gib(self.node_mib)}{node} "
                f"(per rank: {self.terms()}; the drafter built whole on the host would need "
                f"{gib(self.whole_node_mib)})")

    def problem(self, ram_mib: Optional[float]) -> Optional[str]:
        """Why the node's RAM does not hold its ranks' start (None: it does, or nothing is known)."""
        if not ram_mib or self.node_mib <= ram_mib:
            return None
        return (f"the node's {self.ranks} rank(s) need {gib(self.node_mib)} of host RAM at start "
                f"({self.ranks} x {gib(self.per_rank_mib)}: {self.terms()}) and the node has {gib(ram_mib)}; "
                f"use a node with more memory or fewer ranks (machine.nproc_per_node)")


def host_ram_at_start(profile: Profile, plan: Plan) -> HostRamAtStart:
    """From the plan's workload: the target's and the drafter's shapes, the ranks on this node."""
    from dflash.memory import peak_estimate as memory

    workload, device = plan.workload, profile.machine.device
    shape, dtype_bytes = workload.target, workload.dtype_bytes
    whole_drafter = memory.drafter_params(workload) * MASTER_BYTES / MIB
    largest_tensor = max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden, shape.q_dim * shape.hidden)
    if device == "cpu":
        target = loaded_target_params(workload, profile) * dtype_bytes / MIB
        whole_target = shape.total_params() * dtype_bytes / MIB
        shards = plan.estimate.drafter_weights
    else:
        target = whole_target = largest_tensor * dtype_bytes / MIB
        shards = 0.0
    runtime = RUNTIME_MIB + (CUDA_RUNTIME_MIB if device == "cuda" else 0.0)
    return HostRamAtStart(ranks=profile.machine.nproc_per_node, device=device, runtime_mib=runtime, target_mib=target,
                          drafter_init_mib=2 * largest_init_unit(workload) * MASTER_BYTES / MIB,
                          drafter_shards_mib=shards, whole_drafter_mib=whole_drafter, whole_target_mib=whole_target)


def largest_init_unit(workload: Workload) -> int:
    """Elements of the largest module dflash.train.rank.materialize builds again at once: a weight matrix, one
    of DFlash 2's convolutions (its two tensors) or its selector (both codebooks and the projection)."""
    from dflash.memory import peak_estimate as memory

    single = max(rows * rest for rows, rest in memory.drafter_tensors(workload))
    conv = memory.conv_tensors(workload)[:2]
    return max(single, sum(rows * rest for rows, rest in conv), sum(rows * rest for rows, rest in memory.selector_tensors(workload)))


def loaded_target_params(workload: Workload, profile: Profile) -> int:
    """The target's parameters a rank loads (dflash.train.rank.setup.target_layers_to_load)."""
    from dflash.drafter.taps import target_layers_needed
    from dflash.memory import peak_estimate as memory

    layers = target_layers_needed(workload.tap_layers, workload.drafter_layers, workload.target.num_layers,
                                  profile.drafter.init == "target", to_last=workload.distill)
    return memory.target_params_loaded(workload, layers)
