"""Completion records: parse one JSONL line, validate it, or say precisely why it is rejected.

A record is `{"id", "messages", "tools"?, "finish_reason"?, "chat_template_kwargs"?, ...}` with
OpenAI-style messages (system/user/assistant/tool). Of the rest, only the generation settings in
`sampling` are kept (the dataset's meta records them); model, timestamps, token counts are ignored. A bad record never raises: it becomes a `Reject` with a
reason code (see `REJECT_REASONS`) that the tokenize summary counts and `RejectsFile` writes.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dflash.chat import ChatMessage, Tool, ToolCall
from dflash.data.rendering_record import generation_settings

ROLES = ("system", "user", "assistant", "tool")

# reason code -> what it means (docs/data.md lists the same table)
REJECT_REASONS: dict[str, str] = {
    "invalid_json": "the line is not valid JSON",
    "not_an_object": "the line is JSON but not an object",
    "missing_id": "no `id` (a string or an integer)",
    "duplicate_id": "the same `id` appeared earlier in the input",
    "missing_messages": "`messages` is missing, not a list, or empty",
    "bad_message": "a message is not an object",
    "missing_role": "a message has no `role`",
    "unknown_role": "a message's role is not one of system/user/assistant/tool",
    "bad_content": "a message's content is not a string (or null on an assistant turn)",
    "bad_tool_calls": "`tool_calls` is not a list of {function: {name, arguments}}",
    "bad_tools": "`tools` is not a list of objects",
    "no_assistant_turn": "the conversation has no assistant turn to learn from",
    "template_error": "the chat template raised an error on this conversation",
    "template_inconsistent": "the template's generation prompt is not a prefix of its own rendering of the turn",
    "template_drops_fields": "the template does not render the turn's reasoning, content or tool calls",
    "empty_file": "an input file holds no records",
    "record_too_long": "the line is longer than 64 bytes per token of data.max_length (not rendered)",
}


@dataclass(frozen=True)
class Reject:
    """A record that could not be used; written to the rejects file."""

    source: str
    line: int
    reason: str
    detail: str
    id: str | None = None

    def as_json(self) -> dict[str, str | int | None]:
        return {"source": self.source, "line": self.line, "reason": self.reason,
                "detail": self.detail, "id": self.id}


@dataclass(frozen=True)
class Conversation:
    """A validated completion record, ready to render."""

    id: str
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    finish_reason: str = ""
    template_kwargs: dict[str, object] = field(default_factory=dict)   # the record's chat_template_kwargs
    sampling: tuple[tuple[str, object], ...] = ()   # the generation settings its `sampling` records (rendering.GENERATION_KEYS)

    def assistant_indices(self) -> list[int]:
        return [i for i, message in enumerate(self.messages) if message["role"] == "assistant"]


class RecordProblem(Exception):
    """Internal: raised while validating; turned into a Reject by `parse_record`."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(detail)
        self.reason = reason


def parse_record(line: str, source: str, line_number: int) -> Conversation | Reject:
    """One JSONL line -> a Conversation, or a Reject naming the line and the reason."""
    record_id = None
    try:
        record = _load_object(line)
        record_id = _record_id(record)
        return _conversation(record, record_id)
    except RecordProblem as problem:
        return Reject(source, line_number, problem.reason, str(problem), record_id)


def _load_object(line: str) -> dict[str, object]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise RecordProblem("invalid_json", f"not valid JSON: {error.msg} at column {error.colno}") from None
    if not isinstance(record, dict):
        raise RecordProblem("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    return record


def _record_id(record: dict[str, object]) -> str:
    value = record.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise RecordProblem("missing_id", f"`id` must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _conversation(record: dict[str, object], record_id: str) -> Conversation:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RecordProblem("missing_messages", f"`messages` must be a non-empty list, got {_short(messages)}")
    clean = [_message(message, index) for index, message in enumerate(messages)]
    if not any(message["role"] == "assistant" for message in clean):
        raise RecordProblem("no_assistant_turn", f"roles are {[m['role'] for m in clean]}; no assistant turn")
    kwargs = record.get("chat_template_kwargs")
    return Conversation(id=record_id, messages=clean, tools=_tools(record.get("tools")),
                        finish_reason=_finish_reason(record.get("finish_reason")),
                        template_kwargs=dict(kwargs) if isinstance(kwargs, dict) else {},
                        sampling=generation_settings(record.get("sampling")))


def _message(message: object, index: int) -> ChatMessage:
    if not isinstance(message, dict):
        raise RecordProblem("bad_message", f"messages[{index}] is {type(message).__name__}, not an object")
    role = message.get("role")
    if role is None:
        raise RecordProblem("missing_role", f"messages[{index}] has no `role`")
    if role not in ROLES:
        raise RecordProblem("unknown_role", f"messages[{index}].role is {_short(role)}; valid: {', '.join(ROLES)}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise RecordProblem("bad_content", f"messages[{index}].content ({role}) is {_short(content)}, not a string")
    clean: ChatMessage = {"role": role, "content": content}
    if role == "assistant":
        _add_assistant_fields(clean, message, index)
    name, call_id = message.get("name"), message.get("tool_call_id")
    if isinstance(name, str):
        clean["name"] = name
    if isinstance(call_id, str):
        clean["tool_call_id"] = call_id
    return clean


def _add_assistant_fields(clean: ChatMessage, message: dict[str, object], index: int) -> None:
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RecordProblem("bad_content", f"messages[{index}].reasoning_content is {_short(reasoning)}, not a string")
        clean["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        clean["tool_calls"] = _tool_calls(message["tool_calls"], index)


def _tool_calls(calls: object, index: int) -> list[ToolCall]:
    if not isinstance(calls, list):
        raise RecordProblem("bad_tool_calls", f"messages[{index}].tool_calls is {_short(calls)}, not a list")
    for position, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", {}), (str, dict)):
            raise RecordProblem("bad_tool_calls", f"messages[{index}].tool_calls[{position}] needs "
                                f"{{function: {{name: str, arguments: str|object}}}}, got {_short(call)}")
    return calls


def _tools(tools: object) -> list[Tool] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecordProblem("bad_tools", f"`tools` must be a list of objects, got {_short(tools)}")
    return tools


def _finish_reason(value: object) -> str:
    return value if isinstance(value, str) else ""


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RejectsFile:
    """Rejected records, one JSON line each, written to a temp file in the staging directory (a
    killed run's is swept with it) and renamed into place."""

    def __init__(self, path: Path, staging: Path):
        self.path = path
        self.temp = staging / f".{path.name}.tmp"
        self.counts: Counter[str] = Counter()
        self.by_source: Counter[tuple[str, str]] = Counter()     # (input file, reason) -> rejects

    def __enter__(self) -> "RejectsFile":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = self.temp.open("w", encoding="utf-8")
        return self

    def add(self, reject: Reject) -> None:
        self.counts[reject.reason] += 1
        self.by_source[(reject.source, reject.reason)] += 1
        self.handle.write(json.dumps(reject.as_json(), ensure_ascii=False) + "\n")

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
        if exc[0] is None:
            os.replace(self.temp, self.path)
        else:
            self.temp.unlink(missing_ok=True)
