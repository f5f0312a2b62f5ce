"""One conversation -> token ids and a loss mask (`SampleTokenizer`), and samples -> one Arrow
record batch of the dataset's columns. Runs in tokenize's worker processes (see dflash.data.tokenize)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import numpy as np

from dflash.data.chat_render import ChatRenderer, RenderedText, RewrittenTurns
from dflash.data.conversations import Conversation, RecordProblem, Reject, parse_record
from dflash.data.sources import Line

if TYPE_CHECKING:
    import pyarrow as pa
    from tokenizers import Encoding
    from transformers import PreTrainedTokenizerFast

# What a worker returns for one line: its samples (a rewritten turn adds one), or why it was rejected.
LineResult = list["TokenizedSample"] | Reject


@dataclass(frozen=True)
class TokenizeSettings:
    max_length: int = 8192
    thinking_default: bool = True
    rewritten_turns: RewrittenTurns = "split"


@dataclass
class TokenizedSample:
    id: str                      # the record's id, or ID#<message index> for a split-off turn
    record_id: str
    input_ids: np.ndarray        # int32
    loss_mask: np.ndarray        # uint8
    truncated_tokens: int
    finish_reason: str
    tool_call_repeats: int
    empty_reasoning: bool
    thinking: bool = False       # the enable_thinking its record was rendered with
    sampling: tuple[tuple[str, object], ...] = ()   # its record's generation settings (rendering.GENERATION_KEYS)


class SampleTokenizer:
    """Render + tokenize-once + mask for one conversation. Holds the tokenizer and renderer."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, settings: TokenizeSettings):
        self.backend = tokenizer.backend_tokenizer
        self.settings = settings
        self.renderer = ChatRenderer(tokenizer, settings.thinking_default, settings.rewritten_turns)

    def process_line(self, line: Line) -> LineResult:
        parsed = parse_record(line.text, line.source, line.number)
        if isinstance(parsed, Reject):
            return parsed
        try:
            return self.process(parsed)
        except RecordProblem as problem:
            return Reject(line.source, line.number, problem.reason, str(problem), parsed.id)

    def process(self, conversation: Conversation) -> list[TokenizedSample]:
        rendered = self.renderer.render(conversation)
        thinking = bool(self.renderer.template_kwargs(conversation)["enable_thinking"])
        return [self._sample(text, conversation, rendered.tool_call_repeats, rendered.empty_reasoning, thinking)
                for text in rendered.texts]

    def _sample(self, rendered: RenderedText, conversation: Conversation, repeats: int, empty: bool,
                thinking: bool) -> TokenizedSample:
        encoding = self.backend.encode(rendered.text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int32)
        mask = loss_mask_from_spans(encoding, len(ids), rendered.spans)
        cut = max(0, len(ids) - self.settings.max_length)
        if cut:
            ids, mask = ids[: self.settings.max_length], mask[: self.settings.max_length]
        return TokenizedSample(rendered.id, conversation.id, ids, mask, cut, conversation.finish_reason, repeats, empty,
                               thinking, conversation.sampling)


def loss_mask_from_spans(encoding: Encoding, length: int, spans: Iterable[tuple[int, int]]) -> np.ndarray:
    """1 on the tokens inside the character spans. A token that starts before a span (merged
    across its start) is left out; the token holding the span's last character is in."""
    mask = np.zeros(length, dtype=np.uint8)
    for start, end in spans:
        if end <= start:
            continue
        first = encoding.char_to_token(start)
        last = encoding.char_to_token(end - 1)
        chars = encoding.token_to_chars(first) if first is not None else None
        assert first is not None and last is not None and chars is not None, (start, end)
        if chars[0] < start:
            first += 1
        mask[first: last + 1] = 1
    return mask


def samples_to_batch(samples: list[TokenizedSample]) -> pa.RecordBatch:
    import pyarrow as pa

    from dflash.data.dataset_io import dataset_schema

    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    columns = {
        "id": pa.array([s.id for s in samples], pa.string()),
        "input_ids": pa.ListArray.from_arrays(offsets, np.concatenate([s.input_ids for s in samples])),
        "loss_mask": pa.ListArray.from_arrays(offsets, np.concatenate([s.loss_mask for s in samples])),
        "length": pa.array(lengths),
        "num_loss_tokens": pa.array(np.array([int(s.loss_mask.sum()) for s in samples], dtype=np.int32)),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "truncated": pa.array([s.truncated_tokens > 0 for s in samples], pa.bool_()),
        "truncated_tokens": pa.array(np.array([s.truncated_tokens for s in samples], dtype=np.int32)),
        "tool_call_repeats": pa.array(np.array([s.tool_call_repeats for s in samples], dtype=np.int32)),
        "empty_reasoning": pa.array([s.empty_reasoning for s in samples], pa.bool_()),
    }
    return pa.RecordBatch.from_pydict(columns, schema=dataset_schema())
