"""How a dataset's completions were rendered: the `rendering` block of its dflash_meta.json.

tokenize counts, per record, the `enable_thinking` the chat template was rendered with (the record's
own `chat_template_kwargs`, else on when a turn has reasoning, else `generate.thinking`;
dflash.data.chat_render) and the generation settings the record's `sampling` says it was generated with.
eval renders its prompts in the same mode and refuses another one (dflash.eval.mode): a drafter
trained on thinking-off text and served thinking on (or the reverse) loses most of its acceptance.

The training data's record (`TrainingDataRecord`: the dataset, its meta, the block) goes with the drafter:
`train` writes it into its run (train/training_data.json), rank 0 copies it into every checkpoint and
`export` into the exported drafter, so eval compares with the data the drafter was trained on wherever it
is moved. A block that is there but damaged (not JSON, a field of the wrong type) is an InputError naming
the file and the field: never taken for a dataset without one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, TypedDict, cast

from launcher_core.errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ThinkingMode = Literal["on", "off", "mixed"]
# The `sampling` keys of a completion record (dflash.generate.completions.SamplingParams) that shape the text.
GENERATION_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "thinking")


class RenderingBlock(TypedDict):
    chat_template_fingerprint: str          # sha256 of the chat template the completions were rendered with
    thinking: ThinkingMode                  # enable_thinking of every record: on, off, or both (mixed)
    records_by_thinking: dict[str, int]     # {"on": n, "off": m}
    generation: dict[str, list[object]]     # each GENERATION_KEYS key's distinct values in the records' `sampling`
    records_without_sampling: int           # records that carry no `sampling` (not from `generate`)


class TrainingDataRecord(TypedDict):
    dataset: str                            # the dataset's directory as the run read it
    meta: str                               # its dflash_meta.json
    rendering: Optional[RenderingBlock]     # None: the meta is missing or predates the block


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


MODES = ("on", "off", "mixed")
DAMAGED = "a damaged dataset meta: restore it, or re-run tokenize to write it again"


def read_rendering(meta_path: Path) -> Optional[RenderingBlock]:
    """The meta's `rendering` block; None when the file is missing or has no block (written before it).
    InputError naming the file and field when it is not JSON or the block is damaged."""
    from launcher_core.fileio import read_json_object

    if not meta_path.is_file():
        return None
    block = read_json_object(meta_path, "a dataset's meta").get("rendering")
    return None if block is None else checked_rendering(block, f"{meta_path}: rendering")


def checked_rendering(block: object, where: str) -> RenderingBlock:
    """`block` as a RenderingBlock; InputError naming `where` and the field that is wrong."""
    problem = rendering_problem(block)
    if problem:
        raise InputError(f"{where}{problem} ({DAMAGED})")
    return cast(RenderingBlock, block)


def rendering_problem(block: object) -> str:
    """`.thinking = "maybe"; valid: on, off, mixed` for the first field that is wrong ("" when none is)."""
    if not isinstance(block, dict):
        return f" is a JSON {type(block).__name__}, not an object"
    counts = block.get("records_by_thinking")
    checks = [("thinking", block.get("thinking") in MODES, "on, off, mixed"),
              ("chat_template_fingerprint", isinstance(block.get("chat_template_fingerprint"), str), "a string"),
              ("records_by_thinking", isinstance(counts, dict) and set(counts) <= {"on", "off"}
               and all(_count(value) for value in counts.values()), '{"on": N, "off": M}, counts of records'),
              ("generation", isinstance(block.get("generation", {}), dict), "an object of lists"),
              ("records_without_sampling", _count(block.get("records_without_sampling", 0)), "a count of records")]
    for name, good, valid in checks:
        if not good:
            return f".{name} = {json.dumps(block.get(name))}; valid: {valid}"
    assert isinstance(counts, dict)
    if sum(counts.values()) and thinking_mode(counts) != block["thinking"]:
        return (f'.thinking = "{block["thinking"]}" disagrees with .records_by_thinking = {json.dumps(counts)} '
                f'("{thinking_mode(counts)}")')
    return ""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def training_data_record(meta: Path) -> TrainingDataRecord:
    """What a drafter carries of the data it was trained on, from the dataset's dflash_meta.json (InputError on a
    damaged one)."""
    return {"dataset": str(meta.parent), "meta": str(meta), "rendering": read_rendering(meta)}


def read_training_data_record(path: Path) -> TrainingDataRecord:
    """A drafter's training_data.json; InputError naming the file and field when it is damaged."""
    from launcher_core.fileio import read_json_object

    document = read_json_object(path, "a drafter's training data record")
    for key in ("dataset", "meta"):
        if not isinstance(document.get(key), str):
            raise InputError(f"{path}: {key} = {json.dumps(document.get(key))}; valid: a path (a damaged record: "
                             f"export the drafter again from its checkpoint)")
    block = document.get("rendering")
    rendering = None if block is None else checked_rendering(block, f"{path}: rendering")
    return {"dataset": document["dataset"], "meta": document["meta"], "rendering": rendering}


def thinking_share(block: RenderingBlock, thinking: bool) -> Optional[float]:
    """The share of the data's records rendered with `thinking` (None: the block counts no records)."""
    counts = block["records_by_thinking"]
    total = sum(counts.values())
    return counts.get("on" if thinking else "off", 0) / total if total else None
