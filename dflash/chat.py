"""The OpenAI chat shapes that generation writes and tokenize reads: messages and tool calls.

They are JSON on disk and on the wire; these TypedDicts name their keys for the type checker.
A tool definition (`tools`) is passed through to the server and the chat template unread.
"""
from __future__ import annotations

from typing import Required, TypedDict

Tool = dict[str, object]    # an OpenAI tool definition: {"type": "function", "function": {...}}


class ToolFunction(TypedDict):
    name: str
    arguments: str | dict[str, object]     # a JSON string in our records; some inputs give an object


class ToolCall(TypedDict, total=False):
    type: str
    id: str
    function: Required[ToolFunction]


class ChatMessage(TypedDict, total=False):
    role: Required[str]                    # system, user, assistant or tool
    content: Required[str | None]          # None only on an assistant turn that calls tools
    reasoning_content: str
    tool_calls: list[ToolCall]
    name: str
    tool_call_id: str
