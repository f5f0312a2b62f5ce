"""Render a conversation with the target's own chat template and find the loss spans, in characters.

The loss of assistant turn t starts right after `render(messages[:t], add_generation_prompt=True)`
and ends at the end of `render(messages[:t+1])` less the template's trailing whitespace: it covers
the thinking block, tool calls and the end-of-turn token (`<|im_end|>`), i.e. what the model
generates. The text is tokenized once, later; only these few renderings happen per conversation.

Templates may rewrite earlier turns (Qwen3 drops the reasoning of turns before the last user
message). A turn is masked in a text only where that text agrees, character for character, with
the turn as the model produced it. A rewritten turn becomes context in the full conversation and
gets a sample of its own (`rewritten_turns = "split"`, id `ID#<message index>`), or stays
context only (`"context"`). A template that does not render a turn's reasoning, content or tool
calls at all (SmolLM2's template has no tool calls) rejects the record: never a silent mis-mask.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping

from dflash.chat import ChatMessage, Tool, ToolCall
from dflash.data.conversations import Conversation, RecordProblem

if TYPE_CHECKING:
    from jinja2 import Template
    from transformers import PreTrainedTokenizerBase

RewrittenTurns = Literal["split", "context"]
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class TurnSpan:
    """Assistant message `index` as the model produced it: `through[start:end]` is the loss."""

    index: int
    through: str
    start: int
    end: int

    def agrees_with(self, text: str) -> bool:
        return text.startswith(self.through[: self.end])


@dataclass(frozen=True)
class RenderedText:
    """One sample's text and its loss spans (character offsets into `text`)."""

    id: str
    text: str
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RenderedConversation:
    texts: tuple[RenderedText, ...]
    tool_call_repeats: int
    empty_reasoning: bool
    context_only_turns: int


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template (`apply_chat_template`, text only)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, thinking_default: bool = True,
                 rewritten_turns: RewrittenTurns = "split"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.thinking_default = thinking_default
        self.rewritten_turns = rewritten_turns
        self.special_tokens = dict(tokenizer.special_tokens_map)  # a property that rebuilds the dict per call

    def render(self, conversation: Conversation) -> RenderedConversation:
        kwargs = self.template_kwargs(conversation)
        self._prepare(conversation)
        full = self._render(conversation, len(conversation.messages), False, kwargs)
        turns = [self._turn_span(conversation, index, full, kwargs) for index in conversation.assistant_indices()]
        texts, context_only = self._group_texts(conversation.id, full, turns)
        return RenderedConversation(texts=texts, tool_call_repeats=max_tool_call_repeats(conversation),
                                    empty_reasoning=bool(kwargs["enable_thinking"]) and has_empty_reasoning(conversation),
                                    context_only_turns=context_only)

    def template_kwargs(self, conversation: Conversation) -> dict[str, object]:
        """`enable_thinking`: the record's own setting, else on if any turn has reasoning, else the default."""
        kwargs = dict(conversation.template_kwargs)
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = any(reasoning_text(m).strip() for m in _assistants(conversation)) \
                or self.thinking_default
        return kwargs

    def _prepare(self, conversation: Conversation) -> None:
        """What `apply_chat_template` does before rendering, done once per conversation: pick the
        template (a tokenizer may hold several, e.g. "tool_use"), and alias the reasoning field."""
        self._template = compiled_template(self.tokenizer, conversation.tools)
        self._messages = [_with_reasoning_aliases(message) for message in conversation.messages]

    def _render(self, conversation: Conversation, upto: int, generation_prompt: bool,
                kwargs: dict[str, object]) -> str:
        try:
            if self._template is None:     # messages and template kwargs are JSON objects to transformers
                text = self.tokenizer.apply_chat_template(
                    conversation.messages[:upto], tools=conversation.tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)  # type: ignore[arg-type]
                assert isinstance(text, str), "tokenize=False renders text"
                return text
            return self._template.render(messages=self._messages[:upto], tools=conversation.tools, documents=None,
                                         add_generation_prompt=generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except Exception as error:  # jinja TemplateError, raise_exception(...) in templates, TypeError...
            raise RecordProblem("template_error", f"{type(error).__name__}: {error}") from None


    def _turn_span(self, conversation: Conversation, index: int, full: str, kwargs: dict[str, object]) -> TurnSpan:
        if index == 0:
            raise RecordProblem("template_error", "the conversation starts with an assistant turn: no prompt to render")
        prefix = self._render(conversation, index, True, kwargs)
        last = index == len(conversation.messages) - 1
        through = full if last else self._render(conversation, index + 1, False, kwargs)
        if not through.startswith(prefix):
            raise RecordProblem("template_inconsistent", f"messages[{index}]: rendering the turn does not start "
                                "with the generation prompt rendered before it")
        span = TurnSpan(index, through, len(prefix), max(len(prefix), len(through.rstrip())))
        check_turn_rendered(conversation.messages[index], through[span.start: span.end], index)
        return span

    def _group_texts(self, record_id: str, full: str, turns: list[TurnSpan]) -> tuple[tuple[RenderedText, ...], int]:
        in_full = [turn for turn in turns if turn.agrees_with(full)]
        remaining = [turn for turn in turns if turn not in in_full]
        texts = [RenderedText(record_id, full, tuple((t.start, t.end) for t in in_full))] if in_full or not remaining else []
        if self.rewritten_turns == "context":
            return tuple(texts), len(remaining)
        while remaining:
            latest = remaining[-1]
            group = [turn for turn in remaining if turn.agrees_with(latest.through)]
            texts.append(RenderedText(f"{record_id}#{latest.index}", latest.through,
                                      tuple((t.start, t.end) for t in group)))
            remaining = [turn for turn in remaining if turn not in group]
        return tuple(texts), 0


def _assistants(conversation: Conversation) -> list[ChatMessage]:
    return [message for message in conversation.messages if message["role"] == "assistant"]


def reasoning_text(message: ChatMessage) -> str:
    """The turn's reasoning: `reasoning_content`, or a `<think>...</think>` block left in the content."""
    if "reasoning_content" in message:
        return message["reasoning_content"]
    content = message.get("content") or ""
    if "</think>" in content:
        return content.split("</think>")[0].split("<think>")[-1]
    return ""


def answer_text(message: ChatMessage) -> str:
    content = message.get("content") or ""
    return content.split("</think>")[-1] if "reasoning_content" not in message else content


def check_turn_rendered(message: ChatMessage, generated: str, index: int) -> None:
    """Refuse templates that leave out part of what the model produced in this turn."""
    missing = []
    if reasoning_text(message).strip() and reasoning_text(message).strip() not in generated:
        missing.append("reasoning")
    if answer_text(message).strip() and answer_text(message).strip() not in generated:
        missing.append("content")
    names = [call["function"]["name"] for call in message.get("tool_calls") or []]
    if any(name not in generated for name in names):
        missing.append("tool_calls")
    if missing:
        raise RecordProblem("template_drops_fields", f"messages[{index}]: the chat template does not render "
                            f"the turn's {', '.join(missing)}")


def has_empty_reasoning(conversation: Conversation) -> bool:
    return any(not reasoning_text(message).strip() for message in _assistants(conversation))


def max_tool_call_repeats(conversation: Conversation) -> int:
    """The most times one identical tool call appears within a single assistant turn."""
    most = 0
    for message in _assistants(conversation):
        blocks = [_call_key(call) for call in message.get("tool_calls") or []]
        blocks += [block.strip() for block in TOOL_CALL_BLOCK.findall(message.get("content") or "")]
        if blocks:
            most = max(most, max(Counter(blocks).values()))
    return most


def _call_key(call: ToolCall) -> str:
    function = call["function"]
    arguments: object = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return json.dumps({"name": function["name"], "arguments": arguments}, sort_keys=True)


def compiled_template(tokenizer: PreTrainedTokenizerBase, tools: list[Tool] | None) -> Template | None:
    """The tokenizer's chat template compiled in transformers' sandboxed jinja environment (cached
    there), rendered directly: `apply_chat_template` re-copies every message on every call, a
    quarter of tokenize's time on long conversations. None: fall back to `apply_chat_template`."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    return _compile_jinja_template(tokenizer.get_chat_template(None, tools))


def _with_reasoning_aliases(message: ChatMessage) -> Mapping[str, object]:
    """transformers passes reasoning under `reasoning_content` and `thinking` (gpt-oss templates)."""
    if "reasoning_content" not in message:
        return message
    return {"thinking": message["reasoning_content"], **message}
