"""Drafter checkpoints: `{run_dir}/train/checkpoints/step-N/` and the `latest` pointer.

Each checkpoint directory holds `model.safetensors` (the trainable drafter weights, whole, reference
names), `config.json` (reference drafter format, `config_document`: `architectures:
["DFlashDraftModel"]`, `model_type: qwen3`, `block_size`, `dflash_config: {mask_token_id,
target_layer_ids, block_size}`, `num_target_layers`, Qwen3 shape keys, plain RoPE as a top-level
`rope_theta` next to transformers 5's `rope_parameters`), `training_state.pt` (scheduler, step,
agreed micro-batch, world size, the trained weights' RMS beside the run's initial one and the step's loss,
dflash.train.supervisor.resume.WeightsRecord: tensors, numbers, strings and containers only, read back with
`torch.load(weights_only=True)`, never by unpickling arbitrary objects) and, from training,
`dcp/`: the sharded model and AdamW states as torch.distributed.checkpoint wrote them, one file
per rank (dflash.train.rank.sharded_checkpoints; they resume at any world size), and `training_data.json`, the
record of the data it was trained on (dflash.data.rendering_record; eval's mode check reads it). It is
written into a temporary sibling directory and renamed into place; `latest` (a text file naming
the directory) is replaced atomically after it, so a crash leaves the previous checkpoint usable.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, cast

from launcher_core.errors import InputError, first_line
from launcher_core.fileio import atomic_directory, write_text_atomic

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config

    from dflash.drafter.network import DFlashDrafter

LATEST = "latest"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DCP_DIR = "dcp"                 # a training checkpoint's sharded weights and AdamW states (dflash.train.rank.sharded_checkpoints)
CONFIG = "config.json"
STATE = "training_state.pt"
TRAINING_DATA = "training_data.json"    # the training data's rendering record (dflash.data.rendering_record.TrainingDataRecord)
STEP_DIR = re.compile(r"step-(\d+)")
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_SHAPE_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# RoPE types a drafter may use: transformers' Qwen3RotaryEmbedding computes them for us and for
# the reference, and SGLang / vLLM implement them (dynamic NTK, longrope, llama3 are refused).
ROPE_TYPES = ("default", "linear", "yarn")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "train" / "checkpoints"


def complete_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's whole `step-N` checkpoints by step: config.json, training_state.pt and dcp/.metadata written
    (what retention, dflash.train.rank.retention, may remove)."""
    found = {}
    for path in checkpoints_dir(run_dir).glob("step-*"):
        match = STEP_DIR.fullmatch(path.name)
        whole = all((path / name).is_file() for name in (CONFIG, STATE, f"{DCP_DIR}/.metadata"))
        if match and path.is_dir() and not path.is_symlink() and whole:
            found[int(match.group(1))] = path
    return found


def save_checkpoint(run_dir: str | Path, drafter: DFlashDrafter, step: int, state: dict[str, object]) -> Path:
    """Write step-N of an unsharded drafter (one process) atomically, then point `latest` at it.
    Training writes its sharded checkpoints through dflash.train.rank.sharded_checkpoints, with the same files."""
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in drafter.state_dict().items()}
    with atomic_directory(checkpoints_dir(run_dir) / f"step-{step}") as staging:
        write_checkpoint_files(staging, weights, drafter.config, {"step": step, **state})
    return publish_checkpoint(run_dir, None, step)


def write_checkpoint_files(directory: Path, weights: Mapping[str, torch.Tensor] | None, config: PretrainedConfig,
                           state: Mapping[str, object]) -> None:
    """model.safetensors (the full weights; none when `weights` is None: a training checkpoint's weights are
    then in its dcp/), config.json and training_state.pt into `directory`."""
    import torch

    if weights is not None:
        write_weights(directory, weights)
    (directory / CONFIG).write_text(json.dumps(config_document(config), indent=2) + "\n", encoding="utf-8")
    torch.save(dict(state), directory / STATE)


def write_weights(directory: Path, weights: Mapping[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(dict(weights), str(directory / WEIGHTS), metadata={"format": "pt"})


def publish_checkpoint(run_dir: str | Path, staging: Path | None, step: int) -> Path:
    """Put a staged checkpoint directory in place as step-N (when `staging` is given), then point
    `latest` at it: a crash before this leaves the previous checkpoint the latest."""
    from launcher_core.fileio import replace_directory

    target = checkpoints_dir(run_dir) / f"step-{step}"
    if staging is not None:
        replace_directory(staging, target)
    write_text_atomic(checkpoints_dir(run_dir) / LATEST, f"step-{step}\n")
    return target


class PointerIsDirectory(InputError):
    """`latest` is a directory, not the pointer file: not the launcher's to replace (it did not create it)."""


def read_pointer(pointer: Path) -> str:
    """The step directory a `latest` file names; InputError naming the file when it holds something else
    (binary garbage, a path, several lines), PointerIsDirectory when it is a directory."""
    if pointer.is_dir():
        raise PointerIsDirectory(f"{pointer}: a directory, not the checkpoint pointer (a text file naming one step "
                                 f"directory, e.g. step-500); move it out of {pointer.parent} and run again (the "
                                 "launcher does not remove what it did not write)")
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    if not name or "/" in name or "\n" in name or name in (".", ".."):
        raise InputError(f"{pointer}: not a checkpoint pointer (it should hold one name, e.g. step-500); remove it "
                         "or write the step to use into it (`train --resume` points it at the newest whole checkpoint)")
    return name


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The directory `latest` names, or None when there is no checkpoint yet."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.exists():
        return None
    target = pointer.parent / read_pointer(pointer)
    if not has_weights(target):
        raise InputError(f"{pointer} names {target.name}, which has no {WEIGHTS} and no {DCP_DIR}/.metadata; "
                         "remove the pointer or fix it")
    return target


def has_weights(directory: Path) -> bool:
    """A drafter's weights are here: model.safetensors, a sharded safetensors index, or a training
    checkpoint's dcp/ (whose weights `read_weights` consolidates)."""
    return any((directory / name).is_file() for name in (WEIGHTS, INDEX, f"{DCP_DIR}/.metadata"))


def config_document(config: PretrainedConfig) -> dict[str, Any]:
    """config.json of a drafter: the Qwen3Config's keys plus what loaders outside transformers 5
    read: a top-level `rope_theta` and `rope_scaling` (null for plain RoPE, else the scaling
    parameters with both `type` and `rope_type`), `block_size` at both levels, and the layer keys
    (`layers.config_layer_keys`: `layer_types`, `sliding_window`, `use_sliding_window`, and
    `is_causal` only where the config sets it). Loaders that read `rope_theta` (SGLang, transformers 4.x, MLX) otherwise
    fall back to their own default base and run the drafter with a RoPE it was not trained with."""
    from dflash.drafter.layers import config_layer_keys
    from launcher_core.layer_attention import SLIDING

    document = json.loads(config.to_json_string(use_diff=False))
    rope = dict(document.get("rope_parameters") or {})
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"drafter RoPE type {kind!r} is not supported; valid: {', '.join(ROPE_TYPES)}")
    document["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    document["rope_scaling"] = None if kind == "default" else {**scaling, "type": kind, "rope_type": kind}
    types = list(document.get("layer_types") or [])
    window = int(document.get("sliding_window") or 0) if SLIDING in types else 0
    causal = document.pop("is_causal", None)
    document.update(config_layer_keys(types, int(document["num_hidden_layers"]), window, causal))
    document["model_type"] = "qwen3"
    document.setdefault("dflash_config", {})["block_size"] = int(document["block_size"])
    return document


def read_drafter_config(checkpoint_dir: str | Path) -> Qwen3Config:
    """The drafter config of our checkpoints or of a published DFlash drafter (z-lab format:
    `auto_map`, top-level `rope_theta`, block size at the top level or in dflash_config)."""
    from transformers import Qwen3Config

    path = Path(checkpoint_dir) / CONFIG
    if not path.exists():
        raise InputError(f"{path}: no drafter config here; expected a checkpoint directory step-N/ "
                         "or a DFlash drafter directory (config.json + *.safetensors)")
    from launcher_core.fileio import read_json_object

    document = read_json_object(path, "a drafter config")
    _check_supported(path, document)
    dflash = document["dflash_config"]
    document["block_size"] = int(dflash.get("block_size", document.get("block_size", 16)))
    for key in ("auto_map", "torch_dtype", "dtype"):
        document.pop(key, None)
    if "sliding_attention" in (document.get("layer_types") or []):
        document["use_sliding_window"] = True    # Qwen3Config drops sliding_window without it
    return Qwen3Config.from_dict(document)


def _check_supported(path: Path, document: dict[str, Any]) -> None:
    """InputError for configs this drafter cannot run the way they were trained."""
    architectures = document.get("architectures") or []
    if not set(ARCHITECTURES) & set(architectures) or "dflash_config" not in document:
        raise InputError(f"{path}: not a DFlash drafter config (needs architectures DFlashDraftModel or "
                         "DFlash2DraftModel, and dflash_config)")
    if "target_layer_ids" not in document["dflash_config"] or "mask_token_id" not in document["dflash_config"]:
        raise InputError(f"{path}: dflash_config needs target_layer_ids and mask_token_id")
    if "DFlash2DraftModel" in architectures:
        problems = dflash2_config_problems(document)
        if problems:
            raise InputError(f"{path}: a DFlash 2 drafter config this launcher cannot run as trained: " + "; ".join(problems))
    from dflash.drafter.layers import layer_type_problems

    if document["dflash_config"].get("causal"):
        raise InputError(f"{path}: dflash_config.causal is set; the reference ignores it and the engines do not: "
                         "state the attention with layer_types / is_causal instead")
    layer_types = list(document.get("layer_types") or [])
    window = int(document.get("sliding_window") or 0) if "sliding_attention" in layer_types else 0
    problems = layer_type_problems(layer_types, int(document.get("num_hidden_layers") or 0), window)
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems))
    rope = document.get("rope_parameters") or document.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise InputError(f"{path}: RoPE type {kind!r} ({rope}) is not supported; valid: {', '.join(ROPE_TYPES)}")


def dflash2_config_problems(document: dict[str, Any]) -> list[str]:
    """What stops a DFlash2DraftModel config from running here as the reference runs it ([] if nothing).

    The reference `DFlash2DraftModel` needs the four shape keys in dflash_config (or at the top level;
    vLLM and SGLang read dflash_config only, so that is where they must be); the selector scores the
    whole vocabulary's top K (no draft vocabulary), and the block embedding is not scaled here."""
    dflash = document.get("dflash_config") or {}
    problems = [f"dflash_config.{key} missing (a positive integer)" for key in DFLASH2_SHAPE_KEYS
                if not isinstance(dflash.get(key), int) or isinstance(dflash.get(key), bool) or dflash[key] < 1]
    hidden, vocab = int(document.get("hidden_size") or 0), int(document.get("vocab_size") or 0)
    group, top_k = dflash.get("conv_group_size"), dflash.get("selector_top_k")
    if isinstance(group, int) and group > 0 and hidden % group:
        problems.append(f"dflash_config.conv_group_size {group} does not divide hidden_size {hidden}")
    if isinstance(top_k, int) and vocab and top_k > vocab:
        problems.append(f"dflash_config.selector_top_k {top_k} exceeds vocab_size {vocab}")
    if not _number(dflash.get("output_multiplier", 1.0)) > 0:
        problems.append(f"dflash_config.output_multiplier {dflash['output_multiplier']!r} (must be a number > 0)")
    if not _number(dflash.get("final_logit_softcapping") or 0.0) >= 0:
        problems.append(f"dflash_config.final_logit_softcapping {dflash['final_logit_softcapping']!r} (0/null: none, else > 0)")
    if _number(dflash.get("input_embedding_scale", 1.0)) != 1.0:
        problems.append(f"dflash_config.input_embedding_scale {dflash['input_embedding_scale']}: the block embedding "
                        "is not scaled here (only 1.0 is supported)")
    if dflash.get("draft_vocab_size") or document.get("draft_vocab_size"):
        problems.append("a draft vocabulary: the DFlash 2 selector needs the target's whole vocabulary")
    return problems


def is_dflash2_checkpoint(path: str | Path) -> bool:
    """Whether a drafter directory (or a run's checkpoints/ dir) holds a DFlash 2 drafter; torch-free."""
    config_path = resolve_checkpoint_dir(Path(path)) / CONFIG
    try:
        document = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and "DFlash2DraftModel" in (document.get("architectures") or [])


def _number(value: object) -> float:
    """A config value as a number; NaN (failing every comparison) when it is not one."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def read_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The drafter's tensors: `model.safetensors`, or every shard an index names, or (a training
    checkpoint without them) its dcp/ shards consolidated; a `model.` prefix (some published exports)
    is dropped and rotary caches are skipped."""
    from safetensors.torch import load_file

    if weights_in_shards_only(checkpoint_dir):
        return read_sharded_weights(checkpoint_dir / DCP_DIR)
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(checkpoint_dir):
        for name, tensor in _load_safetensors(path, load_file).items():
            if "rotary_emb." not in name:
                weights[name.removeprefix("model.")] = tensor
    return weights


def read_sharded_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The drafter's whole weights from a training checkpoint's dcp/, in this process (no process group):
    every rank's shard of each `model` tensor, read into one full tensor (the AdamW states are not read)."""
    import torch

    names = sharded_weight_shapes(directory)
    wanted = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in names.items()}
    _load_shards(directory, wanted)
    return {key.removeprefix("model."): tensor for key, tensor in wanted.items()}


def _load_shards(directory: Path, wanted: dict[str, torch.Tensor]) -> None:
    """DCP's load of `wanted` (flat `model.NAME` keys) in this process; a missing or short shard file is an
    InputError naming the checkpoint."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    except Exception as error:      # noqa: BLE001 - a missing or short shard file, whatever DCP raises for it
        raise InputError(f"{directory}: its shards cannot be read ({first_line(error)}); the checkpoint is damaged: "
                         "use another one") from None


def sharded_weight_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`model.NAME` -> (shape, dtype) of every weight tensor a dcp/ directory's metadata records."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:      # noqa: BLE001 - any failure to read it means the same: unusable
        raise InputError(f"{directory}/.metadata: cannot be read ({first_line(error)}); the checkpoint is damaged") from None
    return {key: (tuple(int(d) for d in entry.size), entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata) and "rotary_emb." not in key}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a drafter directory's safetensors files, read only when `load` is called."""

    path: Path
    key: str                    # its name in the file (a `model.` prefix kept)
    shape: tuple[int, ...]

    def load(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), "pt") as handle:
            return handle.get_tensor(self.key)


@dataclass(frozen=True)
class ShardedStoredTensor:
    """One weight of a training checkpoint's dcp/, its shards read into one tensor only when `load` is called."""

    directory: Path
    key: str                    # its name in the DCP metadata (`model.NAME`)
    shape: tuple[int, ...]
    dtype: torch.dtype

    def load(self) -> torch.Tensor:
        import torch

        tensor = torch.empty(self.shape, dtype=self.dtype)
        _load_shards(self.directory, {self.key: tensor})
        return tensor


def stored_weights(checkpoint_dir: Path) -> dict[str, StoredTensor | ShardedStoredTensor]:
    """`read_weights`'s names and shapes from the files' headers (or a training checkpoint's DCP metadata),
    each tensor read on demand."""
    from safetensors import SafetensorError, safe_open

    if weights_in_shards_only(checkpoint_dir):
        shards = checkpoint_dir / DCP_DIR
        return {key.removeprefix("model."): ShardedStoredTensor(shards, key, shape, dtype)
                for key, (shape, dtype) in sharded_weight_shapes(shards).items()}
    stored: dict[str, StoredTensor | ShardedStoredTensor] = {}
    for path in _weight_files(checkpoint_dir):
        try:
            with safe_open(str(path), "pt") as handle:
                for key in handle.keys():
                    if "rotary_emb." not in key:
                        stored[key.removeprefix("model.")] = StoredTensor(path, key, tuple(handle.get_slice(key).get_shape()))
        except (SafetensorError, OSError) as error:
            raise InputError(f"{path}: not a readable safetensors file ({error}); it is truncated or damaged: "
                             "copy it again, or use another checkpoint") from None
    return stored


def weights_in_shards_only(checkpoint_dir: Path) -> bool:
    """An intermediate training checkpoint: its weights are in dcp/ only (no safetensors file or index)."""
    has_safetensors = (checkpoint_dir / INDEX).exists() or (checkpoint_dir / WEIGHTS).exists()
    return not has_safetensors and (checkpoint_dir / DCP_DIR).is_dir()


def _weight_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / INDEX
    if index.exists():
        files = [checkpoint_dir / shard for shard in sorted(set(_index_weight_map(index).values()))]
    elif (checkpoint_dir / WEIGHTS).exists():
        files = [checkpoint_dir / WEIGHTS]
    else:
        raise InputError(f"{checkpoint_dir}: no {WEIGHTS} (or {INDEX}, or a training checkpoint's {DCP_DIR}/) here")
    missing = [path for path in files if not path.is_file()]
    if missing:
        raise InputError(f"{missing[0]}: missing (named by the checkpoint's index); restore the file or re-export")
    return files


def _index_weight_map(index: Path) -> dict[str, str]:
    from launcher_core.fileio import read_json_object

    weight_map = read_json_object(index, "a safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{index}: `weight_map` is not an object of tensor name -> file name")
    return weight_map


def _load_safetensors(path: Path, load_file: Callable[[str], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (`_weight_files` found it); a truncated or foreign file is an InputError naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise InputError(f"{path}: not a readable safetensors file ({error}); it is truncated or damaged: "
                         "copy it again, or use another checkpoint") from None


def load_drafter(checkpoint_dir: str | Path, target_model: PreTrainedModel) -> DFlashDrafter:
    """A drafter from `step-N/` (or a run's `checkpoints/` dir: its latest) or a published DFlash
    (or DFlash 2: dflash.drafter.dflash2.DFlash2Drafter) drafter directory, attached to the target.
    Weights load strictly (names and shapes)."""
    from dflash.drafter.dflash2 import drafter_for_config

    checkpoint_dir = resolve_checkpoint_dir(Path(checkpoint_dir))
    drafter = drafter_for_config(read_drafter_config(checkpoint_dir))
    weights = {name: tensor.float() if tensor.is_floating_point() else tensor
               for name, tensor in read_weights(checkpoint_dir).items()}
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as error:
        raise InputError(f"{checkpoint_dir}: the weights do not fit its config.json: {error}") from error
    embedding = cast("nn.Embedding", target_model.get_input_embeddings())
    if not 0 <= drafter.mask_token_id < embedding.num_embeddings:
        raise InputError(f"{checkpoint_dir / CONFIG}: dflash_config.mask_token_id {drafter.mask_token_id} is not a row "
                         f"of the target's embedding (0..{embedding.num_embeddings - 1}); the drafter was trained "
                         f"for another target")
    return drafter.to(embedding.weight.device).attach_target(target_model).eval()


def resolve_checkpoint_dir(path: Path) -> Path:
    if (path / LATEST).exists():
        return path / read_pointer(path / LATEST)
    return path


def load_training_state(checkpoint_dir: Path) -> dict[str, Any]:     # torch.load's values (untyped)
    """The optimizer/scheduler state of a checkpoint, loaded with `weights_only=True`: tensors,
    numbers, strings and containers only, never arbitrary pickled objects from the checkpoint
    directory. A state holding anything else (not written by this trainer) is refused."""
    import pickle

    import torch

    path = checkpoint_dir / STATE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"{path}: missing; this checkpoint cannot be resumed (train without --resume)") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InputError(f"{path}: not a training state this trainer loads safely ({first[:200]}); it holds "
                         "objects other than tensors, numbers and strings, or is damaged. Resume from another "
                         "checkpoint, or train without --resume") from None
    if not isinstance(state, dict):
        raise InputError(f"{path}: expected a dict of training state, found {type(state).__name__}")
    return state


def init_source_problem(path: Path) -> str:
    """What stops `path` from being a `drafter.init_from` directory ("" when it can be one); torch-free."""
    try:
        directory = resolve_checkpoint_dir(Path(path))
        config_path = directory / CONFIG
        if not config_path.exists():
            return f"{directory}: no {CONFIG}; expected a DFlash drafter directory (config.json + *.safetensors)"
        _check_supported(config_path, json.loads(config_path.read_text(encoding="utf-8")))
    except (OSError, ValueError, InputError) as error:
        return str(error)
    if not has_weights(directory):
        return f"{directory}: no {WEIGHTS} (or {INDEX}, or a training checkpoint's {DCP_DIR}/)"
    return ""


class Shaped(Protocol):
    """A tensor, or a stored tensor not read yet (StoredTensor): what `weight_differences` compares."""

    @property
    def shape(self) -> Sequence[int]: ...


def weight_differences(own: Mapping[str, Shaped], loaded: Mapping[str, Shaped]) -> list[str]:
    """Every name missing from `loaded`, every name `own` lacks, every shape that differs."""
    missing = [f"{name}: missing (profile's drafter has {tuple(own[name].shape)})" for name in own if name not in loaded]
    extra = [f"{name}: not in the profile's drafter ({tuple(loaded[name].shape)})" for name in loaded if name not in own]
    shapes = [f"{name}: {tuple(loaded[name].shape)} there, {tuple(own[name].shape)} in the profile's drafter"
              for name in own if name in loaded and tuple(loaded[name].shape) != tuple(own[name].shape)]
    return missing + extra + shapes


def init_from_drafter(drafter: DFlashDrafter, path: str | Path) -> Path:
    """Start the (whole) `drafter` built from the profile from a DFlash drafter directory's weights
    (`drafter.init = "drafter"`, `drafter_init_values`); returns the directory."""
    from dflash.drafter.network import assign_values

    directory, values = drafter_init_values(drafter, path)
    assign_values(drafter, values)
    return directory


def drafter_init_values(drafter: DFlashDrafter, path: str | Path) -> tuple[Path, dict[str, Callable[[], torch.Tensor]]]:
    """The drafter's start from a DFlash drafter directory's weights (`drafter.init = "drafter"`): the
    directory and, by name, a reader of each tensor (one at a time; only the drafter's names and global
    shapes are read: it may be on the meta device, sharded). Names and shapes must match exactly, and so
    must the tap layers (the features fc reads) and, between DFlash 2 drafters, the selector's settings;
    InputError listing every difference otherwise. A DFlash 2 profile may start from a DFlash (1) drafter:
    its backbone loads, and the convolutions (identity) and the selector (a no-op: zero successor
    codebook) keep their fresh start, so the drafter starts drafting exactly as that one."""
    directory = resolve_checkpoint_dir(Path(path))
    source = read_drafter_config(directory)
    own = drafter.state_dict(keep_vars=True)
    fresh = _dflash2_additions(own) if _is_dflash2(drafter.config) and not _is_dflash2(source) else set()
    stored = stored_weights(directory)
    differences = weight_differences({name: value for name, value in own.items() if name not in fresh}, stored)
    taps = list(source.dflash_config["target_layer_ids"])
    if taps != list(drafter.target_layer_ids):
        differences.append(f"dflash_config.target_layer_ids: {taps} there, {list(drafter.target_layer_ids)} in the profile")
    differences += _dflash2_differences(drafter.config, source)
    if differences:
        raise InputError(f"drafter.init_from {directory}: does not fit the profile's drafter "
                         f"({len(differences)} difference(s)):\n" + "\n".join(f"  {d}" for d in differences))
    return directory, {name: stored[name].load for name in own if name not in fresh}


def _is_dflash2(config: PretrainedConfig) -> bool:
    return "DFlash2DraftModel" in (getattr(config, "architectures", None) or [])


def _dflash2_additions(names: Mapping[str, object]) -> set[str]:
    """The tensors DFlash 2 adds to a DFlash drafter: the convolutions and the selector."""
    return {name for name in names if name.startswith("candidate_selector.") or "_conv." in name}


def _dflash2_differences(own: PretrainedConfig, source: PretrainedConfig) -> list[str]:
    """DFlash 2 settings that are not tensor shapes (top-K, the unary transform) and must match;
    a DFlash 2 source for a DFlash profile is named with what to set."""
    if _is_dflash2(source) and not _is_dflash2(own):
        return ["architectures: DFlash2DraftModel there, DFlashDraftModel in the profile (set drafter.kind = \"dflash2\" "
                "with its settings)"]
    if not (_is_dflash2(source) and _is_dflash2(own)):
        return []
    defaults = {"selector_top_k": 0.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}   # absent: its default
    theirs, ours = dict(source.dflash_config), dict(own.dflash_config)
    return [f"dflash_config.{key}: {theirs.get(key)} there, {ours.get(key)} in the profile (drafter.{key})"
            for key, default in defaults.items()
            if float(theirs.get(key) or default) != float(ours.get(key) or default)]
