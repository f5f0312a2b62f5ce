"""The target's shape as the memory model needs it, and where it is found.

From the target's `config.json` when its directory exists (`dflash.target_model.local_model_dir`: a
builtin's cache directory or the profile's path; a nested `text_config` is used for multimodal
configs; the parameter count from the safetensors index when there is one), else from the
builtin's known config (SmolLM2-135M, the flagship twin) or, for a target that is not on this
machine (a path on the GPU node a plan is made for, a hub id), Qwen3.6-27B's published text config
(`dflash.target_model.QWEN36_27B_TEXT`): ASSUMED dimensions, which the shape's `source` says and `plan`
prints (`describe_target`). A target that is here but is not a model directory (a file, a folder
without config.json) is refused (ConfigError naming model.target). Reads files only: no torch, no
conversion, no download.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dflash.drafter.shape import target_rope_theta
from dflash.target_model import FLAGSHIP_TEXT, FLAGSHIP_TWIN, QWEN36_27B_PARAMS, QWEN36_27B_TEXT, SMOLLM2, SMOLLM2_135M_CONFIG, local_model_dir, with_layer_types
from launcher_core.errors import ConfigError, InputError
from launcher_core.schema import Profile

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ASSUMED = "assumed dimensions"


@dataclass(frozen=True)
class TargetShape:
    """The target's dimensions (those that decide memory)."""

    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    param_count: int = 0            # 0: computed from the dimensions
    source: str = "defaults"
    linear_value_dim: int = 0       # Gated DeltaNet value heads x head dim (hybrid targets; 0: none)
    rope_theta: float = 0.0         # RoPE base (a derived drafter shape takes it; 0: the default)

    @property
    def assumed(self) -> bool:
        """Dimensions that stand in for a target this machine does not have (`target_shape`)."""
        return self.source.startswith(ASSUMED)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim) + 2 * self.head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def attention_config(self) -> dict[str, int | float]:
        """The attention keys of the target's config.json: what `derive_shape` reads."""
        return {"hidden_size": self.hidden, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                **({"rope_theta": self.rope_theta} if self.rope_theta else {})}

    def total_params(self) -> int:
        if self.param_count:
            return self.param_count
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return embeddings + self.num_layers * self.layer_params() + self.hidden


def shape_from_config(config: Mapping[str, object], source: str, param_count: int = 0) -> TargetShape:
    """A HF config.json (parsed JSON) -> TargetShape; multimodal configs use their `text_config`."""
    nested = config.get("text_config")
    text: Mapping[str, object] = nested if isinstance(nested, Mapping) else config
    try:
        heads, hidden = _int(text, "num_attention_heads"), _int(text, "hidden_size")
        return TargetShape(
            hidden=hidden, num_layers=_int(text, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=_int(text, "num_key_value_heads", heads), head_dim=_int(text, "head_dim", hidden // heads),
            intermediate=_int(text, "intermediate_size"), vocab=_int(text, "vocab_size"),
            tie_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            param_count=param_count, source=source, linear_value_dim=_linear_value_dim(text),
            rope_theta=target_rope_theta(text))
    except KeyError as error:
        raise InputError(f"{source}: config has no {error.args[0]!r}; is this a causal LM config?") from None
    except TypeError as error:
        raise InputError(f"{source}: {error}") from None


def _int(text: Mapping[str, object], key: str, default: int | None = None) -> int:
    """An integer field of a parsed config (`default` when absent or null)."""
    value = text.get(key) if default is not None else text[key]
    if value is None and default is not None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"key {key!r} must be an integer, got {value!r}")
    return int(value)


def _linear_value_dim(text: Mapping[str, object]) -> int:
    """Gated DeltaNet's value width when the config has linear-attention layers (Qwen3.5), else 0."""
    kinds = text.get("layer_types")
    if not isinstance(kinds, list) or "linear_attention" not in kinds:
        return 0
    return _int(text, "linear_num_value_heads", 0) * _int(text, "linear_value_head_dim", 0)


def shape_from_directory(directory: Path, dtype_bytes: int) -> TargetShape:
    from launcher_core.fileio import read_json_object

    config_path = directory / "config.json"
    config = read_json_object(config_path, "a model config")
    return shape_from_config(config, str(config_path), _param_count_on_disk(directory, dtype_bytes))


def _param_count_on_disk(directory: Path, dtype_bytes: int) -> int:
    """Parameters from the safetensors index's total_size (0 when unknown)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size", 0)
        return int(total) // dtype_bytes
    return 0


# The builtin targets' shapes before their directories exist, and the flagship's (any other target).
SMOLLM2_135M = shape_from_config(SMOLLM2_135M_CONFIG, "SmolLM2-135M defaults")
FLAGSHIP_TWIN_SHAPE = shape_from_config(with_layer_types(FLAGSHIP_TEXT), "flagship twin defaults")
QWEN36_27B_LIKE = shape_from_config(with_layer_types(QWEN36_27B_TEXT), "Qwen3.6-27B-like defaults",
                                    param_count=QWEN36_27B_PARAMS)


def target_shape(profile: Profile) -> TargetShape:
    """The profile's target shape, read from disk when possible (never converts or downloads); a target
    not on this machine gets Qwen3.6-27B's, marked assumed (module docstring)."""
    target = profile.model.target
    directory = local_model_dir(target)
    if (directory / "config.json").exists():
        return shape_from_directory(directory, DTYPE_BYTES[profile.model.dtype])
    known = {SMOLLM2: SMOLLM2_135M, FLAGSHIP_TWIN: FLAGSHIP_TWIN_SHAPE}.get(target)
    if known is not None:
        return known
    if directory.exists():
        what = "a directory without config.json" if directory.is_dir() else "not a directory"
        raise ConfigError(f"model.target {target!r}: {directory} is {what}; set model.target to a model directory "
                          f"(config.json and weights), or to a path that is on the GPU node the plan is for")
    return dataclasses.replace(QWEN36_27B_LIKE, source=f"{ASSUMED}: model.target {target!r} is not on this machine, "
                                                       f"so Qwen3.6-27B's published text config stands in for it")


def describe_target(shape: TargetShape) -> str:
    """The plan's line about the target: where its dimensions come from, and what they are."""
    figures = (f"hidden {shape.hidden}, {shape.num_layers} layers, {shape.num_heads} x {shape.head_dim} attention, "
               f"vocabulary {shape.vocab:,}, {shape.total_params() / 1e9:.3g} B parameters")
    if shape.assumed:
        return (f"target: {ASSUMED.upper()}{shape.source.removeprefix(ASSUMED)} ({figures}); the plan holds only for "
                f"a target of this shape: plan where model.target is, or point model.target at its config.json's folder")
    return f"target: {shape.source} ({figures})"
