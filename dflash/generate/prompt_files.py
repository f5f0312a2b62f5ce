"""Prompts JSONL: one object per line with `id` and `messages` (or a plain `prompt`), optional `tools`.

Every problem is an InputError naming the file, the line and what would be valid. Ids must be
unique: the output holds exactly one completion per id.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dflash.chat import ChatMessage, Tool
from launcher_core.errors import InputError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its id, the conversation so far, and the tools the model may call."""

    id: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...] = field(default=())


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """Read and validate a prompts JSONL file (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: prompts file not found (set paths.prompts in the profile or pass --input)")
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    for line_number, document in _json_lines(path):
        record = parse_prompt(document, f"{path}: line {line_number}")
        if record.id in seen:
            raise InputError(f"{path}: line {line_number}: duplicate id {record.id!r} (first on line {seen[record.id]})")
        seen[record.id] = line_number
        records.append(record)
    if not records:
        raise InputError(f"{path}: no prompts in the file")
    return records


def _json_lines(path: Path) -> Iterator[tuple[int, object]]:
    with path.open("r", encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}: line {line_number}: not valid JSON ({error.msg})") from None


def parse_prompt(document: object, where: str) -> PromptRecord:
    """One JSON object -> PromptRecord; `where` prefixes every error ("FILE: line N")."""
    if not isinstance(document, dict):
        raise InputError(f"{where}: expected a JSON object with 'id' and 'messages' or 'prompt'")
    unknown = set(document) - {"id", "messages", "prompt", "tools", "metadata"}
    if unknown:
        raise InputError(f"{where}: unknown field(s) {sorted(unknown)}; valid: id, messages, prompt, tools, metadata")
    prompt_id = _prompt_id(document.get("id"), where)
    messages = _messages(document, where)
    tools = _tools(document.get("tools"), where)
    return PromptRecord(id=prompt_id, messages=messages, tools=tools)


def _prompt_id(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise InputError(f"{where}: field 'id' must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _messages(document: dict[str, object], where: str) -> tuple[ChatMessage, ...]:
    has_messages, has_prompt = "messages" in document, "prompt" in document
    if has_messages == has_prompt:
        raise InputError(f"{where}: give exactly one of 'messages' (a list of {{role, content}}) or 'prompt' (a string)")
    if has_prompt:
        prompt = document["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"{where}: field 'prompt' must be a non-empty string")
        return ({"role": "user", "content": prompt},)
    messages = document["messages"]
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    for index, message in enumerate(messages):
        _check_message(message, f"{where}: messages[{index}]")
    if messages[-1]["role"] == "assistant":
        raise InputError(f"{where}: the last message is the assistant's; the prompt must end with a user or tool turn")
    return tuple(messages)


def _check_message(message: object, where: str) -> None:
    if not isinstance(message, dict):
        raise InputError(f"{where}: expected an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise InputError(f"{where}: field 'role' is {role!r}; valid: {', '.join(ROLES)}")
    content = message.get("content")
    if not isinstance(content, str) and not (role == "assistant" and content is None and message.get("tool_calls")):
        raise InputError(f"{where}: field 'content' must be a string")


def _tools(value: object, where: str) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InputError(f"{where}: field 'tools' must be a list of OpenAI tool objects")
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InputError(f"{where}: tools[{index}] must look like "
                             "{\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}")
    return tuple(value)
