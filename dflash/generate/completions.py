"""Request bodies and output records: pure functions between prompts, the server and the JSONL.

Output record (one line per prompt id; `tokenize` reads exactly this):
`id`, `messages` (the prompt messages + the assistant message with `content`, and
`reasoning_content` / `tool_calls` when there are any), `tools` (when given), `finish_reason`,
`prompt_tokens`, `completion_tokens`, `model`, `sampling`, `started_at`, `finished_at`.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Required, TypedDict

from dflash.chat import ChatMessage, Tool, ToolCall
from dflash.generate.prompt_files import PromptRecord
from launcher_core.schema import GenerateSection

THINK_END = "</think>"


class CompletionRecord(TypedDict, total=False):
    """One output line (the module docstring's keys, in that order)."""

    id: Required[str]
    messages: Required[list[ChatMessage]]
    tools: list[Tool]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    sampling: dict[str, object]
    started_at: str
    finished_at: str


@dataclass(frozen=True)
class SamplingParams:
    """What every request asks for. `top_k` is not sent to `transformers serve` (it rejects it)."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    thinking: bool

    @classmethod
    def from_section(cls, section: GenerateSection) -> "SamplingParams":
        return cls(section.temperature, section.top_p, section.top_k, section.max_tokens, section.thinking)

    def request_fields(self, backend: str, omit: frozenset[str] = frozenset()) -> dict[str, object]:
        """The sampling fields of a request body, minus those the server rejected (`omit`)."""
        fields: dict[str, object] = {"temperature": self.temperature, "top_p": self.top_p,
                                     "max_tokens": self.max_tokens,
                                     "chat_template_kwargs": {"enable_thinking": self.thinking}}
        if self.top_k > 0:
            fields["top_k"] = self.top_k
        return {key: value for key, value in fields.items() if key not in omit | omitted_for(backend)}

    def recorded(self, backend: str, omit: frozenset[str] = frozenset()) -> dict[str, object]:
        """The sampling parameters as recorded in each output line (what was actually sent)."""
        dropped = omit | omitted_for(backend)
        return {key: value for key, value in asdict(self).items()
                if not (key in dropped or (key == "thinking" and "chat_template_kwargs" in dropped))}


# Optional request fields: sent when the server accepts them, dropped (and not recorded) when it
# answers 4xx naming them. `transformers serve` is known to reject top_k.
OPTIONAL_FIELDS = ("top_k", "chat_template_kwargs")


def omitted_for(backend: str) -> frozenset[str]:
    return frozenset({"top_k"}) if backend == "transformers" else frozenset()


def rejected_optional_field(error_text: str, omit: frozenset[str]) -> str | None:
    """The optional field a 4xx error names (and we still send), if any."""
    return next((name for name in OPTIONAL_FIELDS if name in error_text and name not in omit), None)


def build_request_body(prompt: PromptRecord, sampling: SamplingParams, backend: str,
                       model: str | None, omit: frozenset[str] = frozenset()) -> bytes:
    """The /v1/chat/completions JSON body for one prompt (non-streaming)."""
    body: dict[str, object] = {"messages": list(prompt.messages), **sampling.request_fields(backend, omit)}
    if model:
        body["model"] = model
    if prompt.tools:
        body["tools"] = list(prompt.tools)
        if backend == "vllm":
            # vLLM refuses tools under its default tool_choice "auto" unless it parses calls
            # (--enable-auto-tool-choice --tool-call-parser); with "none" it still renders the tools
            # into the prompt and returns the model's call as text, as `transformers serve` does
            body["tool_choice"] = "none"
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def utc_timestamp(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch_s)) + f".{int(epoch_s % 1 * 1000):03d}Z"


def assistant_message(message: dict[str, Any]) -> ChatMessage:
    """The server's message (its JSON) in our format; reasoning left inline (`<think>...</think>`) is split out."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    if not reasoning and THINK_END in content:
        reasoning, content = split_reasoning(content)
    assistant: ChatMessage = {"role": "assistant", "content": content}
    if reasoning:
        assistant["reasoning_content"] = reasoning
    tool_calls = message.get("tool_calls")
    if tool_calls:
        assistant["tool_calls"] = [normalize_tool_call(call) for call in tool_calls]
    return assistant


def split_reasoning(content: str) -> tuple[str, str]:
    """`<think>R</think>C` (the opening tag optional) -> (R, C), both stripped."""
    reasoning, _, answer = content.partition(THINK_END)
    return reasoning.replace("<think>", "", 1).strip(), answer.strip()


def normalize_tool_call(call: dict[str, Any]) -> ToolCall:
    """OpenAI shape with `arguments` as a JSON string, whatever the server sent (its JSON)."""
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    normalized: ToolCall = {"type": "function", "function": {"name": function.get("name", ""), "arguments": arguments}}
    if call.get("id"):
        normalized["id"] = call["id"]
    return normalized


def completion_record(prompt: PromptRecord, response: dict[str, Any], sampling: dict[str, object],
                      started_s: float, finished_s: float, fallback_model: str) -> CompletionRecord:
    """One output line from a prompt and the server's parsed response (its JSON)."""
    choice = response["choices"][0]
    usage = response.get("usage") or {}
    record: CompletionRecord = {
        "id": prompt.id,
        "messages": [*prompt.messages, assistant_message(choice["message"])],
    }
    if prompt.tools:
        record["tools"] = list(prompt.tools)
    record.update({
        "finish_reason": choice.get("finish_reason") or "unknown",
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "model": response.get("model") or fallback_model,
        "sampling": sampling,
        "started_at": utc_timestamp(started_s),
        "finished_at": utc_timestamp(finished_s),
    })
    return record
