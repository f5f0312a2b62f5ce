"""What one training step processes in its worst case, and how the drafter is sharded over the
ranks: the one definition the memory model (`dflash.memory.peak_estimate`), the activations
(`dflash.memory.activations`), the masks (`dflash.memory.attention_masks`) and a calibration's key
(`dflash.memory.calibration_record`) all read. No torch import: `plan` runs in the launcher process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from dflash.drafter.shape import DrafterShape, derive_shape, profile_shape
from dflash.drafter.taps import default_target_layer_ids
from dflash.memory.target_shape import DTYPE_BYTES, TargetShape, target_shape
from launcher_core.schema import Profile

LOGITS_CHUNK_TOKENS = 2048          # block tokens whose logits exist at once (train.loss_chunk_rows)


@dataclass(frozen=True)
class DFlash2Parts:
    """What DFlash 2 (`drafter.kind = "dflash2"`, dflash.drafter.dflash2) adds to the drafter: a grouped
    dynamic causal convolution of `conv_kernel_size` taps (one dynamic kernel per `conv_group_size`
    channels) around each attention and MLP sublayer, and the candidate selector (rank-`selector_rank`
    codebooks over the whole vocabulary, the head's top `selector_top_k` per slot)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class Workload:
    """What one training step processes, in its worst case, on one of `world_size` ranks."""

    target: TargetShape
    dtype: str
    drafter_layers: int
    drafter_shape: DrafterShape         # the drafter's own attention (derived: no zero field)
    block_size: int
    num_anchors: int
    max_length: int
    tap_layers: tuple[int, ...]
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS
    world_size: int = 1                 # ranks the drafter is sharded over (FSDP2)
    sliding_layers: int = 0             # drafter layers with a sliding window (memory.attention_masks)
    sliding_window: int = 0
    rank_share: int = 1                 # sequences per rank per optimizer step (train.global_batch / world)
    compute_dtype: str = "float32"      # train.compute_dtype: FSDP2's param_dtype (the gathered weights, the forward)
    autocast_on: bool = True            # the drafter's forward under bf16 autocast (model.dtype bf16 and train.autocast)
    reshard_after_forward: bool = True  # train.reshard_after_forward
    gradient_sync: str = "every_micro_batch"    # train.gradient_sync
    activation_checkpointing: str = "none"      # train.activation_checkpointing
    dflash2: DFlash2Parts | None = None         # drafter.kind = "dflash2": its convolutions and selector (None: DFlash)
    distill: bool = False               # train.loss = "distill": the target runs to its last layer, its logits in the loss

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def autocast(self) -> bool:
        """Mixed precision in the forward: float32 master weights, activations in model.dtype."""
        return self.dtype != "float32" and self.autocast_on

    @property
    def bf16_compute(self) -> bool:
        return self.compute_dtype == "bfloat16"

    @property
    def checkpointed(self) -> bool:
        return self.activation_checkpointing == "layers"

    @property
    def loaded_target_layers(self) -> int:
        return self.target.num_layers if self.distill else max(self.tap_layers) + 1

    @property
    def captured_layers(self) -> int:
        """Target layer outputs a micro-batch keeps from the target's forward: the taps (and with
        train.loss = "distill" the last layer's, `dflash.drafter.taps.extract_taps_and_last`)."""
        return len(self.tap_layers) + (1 if self.distill else 0)

    @property
    def anchors(self) -> int:
        return max(1, min(self.num_anchors, self.max_length - 1))

    @property
    def block_tokens(self) -> int:
        return self.anchors * self.block_size

    @property
    def supervised_slots(self) -> int:
        """Block slots with a loss per sequence (anchors x (block - 1)): the training signal one
        target forward buys."""
        return self.anchors * (self.block_size - 1)

    def key(self) -> str:
        """Identifies the workload a calibration was measured on: what a micro-batch processes and how
        the step runs it. Not how many ranks shard the drafter or share the batch: a calibration
        measured on 2 ranks corrects the estimate for 8 (dflash.memory.peak_estimate.peak_model)."""
        facts = dataclasses.asdict(self)
        facts["target"].pop("source")               # the same shape read from another path is the same workload
        facts.pop("rank_share")
        facts.pop("world_size")
        if facts["dflash2"] is None:
            facts.pop("dflash2")                    # a DFlash workload keeps the key it had before DFlash 2
        if not facts["distill"]:
            facts.pop("distill")                    # ... and before train.loss
        text = json.dumps(facts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def world_size_of(profile: Profile) -> int:
    return profile.machine.nproc_per_node * profile.machine.nnodes


def autocast_on(profile: Profile) -> bool:
    """The trainer's rule (dflash.train.rank.step.autocast_wanted): bf16 autocast on CUDA ("auto") or
    when train.autocast = "bfloat16"."""
    setting = profile.train.autocast
    return setting == "bfloat16" or (setting == "auto" and profile.machine.device == "cuda")


def workload_from_profile(profile: Profile, shape: TargetShape | None = None,
                          world_size: int | None = None) -> Workload:
    shape = shape or target_shape(profile)
    world = world_size or world_size_of(profile)
    taps = profile.drafter.target_layer_ids or tuple(default_target_layer_ids(shape.num_layers, profile.drafter.num_layers))
    train = profile.train
    return Workload(target=shape, dtype=profile.model.dtype, drafter_layers=profile.drafter.num_layers,
                    drafter_shape=derive_shape(shape.attention_config(), profile_shape(profile.drafter)),
                    block_size=profile.drafter.block_size, num_anchors=train.num_anchors,
                    max_length=profile.data.max_length, tap_layers=tuple(taps),
                    logits_chunk_tokens=train.loss_chunk_rows, world_size=world,
                    rank_share=max(1, train.global_batch // world), compute_dtype=train.compute_dtype,
                    autocast_on=autocast_on(profile), reshard_after_forward=train.reshard_after_forward,
                    gradient_sync=train.gradient_sync, activation_checkpointing=train.activation_checkpointing,
                    sliding_layers=list(profile.drafter.layer_types).count("sliding_attention"),
                    sliding_window=profile.drafter.sliding_window, dflash2=dflash2_parts(profile),
                    distill=train.loss == "distill")


def dflash2_parts(profile: Profile) -> DFlash2Parts | None:
    drafter = profile.drafter
    if drafter.kind != "dflash2":
        return None
    return DFlash2Parts(conv_kernel_size=drafter.conv_kernel_size, conv_group_size=drafter.conv_group_size,
                        selector_rank=drafter.selector_rank, selector_top_k=drafter.selector_top_k)
