"""Is a checkpoint whole, and does a drafter fit a profile or a target? Read before anything loads.

`verify_checkpoint(step_dir)` lists what is wrong with a `train/checkpoints/step-N/` directory,
from the files alone (no process group, no target, no weights in memory):

* `model.safetensors`: the 8-byte header length and the JSON header parse; every tensor's byte
  range matches its dtype and shape and lies inside the file; the file is as long as its data
  (a truncated copy or an interrupted write shows here);
* `config.json`: a DFlash drafter config (the rules of dflash.drafter.checkpoint_files);
* `training_state.pt`: torch reads it with `weights_only=True` (memory-mapped); it holds the step
  of its directory's name, the scheduler, the micro-batch and the total steps, and the optimizer
  state (itself, or in `dcp/`);
* `dcp/` when present (torch.distributed.checkpoint: `.metadata` + one `__R_0.distcp` per rank):
  the metadata reads, and every storage item's file exists and is long enough.

`header_shapes` gives the tensor shapes of a safetensors file the same way, for comparing a
checkpoint or a `drafter.init_from` directory with the profile's drafter (`shape_differences`);
`target_fit_problems` compares a drafter's config.json with a target's (eval --draft).
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Mapping

from launcher_core.errors import InputError, first_line

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 2**20
STATE_KEYS = ("step", "scheduler", "micro_batch", "total_steps")
STEP_NAME = re.compile(r"^step-(\d+)$")
Shapes = dict[str, tuple[int, ...]]


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header without __metadata__, bytes of tensor data the file holds); InputError naming the
    file and what is wrong when the header cannot be read."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: {size} bytes, shorter than a safetensors header (truncated)")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise InputError(f"{path}: its header claims {length:,} bytes, the file holds {size:,} (truncated "
                                 "or not a safetensors file)")
            header = json.loads(handle.read(length).decode("utf-8"))
    except OSError as error:
        raise InputError(f"{path}: cannot read it ({error.strerror or error})") from None
    except (UnicodeDecodeError, ValueError):
        raise InputError(f"{path}: the header is not JSON (damaged, or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: the header is not a JSON object (not a safetensors file)")
    header.pop("__metadata__", None)
    return header, size - 8 - length


def safetensors_problems(path: Path) -> list[str]:
    """What is wrong with a safetensors file (empty: whole)."""
    if not path.is_file():
        return [f"{path}: missing"]
    try:
        header, data_bytes = read_safetensors_header(path)
    except InputError as error:
        return [str(error)]
    problems, end = [], 0
    for name, entry in header.items():
        problem = _tensor_problem(name, entry)
        if problem:
            problems.append(f"{path}: {problem}")
            continue
        end = max(end, int(entry["data_offsets"][1]))
    if end > data_bytes:
        problems.append(f"{path}: truncated: its header describes {end:,} bytes of tensor data, the file holds "
                        f"{data_bytes:,}")
    elif end < data_bytes:
        problems.append(f"{path}: {data_bytes - end:,} bytes past the last tensor (not a file the writer made)")
    return problems


def _tensor_problem(name: str, entry: object) -> str:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return f"tensor {name!r}: no dtype / shape / data_offsets in the header"
    shape, offsets, dtype = entry["shape"], entry["data_offsets"], entry["dtype"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"tensor {name!r}: shape {shape!r} is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"tensor {name!r}: data_offsets {offsets!r} are not a byte range"
    width = DTYPE_BYTES.get(str(dtype))
    if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
        return (f"tensor {name!r}: {offsets[1] - offsets[0]:,} bytes for {dtype} {tuple(shape)}, which needs "
                f"{math.prod(shape) * width:,}")
    return ""


def header_shapes(path: Path) -> Shapes:
    """Tensor name -> shape from a safetensors header (a `model.` prefix dropped, rotary caches
    skipped, as dflash.drafter.checkpoint_files.read_weights does)."""
    header, _ = read_safetensors_header(path)
    return {name.removeprefix("model."): tuple(int(d) for d in entry["shape"])
            for name, entry in header.items() if "rotary_emb." not in name and isinstance(entry, dict)}


def checkpoint_shapes(directory: Path) -> Shapes:
    """Tensor name -> shape of a drafter directory's weights: its safetensors header, or (an intermediate
    training checkpoint, weights only in dcp/) the DCP metadata."""
    from dflash.drafter.checkpoint_files import DCP_DIR, WEIGHTS, sharded_weight_shapes, weights_in_shards_only

    if not weights_in_shards_only(directory):
        return header_shapes(directory / WEIGHTS)
    return {key.removeprefix("model."): shape for key, (shape, _) in sharded_weight_shapes(directory / DCP_DIR).items()}


def training_state_problems(path: Path, step: int | None, has_dcp: bool) -> list[str]:
    """What is wrong with training_state.pt (read memory-mapped with weights_only=True)."""
    import pickle

    import torch

    if not path.is_file():
        return [f"{path}: missing"]
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, IndexError, KeyError) as error:
        return [f"{path}: torch cannot read it as a training state ({first_line(error)}); damaged or not written by "
                "this trainer"]
    if not isinstance(state, dict):
        return [f"{path}: holds a {type(state).__name__}, not a dict of training state"]
    problems = [f"{path}: no `{key}`" for key in STATE_KEYS if key not in state]
    if "optimizer" not in state and not has_dcp:
        problems.append(f"{path}: no optimizer state (neither `optimizer` here nor a dcp/ directory beside it)")
    if step is not None and "step" in state and state["step"] != step:
        problems.append(f"{path}: holds step {state['step']}, its directory says step {step}")
    return problems


def dcp_problems(directory: Path) -> list[str]:
    """What is wrong with a torch.distributed.checkpoint directory: its metadata, and every storage
    item's file present and long enough."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:      # noqa: BLE001 - any failure to read it means the same: unusable
        return [f"{directory}: its metadata (.metadata) cannot be read ({type(error).__name__}: {first_line(error)})"]
    sizes: dict[str, int] = {}
    problems: list[str] = []
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if name not in sizes:
            file = directory / name
            sizes[name] = file.stat().st_size if file.is_file() else -1
            if sizes[name] < 0:
                problems.append(f"{file}: missing (named by {directory / '.metadata'})")
        if 0 <= sizes[name] < info.offset + info.length:
            problems.append(f"{directory / name}: {sizes[name]:,} bytes, an item needs bytes up to "
                            f"{info.offset + info.length:,} (truncated)")
            sizes[name] = -2                        # one line per file
    return problems


def verify_checkpoint(path: str | Path) -> list[str]:
    """Everything wrong with checkpoint directory `path` (empty: it can be resumed)."""
    from dflash.drafter.checkpoint_files import CONFIG, DCP_DIR, STATE, WEIGHTS, has_weights, init_source_problem, weights_in_shards_only

    directory = Path(path)
    if not directory.is_dir():
        return [f"{directory}: not a directory"]
    match = STEP_NAME.match(directory.name)
    dcp = directory / DCP_DIR
    problems = [] if weights_in_shards_only(directory) else safetensors_problems(directory / WEIGHTS)
    if not (directory / CONFIG).is_file():
        problems.append(f"{directory / CONFIG}: missing")
    elif has_weights(directory) and (config_problem := init_source_problem(directory)):
        problems.append(config_problem)
    problems += training_state_problems(directory / STATE, int(match.group(1)) if match else None, dcp.is_dir())
    if dcp.is_dir():
        problems += dcp_problems(dcp)
    return problems


def shape_differences(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Every tensor the profile's drafter has that `found` lacks, every extra one, every other shape."""
    missing = [f"{name}: missing there (the profile's drafter has {expected[name]})" for name in expected
               if name not in found]
    extra = [f"{name}: {found[name]} there, not in the profile's drafter" for name in found if name not in expected]
    shapes = [f"{name}: {found[name]} there, {expected[name]} in the profile's drafter" for name in expected
              if name in found and found[name] != expected[name]]
    return missing + extra + shapes


def target_fit_problems(drafter_config: Mapping[str, Any], target_config: Mapping[str, Any]) -> list[str]:
    """How a drafter's config.json disagrees with a target's config.json (text part): hidden size,
    vocabulary, number of target layers, tap layers, mask token. Empty: it can draft for it."""
    nested = target_config.get("text_config")
    text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else target_config
    dflash = drafter_config.get("dflash_config") or {}
    layers, vocab = int(text.get("num_hidden_layers") or 0), int(text.get("vocab_size") or 0)
    problems = [f"{key} {drafter_config[key]} in the drafter, {text[key]} in the target"
                for key in ("hidden_size", "vocab_size") if key in drafter_config and key in text
                and int(drafter_config[key]) != int(text[key])]
    if drafter_config.get("num_target_layers") not in (None, layers):
        problems.append(f"trained on a target of {drafter_config['num_target_layers']} layers, this one has {layers}")
    taps = [int(k) for k in dflash.get("target_layer_ids") or []]
    if any(not 0 <= k < layers for k in taps):
        problems.append(f"tap layers {taps} are not all inside the target's layers 0..{layers - 1}")
    mask = dflash.get("mask_token_id")
    if mask is not None and vocab and not 0 <= int(mask) < vocab:
        problems.append(f"mask token {mask} is not a row of the target's embedding (0..{vocab - 1})")
    return problems
