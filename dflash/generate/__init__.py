"""Generation: prompts JSONL -> completions JSONL through SGLang, `transformers serve` or endpoints.

`generate_from_profile(profile, ...) -> GenerateSummary` is the entry point the CLI and the
pipeline call. Importing this package imports nothing heavy (aiohttp/tqdm load when a run starts).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.generate.generation_run import GenerateSummary, generate_from_profile

__all__ = ["GenerateSummary", "generate_from_profile"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from dflash.generate import generation_run

        return getattr(generation_run, name)
    raise AttributeError(name)
