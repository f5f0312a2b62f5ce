"""The target's tokenizer, loaded one way for every stage that needs it (tokenize and eval).

`tokenizer_dir_for(profile)`: `model.tokenizer` if set, else the target model's directory.
`load_tokenizer(directory)`: its fast tokenizer with a chat template, from local files only, loaded
once per process and directory state; a directory without one is a ConfigError that says what to set.
`tokenizer_mask_token_id(directory)`: its mask token's id, read from its files without loading it (the
launch checks and each rank resolve drafter.mask_token_id with it when the profile leaves it unset).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from launcher_core.errors import ConfigError
from launcher_core.fileio import json_object_or_empty

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from launcher_core.schema import Profile

_TOKENIZERS: dict[tuple[object, ...], PreTrainedTokenizerFast] = {}


def tokenizer_dir_for(profile: Profile) -> Path:
    """`model.tokenizer` if set, else the target model's directory."""
    from dflash.target_model import resolve_model_path

    return resolve_model_path(profile.model.tokenizer or profile.model.target)


def load_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer in `directory` (loaded once per process and directory state)."""
    key = _directory_state(Path(directory))
    if key not in _TOKENIZERS:
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = _load_tokenizer(Path(directory))
    return _TOKENIZERS[key]


def _directory_state(directory: Path) -> tuple[object, ...]:
    files = sorted(directory.glob("*")) if directory.is_dir() else []
    return (str(directory.resolve()), *((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files if p.is_file()))


def _load_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load a tokenizer from {directory}: {error}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"the tokenizer in {directory} has no chat template; set model.tokenizer to a "
                          "directory whose tokenizer_config.json (or chat_template.jinja) has one")
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ConfigError(f"the tokenizer in {directory} is not a fast tokenizer (no tokenizer.json)")
    return tokenizer


def tokenizer_mask_token_id(directory: Path) -> Optional[int]:
    """The tokenizer's mask token id from its files (tokenizer_config.json / special_tokens_map.json
    name it; tokenizer.json or added_tokens_decoder give its id); None when it has none."""
    config = json_object_or_empty(directory / "tokenizer_config.json")
    content = _token_content(config.get("mask_token")) or _token_content(
        json_object_or_empty(directory / "special_tokens_map.json").get("mask_token"))
    if not content:
        return None
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        if _token_content(entry) == content:
            return int(token_id)
    tokenizer = json_object_or_empty(directory / "tokenizer.json")
    for entry in tokenizer.get("added_tokens") or []:
        if entry.get("content") == content:
            return int(entry["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return int(vocab[content]) if isinstance(vocab, dict) and content in vocab else None


def _token_content(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return value if isinstance(value, str) else ""
