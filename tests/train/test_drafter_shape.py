"""Drafter shape policy: hidden size from the target; attention heads, head dim (<= 128) and plain
RoPE are the drafter's own; config.json carries them where loaders read them; under bf16
autocast the attention inputs are bf16."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

from dflash.drafter.network import DFlashDrafter, drafter_config
from dflash.drafter.shape import DrafterShape, derive_shape, profile_shape
from launcher_core.errors import ConfigError


def wide_target_config() -> Qwen3Config:
    """Qwen3.6-27B's full-attention shape (24 x 256, 4 KV heads, theta 1e7), scaled down in width."""
    return Qwen3Config(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=256,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def test_head_dim_is_capped_at_128_keeping_the_targets_query_and_kv_widths():
    shape = derive_shape(wide_target_config())
    assert shape == DrafterShape(num_attention_heads=12, num_key_value_heads=4, head_dim=128, rope_theta=1e7)


def test_profile_values_override_the_derived_shape_and_are_checked():
    assert derive_shape(wide_target_config(), DrafterShape(32, 8, 128)) == DrafterShape(32, 8, 128, 1e7)
    assert derive_shape(wide_target_config(), DrafterShape(rope_theta=5e5)).rope_theta == 5e5
    with pytest.raises(ConfigError, match="drafter.num_key_value_heads: 4 does not divide drafter.num_attention_heads 10"):
        derive_shape(wide_target_config(), DrafterShape(num_attention_heads=10, num_key_value_heads=4))


def test_a_derived_odd_head_dim_is_refused_by_the_schemas_rule():
    """A head dim derived from the target (the profile left it 0) is held to the same rule as one set."""
    config = wide_target_config()
    config.head_dim = 63
    with pytest.raises(ConfigError, match=r"drafter.head_dim: 63 is odd; valid: an even number .*as derived from the target"):
        derive_shape(config)


def test_a_config_json_mapping_gives_the_shape_of_the_config_object():
    """The memory model reads config.json as a dict (multimodal: a nested text_config)."""
    document = {"model_type": "qwen3_5", "text_config": wide_target_config().to_dict()}
    assert derive_shape(document) == derive_shape(wide_target_config())
    assert derive_shape(document, DrafterShape(32, 8, 128)) == DrafterShape(32, 8, 128, 1e7)
    top_level_theta = {"hidden_size": 96, "num_attention_heads": 6, "rope_theta": 5e5}
    assert derive_shape(top_level_theta) == DrafterShape(6, 6, 16, 5e5)      # no KV heads: as many as queries


def test_the_shape_module_imports_neither_torch_nor_transformers():
    import subprocess
    import sys

    code = ("import sys, dflash.drafter.shape; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_flagship_profile_asks_for_32_heads_of_128_with_8_kv_heads():
    from launcher_core.profile import load_profile

    profile = load_profile("rtx6000-x8")
    assert profile_shape(profile.drafter) == DrafterShape(32, 8, 128, 0.0)
    assert load_profile("b200-x8").drafter.head_dim == 128          # variants inherit it


def test_config_has_plain_rope_with_top_level_rope_theta(tmp_path):
    from dflash.drafter.checkpoint_files import config_document

    config = drafter_config(wide_target_config(), num_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=7)
    document = config_document(config)
    assert document["rope_theta"] == 1e7 and document["rope_scaling"] is None
    assert document["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e7}
    assert (document["hidden_size"], document["head_dim"], document["num_attention_heads"]) == (96, 128, 12)
    assert "mrope_section" not in json.dumps(document) and "partial_rotary_factor" not in json.dumps(document)


def test_attention_inputs_are_bf16_under_autocast():
    config = drafter_config(wide_target_config(), num_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=7)
    drafter = DFlashDrafter(config)
    drafter.attach_target(_TinyTarget(config.vocab_size, config.hidden_size))
    seen = []

    def attend(q, k, v):
        seen.append((q.dtype, k.dtype, v.dtype))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        drafter(torch.tensor([[5, 7, 7, 7]]), torch.randn(1, 3, 96), torch.arange(7)[None], attend)
    assert seen == [(torch.bfloat16,) * 3]


class _TinyTarget(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head
