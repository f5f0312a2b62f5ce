"""The target's tokenizer, loaded one way for every stage that needs it (tokenize and eval).

`tokenizer_dir_for(profile)`: `model.tokenizer` if set, else the target model's directory.
`load_tokenizer(directory)`: its fast tokenizer with a chat template, from local files only, loaded
once per process and directory state; a directory without one is a ConfigError that says what to set.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from launcher_core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from launcher_core.schema import Profile

_TOKENIZERS: dict[tuple[object, ...], PreTrainedTokenizerFast] = {}


def tokenizer_dir_for(profile: Profile) -> Path:
    """`model.tokenizer` if set, else the target model's directory."""
    from dflash.models import resolve_model_path

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
