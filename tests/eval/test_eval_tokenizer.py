"""One tokenizer loader (dflash.tokenizer) for tokenize and eval: both stages get the same tokenizer
object for a profile (the real Qwen3 tokenizer here), found the same way (`model.tokenizer`, else
the target's directory), and a directory that cannot serve the chat template is named."""
from __future__ import annotations

import json
import shutil

import pytest
from test_eval_command import write_eval_profile

from launcher_core.errors import ConfigError
from launcher_core.profile import load_profile


def test_eval_and_tokenize_load_the_same_tokenizer(tiny_qwen3_target, tmp_path):
    import dflash.data.tokenize as tokenize
    from dflash.eval.evaluate import encode_prompts, load_target
    from dflash.eval.options import DEFAULT_EVAL_PROMPTS
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for

    profile = load_profile(str(write_eval_profile(tmp_path, tiny_qwen3_target, "")))
    _, tokenizer, target_dir = load_target(profile)
    assert tokenize.load_tokenizer is load_tokenizer and tokenize.tokenizer_dir_for is tokenizer_dir_for
    assert tokenizer is load_tokenizer(tokenizer_dir_for(profile)) and tokenizer_dir_for(profile) == target_dir
    [prompt] = encode_prompts(tokenizer, DEFAULT_EVAL_PROMPTS, 1, thinking=False)
    text = tokenizer.decode(prompt.token_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_model_tokenizer_overrides_the_targets_directory_for_both_stages(tiny_qwen3_target, qwen3_tokenizer_dir, tmp_path):
    from dflash.eval.evaluate import load_target
    from dflash.tokenizer import load_tokenizer

    profile_path = write_eval_profile(tmp_path, tiny_qwen3_target, "")
    profile_path.write_text(profile_path.read_text().replace("[model]\n", f'[model]\ntokenizer = "{qwen3_tokenizer_dir}"\n'))
    _, tokenizer, _ = load_target(load_profile(str(profile_path)))
    assert tokenizer is load_tokenizer(qwen3_tokenizer_dir)


def test_a_tokenizer_without_a_chat_template_is_named(qwen3_tokenizer_dir, tmp_path):
    from dflash.tokenizer import load_tokenizer

    copy = shutil.copytree(qwen3_tokenizer_dir, tmp_path / "tok")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"the tokenizer in {copy} has no chat template; set model.tokenizer"):
        load_tokenizer(copy)
    with pytest.raises(ConfigError, match=r"cannot load a tokenizer from"):
        load_tokenizer(tmp_path / "missing")
