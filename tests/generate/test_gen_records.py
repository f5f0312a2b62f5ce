"""Request bodies per backend and the output record format that `tokenize` reads."""
from __future__ import annotations

import json

from dflash.generate.completions import SamplingParams, assistant_message, build_request_body, completion_record, split_reasoning
from dflash.generate.prompt_files import PromptRecord

SAMPLING = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_tokens=64, thinking=True)
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
PROMPT = PromptRecord("p1", ({"role": "user", "content": "2+3?"},), (TOOL,))


def test_request_body_sends_top_k_except_to_transformers_serve():
    sglang = json.loads(build_request_body(PROMPT, SAMPLING, "sglang", "qwen"))
    assert sglang["top_k"] == 20 and sglang["model"] == "qwen" and sglang["tools"] == [TOOL]
    assert sglang["chat_template_kwargs"] == {"enable_thinking": True}
    assert sglang["max_tokens"] == 64 and sglang["messages"] == [{"role": "user", "content": "2+3?"}]
    served = json.loads(build_request_body(PROMPT, SAMPLING, "transformers", None))
    assert "top_k" not in served and "model" not in served  # transformers serve answers 422 to top_k
    assert "top_k" not in SAMPLING.recorded("transformers") and SAMPLING.recorded("sglang")["top_k"] == 20


def test_reasoning_and_tool_calls_map_to_the_assistant_message():
    message = assistant_message({
        "role": "assistant", "content": None, "reasoning_content": "add them",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    })
    assert message == {"role": "assistant", "content": "", "reasoning_content": "add them",
                       "tool_calls": [{"type": "function", "id": "c1",
                                       "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}


def test_inline_think_block_is_split_out():
    assert split_reasoning("<think>\nfirst 2, then 3\n</think>\n\n5") == ("first 2, then 3", "5")
    assert assistant_message({"content": "plan</think>answer"}) == {
        "role": "assistant", "content": "answer", "reasoning_content": "plan"}
    assert assistant_message({"content": "no thinking here"}) == {"role": "assistant", "content": "no thinking here"}


def test_completion_record_has_every_field_tokenize_reads():
    response = {"model": "served-name", "usage": {"prompt_tokens": 11, "completion_tokens": 4},
                "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "5"}}]}
    record = completion_record(PROMPT, response, SAMPLING.recorded("sglang"), 1700000000.25, 1700000001.5, "fallback")
    assert record["id"] == "p1" and record["tools"] == [TOOL]
    assert record["messages"] == [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    assert (record["finish_reason"], record["prompt_tokens"], record["completion_tokens"]) == ("stop", 11, 4)
    assert record["model"] == "served-name" and record["sampling"]["temperature"] == 0.6
    assert record["started_at"] == "2023-11-14T22:13:20.250Z" and record["finished_at"] == "2023-11-14T22:13:21.500Z"


def test_vllm_gets_tool_choice_none_so_a_prompt_with_tools_is_answered_in_text():
    """vLLM answers 400 to tools under its default tool_choice "auto" without a call parser; "none"
    still renders the tools into the prompt (the model's call comes back as text, as from
    transformers serve). Other backends and prompts without tools get no tool_choice."""
    assert json.loads(build_request_body(PROMPT, SAMPLING, "vllm", "default"))["tool_choice"] == "none"
    assert "tool_choice" not in json.loads(build_request_body(PROMPT, SAMPLING, "transformers", None))
    plain = PromptRecord("p2", ({"role": "user", "content": "hi"},))
    assert "tool_choice" not in json.loads(build_request_body(plain, SAMPLING, "vllm", "default"))
