"""Prompts JSONL parsing: valid forms, and errors that name the file, line and field."""
from __future__ import annotations

import json

import pytest

from dflash.generate.prompt_files import load_prompts
from launcher_core.errors import InputError


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_messages_prompt_and_tools_forms(tmp_path):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    path = write_lines(tmp_path / "p.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        "",
        {"id": 7, "prompt": "What time is it?", "tools": [tool]},
    ])
    first, second = load_prompts(path)
    assert first.id == "a" and first.messages[1] == {"role": "user", "content": "Hi"}
    assert second.id == "7"
    assert second.messages == ({"role": "user", "content": "What time is it?"},)
    assert second.tools == (tool,)


@pytest.mark.parametrize("bad_line, expected", [
    ('{"id": "x", "prompt": ', "line 2: not valid JSON"),
    ({"prompt": "no id"}, "line 2: field 'id'"),
    ({"id": "x", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0]: field 'role' is 'robot'; valid: system"),
    ({"id": "x", "messages": [{"role": "user", "content": 3}]}, "messages[0]: field 'content' must be a string"),
    ({"id": "x", "prompt": "a", "messages": []}, "exactly one of 'messages'"),
    ({"id": "x", "prompt": "a", "colour": 1}, "unknown field(s) ['colour']"),
    ({"id": "x", "prompt": "a", "tools": [{"name": "f"}]}, "tools[0] must look like"),
    ({"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "the last message is the assistant's"),
    ({"id": "first", "prompt": "again"}, "line 2: duplicate id 'first' (first on line 1)"),
])
def test_bad_lines_are_named(tmp_path, bad_line, expected):
    path = write_lines(tmp_path / "p.jsonl", [{"id": "first", "prompt": "ok"}, bad_line])
    with pytest.raises(InputError) as error:
        load_prompts(path)
    assert str(path) in str(error.value)
    assert expected in str(error.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="prompts file not found"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="no prompts"):
        load_prompts(write_lines(tmp_path / "empty.jsonl", [""]))
