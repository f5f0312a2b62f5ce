"""Loss masks with the real Qwen3 tokenizer and thinking template (and SmolLM2's template).

The core property: decoding exactly the masked tokens gives back each assistant turn as the model
produces it after the generation prompt: `<think>` block, tool calls and `<|im_end|>` included, the
template's trailing newline and everything else excluded.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.data.conversations import Reject, parse_record
from dflash.data.samples import SampleTokenizer, TokenizeSettings
from tests.data.conftest import turn

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def masked_runs(sample) -> list[list[int]]:
    """The masked token ids as contiguous runs."""
    runs, current = [], []
    for token, bit in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def decoded_runs(tokenizer, sample) -> list[str]:
    return [tokenizer.decode(run) for run in masked_runs(sample)]


def process(tokenizer, record: dict, **settings):
    worker = SampleTokenizer(tokenizer, TokenizeSettings(**settings))
    result = worker.process_line(_line(record))
    return result


def _line(record: dict):
    from dflash.data.sources import Line

    return Line("test.jsonl", 1, json.dumps(record))


def test_single_turn_thinking_masks_think_block_answer_and_im_end(qwen3_tokenizer):
    record = {"id": "a", "messages": [{"role": "system", "content": "Be brief."},
                                      *turn("What is 2+2?", "Add two and two.", "4")]}
    [sample] = process(qwen3_tokenizer, record)
    assert decoded_runs(qwen3_tokenizer, sample) == ["<think>\nAdd two and two.\n</think>\n\n4<|im_end|>"]
    text = qwen3_tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert sample.input_ids.tolist() == qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert text.endswith("<|im_end|>\n") and sample.loss_mask[-1] == 0  # the template's newline is not loss
    assert sample.id == "a" and int(sample.loss_mask.sum()) == len(masked_runs(sample)[0])


def test_multi_turn_rewritten_reasoning_gets_its_own_sample(qwen3_tokenizer):
    messages = turn("Hi", "Greet back.", "Hello!") + turn("And 3*3?", "Multiply.", "9")
    samples = process(qwen3_tokenizer, {"id": "m", "messages": messages})
    by_id = {sample.id: sample for sample in samples}
    assert set(by_id) == {"m", "m#1"}
    # the full conversation: turn 1 appears as Qwen3 renders history (no reasoning) and is context only
    assert decoded_runs(qwen3_tokenizer, by_id["m"]) == ["<think>\nMultiply.\n</think>\n\n9<|im_end|>"]
    assert "Hello!<|im_end|>" in qwen3_tokenizer.decode(by_id["m"].input_ids.tolist())
    # turn 1 as the model produced it, reasoning included, in a sample of its own
    assert decoded_runs(qwen3_tokenizer, by_id["m#1"]) == ["<think>\nGreet back.\n</think>\n\nHello!<|im_end|>"]


def test_multi_turn_context_mode_keeps_rewritten_turn_as_context(qwen3_tokenizer):
    messages = turn("Hi", "Greet back.", "Hello!") + turn("And 3*3?", "Multiply.", "9")
    samples = process(qwen3_tokenizer, {"id": "m", "messages": messages}, rewritten_turns="context")
    assert [s.id for s in samples] == ["m"]
    assert decoded_runs(qwen3_tokenizer, samples[0]) == ["<think>\nMultiply.\n</think>\n\n9<|im_end|>"]


def test_tool_calling_turns_masked_and_tool_response_not(qwen3_tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "reasoning_content": "Call the tool.", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "{\"sky\": \"sunny\"}"},
                {"role": "assistant", "reasoning_content": "Report it.", "content": "It is sunny."}]
    [sample] = process(qwen3_tokenizer, {"id": "t", "tools": [WEATHER_TOOL], "messages": messages})
    assert decoded_runs(qwen3_tokenizer, sample) == [
        "<think>\nCall the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>",
        "<think>\nReport it.\n</think>\n\nIt is sunny.<|im_end|>"]
    unmasked = qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 0].tolist())
    assert "<tool_response>" in unmasked and "sunny\"}" in unmasked and "get_weather" in unmasked  # tools + response


def test_no_thinking_excludes_the_empty_think_generation_prompt(qwen3_tokenizer):
    record = {"id": "n", "chat_template_kwargs": {"enable_thinking": False}, "messages": turn("Hi", None, "Hello!")}
    [sample] = process(qwen3_tokenizer, record)
    assert decoded_runs(qwen3_tokenizer, sample) == ["Hello!<|im_end|>"]
    assert "<think>\n\n</think>\n\n" in qwen3_tokenizer.decode(sample.input_ids.tolist())
    assert not sample.empty_reasoning


def test_thinking_on_with_empty_reasoning_is_flagged_and_trained_as_generated(qwen3_tokenizer):
    [sample] = process(qwen3_tokenizer, {"id": "e", "messages": turn("Hi", "", "Hello!")}, thinking_default=True)
    assert decoded_runs(qwen3_tokenizer, sample) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]
    assert sample.empty_reasoning


def test_reasoning_left_in_content_is_rendered_and_masked(qwen3_tokenizer):
    record = {"id": "c", "messages": turn("Hi", None, "<think>\nPonder.\n</think>\n\nHello!")}
    [sample] = process(qwen3_tokenizer, record)
    assert decoded_runs(qwen3_tokenizer, sample) == ["<think>\nPonder.\n</think>\n\nHello!<|im_end|>"]
    assert not sample.empty_reasoning


def test_truncation_counts_cut_tokens_and_keeps_mask_aligned(qwen3_tokenizer):
    record = {"id": "long", "messages": turn("Count.", "one two three " * 40, "done")}
    [full] = process(qwen3_tokenizer, record, max_length=8192)
    [cut] = process(qwen3_tokenizer, record, max_length=50)
    assert len(cut.input_ids) == len(cut.loss_mask) == 50
    assert cut.truncated_tokens == len(full.input_ids) - 50
    assert np.array_equal(cut.loss_mask, full.loss_mask[:50]) and full.truncated_tokens == 0


def test_tool_call_loop_is_counted(qwen3_tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "reasoning_content": "Again.", "content": "", "tool_calls": [call] * 9}]
    [sample] = process(qwen3_tokenizer, {"id": "loop", "tools": [WEATHER_TOOL], "messages": messages})
    assert sample.tool_call_repeats == 9
    assert decoded_runs(qwen3_tokenizer, sample)[0].count("<tool_call>") == 9


def test_inconsistent_template_is_rejected_not_mis_masked(qwen3_tokenizer, monkeypatch):
    tokenizer = qwen3_tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", (  # the generation prompt opens <think>, but turns render without it
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"))
    result = process(tokenizer, {"id": "x", "messages": turn("Hi", None, "Hello!")})
    assert isinstance(result, Reject) and result.reason == "template_inconsistent"


def test_generation_prompt_with_open_think_starts_loss_after_it(qwen3_tokenizer, monkeypatch):
    tokenizer = qwen3_tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", (  # like templates whose generation prompt already holds "<think>\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think>\n"
        "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"))
    [sample] = process(tokenizer, {"id": "o", "messages": turn("Hi", "Think.", "Hello!")})
    assert decoded_runs(tokenizer, sample) == ["Think.\n</think>\n\nHello!<|im_end|>"]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def test_smollm2_template_multi_turn(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    messages = turn("Hi", None, "Hello there.") + turn("Capital of France?", None, "Paris.")
    [sample] = process(tokenizer, {"id": "s", "messages": messages}, thinking_default=False)
    assert decoded_runs(tokenizer, sample) == ["Hello there.<|im_end|>", "Paris.<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(sample.input_ids.tolist())


def test_smollm2_template_without_tool_calls_or_reasoning_rejects(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    tool_record = {"id": "t", "messages": [{"role": "user", "content": "Weather?"},
                                          {"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert process(tokenizer, tool_record).reason == "template_drops_fields"
    assert process(tokenizer, {"id": "r", "messages": turn("Hi", "Think.", "Hello!")}).reason == "template_drops_fields"


def test_parse_record_reasons():
    cases = {
        "{not json": "invalid_json", "[1, 2]": "not_an_object",
        json.dumps({"messages": turn("a", None, "b")}): "missing_id",
        json.dumps({"id": "x"}): "missing_messages",
        json.dumps({"id": "x", "messages": [{"content": "hi"}]}): "missing_role",
        json.dumps({"id": "x", "messages": [{"role": "robot", "content": "hi"}]}): "unknown_role",
        json.dumps({"id": "x", "messages": [{"role": "user", "content": ["hi"]}]}): "bad_content",
        json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}): "no_assistant_turn",
        json.dumps({"id": "x", "messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "", "tool_calls": [{"f": 1}]}]}): "bad_tool_calls",
    }
    for line, reason in cases.items():
        result = parse_record(line, "f.jsonl", 7)
        assert isinstance(result, Reject) and result.reason == reason and result.line == 7, (line, result)
    assert parse_record(json.dumps({"id": 5, "messages": turn("a", None, "b")}), "f", 1).id == "5"


def test_direct_template_render_equals_apply_chat_template(qwen3_tokenizer):
    from dflash.data.chat_render import ChatRenderer

    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conversations = [
        {"id": "m", "messages": turn("Hi", "Greet.", "Hello!") + turn("2+2?", "Add.", "4")},
        {"id": "t", "tools": [WEATHER_TOOL], "messages": [
            {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "reasoning_content": "Call.", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]},
    ]
    renderer = ChatRenderer(qwen3_tokenizer)
    for record in conversations:
        conversation = parse_record(json.dumps(record), "f", 1)
        kwargs = renderer.template_kwargs(conversation)
        renderer._prepare(conversation)
        for upto in range(1, len(conversation.messages) + 1):
            for prompt in (False, True):
                expected = qwen3_tokenizer.apply_chat_template(conversation.messages[:upto], tools=conversation.tools,
                                                               tokenize=False, add_generation_prompt=prompt, **kwargs)
                assert renderer._render(conversation, upto, prompt, kwargs) == expected
