"""The dataset's `rendering` block: the thinking mode each record was rendered with (on, off, mixed with
counts), the chat template's fingerprint and the generation settings; merge combines two blocks."""
from __future__ import annotations

import dataclasses
import json
import shutil
from typing import Any

import pytest

from dflash.data import inspect_dataset, merge_datasets, tokenize_completions
from dflash.data.dataset_io import META_NAME, read_meta
from tests.data.conftest import make_profile, turn, write_jsonl

SAMPLING = {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "max_tokens": 128, "thinking": False}


def record(index: int, reasoning: str | None, **extra: Any) -> dict[str, Any]:
    return {"id": f"r{index}", "finish_reason": "stop",
            "messages": turn(f"Question {index}?", reasoning, f"Answer {index} is {index * 7}."), **extra}


@pytest.fixture
def profile(tmp_path, qwen3_tokenizer_dir):
    profile = make_profile(qwen3_tokenizer_dir, tmp_path / "run", shard_rows=8, min_loss_tokens=1,
                           max_degenerate_share=1.0)
    return dataclasses.replace(profile, generate=dataclasses.replace(profile.generate, thinking=False))


def tokenized(profile, tmp_path, name: str, records: list[dict[str, Any]]):
    source = write_jsonl(tmp_path / f"{name}.jsonl", records)
    tokenize_completions(profile, source, tmp_path / name, workers=1, progress=False)
    return read_meta(tmp_path / name)


def test_thinking_off_records_the_mode_template_and_generation_settings(profile, tmp_path, qwen3_tokenizer):
    """No reasoning, generate.thinking false: every record rendered thinking off, as the template was asked."""
    meta = tokenized(profile, tmp_path, "off", [record(i, None, sampling=SAMPLING) for i in range(4)])
    block = meta["rendering"]
    assert block["thinking"] == "off" and block["records_by_thinking"] == {"on": 0, "off": 4}
    assert block["chat_template_fingerprint"] == meta["tokenizer"]["chat_template_fingerprint"]
    assert block["generation"] == {key: [value] for key, value in SAMPLING.items()}
    assert block["records_without_sampling"] == 0
    text = inspect_dataset(tmp_path / "off").format_text()       # tokenize and inspect print it
    assert f"rendered thinking off (4 records), chat template {block['chat_template_fingerprint'][:8]}" in text


def test_thinking_on_and_mixed_count_each_records_own_mode(profile, tmp_path):
    """Reasoning turns render thinking on; a record's own chat_template_kwargs wins; settings that
    differ between records are all listed; records without `sampling` are counted."""
    on = tokenized(profile, tmp_path, "on", [record(i, f"Think {i}.") for i in range(3)])["rendering"]
    assert on["thinking"] == "on" and on["records_by_thinking"] == {"on": 3, "off": 0}
    assert on["generation"] == {} and on["records_without_sampling"] == 3

    records = [record(0, "Think.", sampling={**SAMPLING, "thinking": True, "temperature": 0.6}),
               record(1, None, sampling=SAMPLING),
               record(2, None, chat_template_kwargs={"enable_thinking": True}, sampling=SAMPLING)]
    mixed = tokenized(profile, tmp_path, "mixed", records)["rendering"]
    assert mixed["thinking"] == "mixed" and mixed["records_by_thinking"] == {"on": 2, "off": 1}
    assert mixed["generation"]["temperature"] == [0.6, 0.0] and mixed["generation"]["thinking"] == [True, False]


def test_merge_combines_blocks_and_drops_the_block_when_a_side_has_none(profile, tmp_path):
    tokenized(profile, tmp_path, "off", [record(i, None, sampling=SAMPLING) for i in range(3)])
    tokenized(profile, tmp_path, "on", [record(i + 10, "Think.") for i in range(2)])
    merge_datasets(tmp_path / "off", tmp_path / "on", output=tmp_path / "both", progress=False)
    block = read_meta(tmp_path / "both")["rendering"]
    assert block["thinking"] == "mixed" and block["records_by_thinking"] == {"on": 2, "off": 3}
    assert block["generation"]["top_k"] == [20] and block["records_without_sampling"] == 2

    old = shutil.copytree(tmp_path / "on", tmp_path / "old")       # a dataset written before the block
    meta = json.loads((old / META_NAME).read_text())
    del meta["rendering"]
    (old / META_NAME).write_text(json.dumps(meta))
    merge_datasets(tmp_path / "off", old, output=tmp_path / "with-old", progress=False)
    assert "rendering" not in read_meta(tmp_path / "with-old")      # half of it rendered in an unknown mode
