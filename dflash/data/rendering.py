"""How a dataset's completions were rendered: the `rendering` block of its dflash_meta.json.

tokenize counts, per record, the `enable_thinking` the chat template was rendered with (the record's
own `chat_template_kwargs`, else on when a turn has reasoning, else `generate.thinking`;
dflash.data.render) and the generation settings the record's `sampling` says it was generated with.
eval renders its prompts in the same mode and refuses another one (dflash.eval.mode): a drafter
trained on thinking-off text and served thinking on (or the reverse) loses most of its acceptance.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ThinkingMode = Literal["on", "off", "mixed"]
# The `sampling` keys of a completion record (dflash.generate.records.SamplingParams) that shape the text.
GENERATION_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "thinking")


class RenderingBlock(TypedDict):
    chat_template_fingerprint: str          # sha256 of the chat template the completions were rendered with
    thinking: ThinkingMode                  # enable_thinking of every record: on, off, or both (mixed)
    records_by_thinking: dict[str, int]     # {"on": n, "off": m}
    generation: dict[str, list[object]]     # each GENERATION_KEYS key's distinct values in the records' `sampling`
    records_without_sampling: int           # records that carry no `sampling` (not from `generate`)


def thinking_mode(records_by_thinking: Mapping[str, int]) -> ThinkingMode:
    on, off = records_by_thinking.get("on", 0), records_by_thinking.get("off", 0)
    return "mixed" if on and off else ("on" if on else "off")


def generation_settings(sampling: object) -> tuple[tuple[str, object], ...]:
    """The settings that matter from a record's `sampling` (its JSON object; anything else: none)."""
    if not isinstance(sampling, dict):
        return ()
    return tuple((key, sampling[key]) for key in GENERATION_KEYS if key in sampling)


@dataclass
class RenderingTally:
    """Counts records as tokenize renders them; `block` is what the meta records."""

    records_by_thinking: dict[str, int] = field(default_factory=lambda: {"on": 0, "off": 0})
    generation: dict[str, list[object]] = field(default_factory=dict)
    records_without_sampling: int = 0

    def add(self, thinking: bool, settings: tuple[tuple[str, object], ...]) -> None:
        self.records_by_thinking["on" if thinking else "off"] += 1
        if not settings:
            self.records_without_sampling += 1
        for key, value in settings:
            _add_distinct(self.generation.setdefault(key, []), [value])

    def block(self, chat_template_fingerprint: str) -> RenderingBlock:
        return {"chat_template_fingerprint": chat_template_fingerprint,
                "thinking": thinking_mode(self.records_by_thinking),
                "records_by_thinking": dict(self.records_by_thinking),
                "generation": {key: self.generation[key] for key in GENERATION_KEYS if key in self.generation},
                "records_without_sampling": self.records_without_sampling}


def merged_rendering(base: RenderingBlock | None, add: RenderingBlock | None) -> RenderingBlock | None:
    """Two datasets' blocks as one: counts added, distinct settings united, mode mixed if they differ.
    None when either predates the block (what the other half was rendered with is not known)."""
    if base is None or add is None:
        return None
    counts = {mode: base["records_by_thinking"].get(mode, 0) + add["records_by_thinking"].get(mode, 0)
              for mode in ("on", "off")}
    generation = {key: list(values) for key, values in base["generation"].items()}
    for key, values in add["generation"].items():
        _add_distinct(generation.setdefault(key, []), values)
    return {"chat_template_fingerprint": base["chat_template_fingerprint"], "thinking": thinking_mode(counts),
            "records_by_thinking": counts,
            "generation": {key: generation[key] for key in GENERATION_KEYS if key in generation},
            "records_without_sampling": base["records_without_sampling"] + add["records_without_sampling"]}


def _add_distinct(values: list[object], new: list[object]) -> None:
    seen = {json.dumps(value, sort_keys=True) for value in values}
    for value in new:
        if json.dumps(value, sort_keys=True) not in seen:
            seen.add(json.dumps(value, sort_keys=True))
            values.append(value)


def describe_rendering(block: RenderingBlock) -> str:
    """`thinking off (526 records), chat template 872be49d, temperature 0.0, top_p 0.95, ...`"""
    counts = block["records_by_thinking"]
    thinking = (f"thinking mixed ({counts.get('on', 0)} records on, {counts.get('off', 0)} off)"
                if block["thinking"] == "mixed" else f"thinking {block['thinking']} ({sum(counts.values())} records)")
    settings = ", ".join(f"{key} {'/'.join(str(v) for v in values)}" for key, values in block["generation"].items()
                         if key != "thinking")
    return f"{thinking}, chat template {short_fingerprint(block['chat_template_fingerprint'])}" + \
        (f", generated with {settings}" if settings else "")


def chat_template_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's chat template (tokenize records it; eval compares it)."""
    return hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()


def short_fingerprint(fingerprint: str) -> str:
    return fingerprint[:8]
