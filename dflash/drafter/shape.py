"""The drafter's own attention shape: one torch-free fact for the model, the trainer and the memory model.

The hidden size, vocabulary and MLP width always follow the target; the attention heads, KV heads,
head dim and RoPE base are the drafter's (`[drafter]` `num_attention_heads`, `num_key_value_heads`,
`head_dim`, `rope_theta`; 0 = derive from the target). Target configs are read either as a
transformers config object or as a plain `config.json` mapping (a nested `text_config`, as in
multimodal checkpoints, is used when there is one). No torch or transformers import here:
`launcher.py plan` reads the shape in the launcher process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from launcher_core.errors import ConfigError
from launcher_core.schema import attention_shape_problems

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from launcher_core.schema import DrafterSection

    TargetConfig = PretrainedConfig | Mapping[str, Any]     # a config object, or config.json parsed

MAX_HEAD_DIM = 128          # flex_attention's bf16 backward on SM12x needs head dim <= 128 (shared memory)
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's own attention shape and RoPE (the hidden size always follows the target).

    0 means "derive from the target" (`derive_shape`): head dim min(target's, 128), the target's
    query and KV widths kept (heads scaled by target head dim / head dim), plain RoPE with the
    target's base frequency. Partial rotary and M-RoPE of the target are never copied.
    """

    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 0.0

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (and of o_proj's input)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key and of the value projection's output."""
        return self.num_key_value_heads * self.head_dim


def text_config(target_config: TargetConfig) -> TargetConfig:
    """The language model's part of a config (object or mapping): `text_config` when nested."""
    if isinstance(target_config, Mapping):
        return target_config.get("text_config") or target_config
    if hasattr(target_config, "get_text_config"):
        return target_config.get_text_config()
    return getattr(target_config, "text_config", None) or target_config


def config_value(config: TargetConfig, key: str, default: Any = None) -> Any:
    """`config[key]` of a mapping or `config.key` of a config object; `default` when absent or None."""
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def target_rope_theta(target_config: TargetConfig) -> float:
    """The target's RoPE base frequency (transformers 5 `rope_parameters` or a top-level `rope_theta`)."""
    text = text_config(target_config)
    rope = config_value(text, "rope_parameters", {})
    theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    return float(theta or config_value(text, "rope_theta") or DEFAULT_ROPE_THETA)


def target_head_dim(target_config: TargetConfig) -> int:
    """The target's attention head dim: `head_dim`, else hidden size / heads."""
    text = text_config(target_config)
    heads = int(config_value(text, "num_attention_heads"))
    return int(config_value(text, "head_dim") or int(config_value(text, "hidden_size")) // heads)


def derive_shape(target_config: TargetConfig, wanted: DrafterShape = DrafterShape()) -> DrafterShape:
    """Fill the zero fields of `wanted` from the target (see DrafterShape); checks the result."""
    text = text_config(target_config)
    heads = int(config_value(text, "num_attention_heads"))
    kv_heads = int(config_value(text, "num_key_value_heads", heads))
    own_head_dim = target_head_dim(text)
    head_dim = wanted.head_dim or min(own_head_dim, MAX_HEAD_DIM)
    scale = own_head_dim / head_dim
    shape = DrafterShape(
        num_attention_heads=wanted.num_attention_heads or max(1, round(heads * scale)),
        num_key_value_heads=wanted.num_key_value_heads or max(1, round(kv_heads * scale)),
        head_dim=head_dim, rope_theta=wanted.rope_theta or target_rope_theta(text))
    check_shape(shape)
    return shape


def check_shape(shape: DrafterShape) -> None:
    """A usable attention shape (the schema's rule, launcher_core.schema.attention_shape_problems, on the
    shape as derived from the target): whole query groups per KV head, an even head dim."""
    problems = attention_shape_problems(shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim)
    if problems:
        key, problem = problems[0]
        raise ConfigError(f"{key}: {problem} (the drafter's shape as derived from the target: "
                          f"{shape.num_attention_heads} heads, {shape.num_key_value_heads} KV heads, head dim "
                          f"{shape.head_dim})")


def profile_shape(drafter_section: DrafterSection) -> DrafterShape:
    """The profile's `[drafter]` shape keys (0 = derive from the target)."""
    return DrafterShape(num_attention_heads=drafter_section.num_attention_heads,
                        num_key_value_heads=drafter_section.num_key_value_heads,
                        head_dim=drafter_section.head_dim, rope_theta=drafter_section.rope_theta)
