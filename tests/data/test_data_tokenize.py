"""`tokenize` end to end with the real Qwen3 tokenizer: dataset on disk, rejects, workers, gates."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.data import inspect_dataset, load_training_dataset, tokenize_completions
from dflash.data.dataset_io import read_meta
from launcher_core.errors import DataError, InputError
from launcher_core.manifest import read_manifest
from tests.data.conftest import make_profile, turn, write_jsonl

GOOD = [{"id": f"g{i}", "finish_reason": "stop",
         "messages": turn(f"Question {i}?", f"Reasoning about question {i} step by step.", f"Answer {i} is {i * 7}.")}
        for i in range(12)]
MULTI = {"id": "multi", "messages": turn("Hi", "Greet.", "Hello!") + turn("2+2?", "Add.", "4")}
BAD_LINES = [
    "{this is not json",                                                    # invalid_json
    json.dumps([1, 2, 3]),                                                  # not_an_object
    json.dumps({"messages": turn("q", "r", "a")}),                          # missing_id
    json.dumps({"id": "r1", "messages": [{"role": "narrator", "content": "x"}, *turn("q", "r", "a")]}),  # unknown_role
    json.dumps({"id": "r2", "messages": [{"content": "x"}, *turn("q", "r", "a")]}),                      # missing_role
    json.dumps({"id": "r3", "messages": [{"role": "user", "content": {"text": "q"}}]}),                  # bad_content
    json.dumps({"id": "r4", "messages": [{"role": "user", "content": "only a question"}]}),              # no_assistant_turn
    json.dumps({"id": "r5", "messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "a"}]}),  # bad_content
    json.dumps(GOOD[0]),                                                    # duplicate_id
]
EXPECTED_REJECTS = {"bad_content": 2, "duplicate_id": 1, "invalid_json": 1, "missing_id": 1, "missing_role": 1,
                    "no_assistant_turn": 1, "not_an_object": 1, "unknown_role": 1, "empty_file": 1}


@pytest.fixture
def profile(tmp_path, qwen3_tokenizer_dir):
    return make_profile(qwen3_tokenizer_dir, tmp_path / "run", shard_rows=4, min_loss_tokens=4,
                        max_degenerate_share=0.5)


def test_dataset_opens_with_load_from_disk_and_matches_records(profile, tmp_path, qwen3_tokenizer):
    source = write_jsonl(tmp_path / "completions.jsonl", GOOD + [MULTI])
    summary = tokenize_completions(profile, source, tmp_path / "ds", workers=1, run_dir=tmp_path / "run", progress=False)
    dataset = load_training_dataset(tmp_path / "ds")
    assert dataset.num_rows == summary.samples == 14 and summary.rewritten_turns == 1
    assert dataset.column_names[:5] == ["id", "input_ids", "loss_mask", "length", "num_loss_tokens"]
    assert {f: str(dataset.features[f].feature.dtype) for f in ("input_ids", "loss_mask")} == \
        {"input_ids": "int32", "loss_mask": "uint8"}
    assert len(dataset.cache_files) == 4  # 14 rows in shards of 4: memory-mapped Arrow files
    row = dataset[3]
    assert row["id"] == "g3" and row["length"] == len(row["input_ids"]) and row["num_loss_tokens"] == sum(row["loss_mask"])
    masked = qwen3_tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked == "<think>\nReasoning about question 3 step by step.\n</think>\n\nAnswer 3 is 21.<|im_end|>"
    assert sum(dataset["length"]) == summary.tokens and sum(dataset["num_loss_tokens"]) == summary.loss_tokens
    meta = read_meta(tmp_path / "ds")
    assert meta["max_length"] == 512 and meta["sources"][0]["records"] == 13
    assert len(meta["tokenizer"]["fingerprint"]) == 64 and len(meta["tokenizer"]["chat_template_fingerprint"]) == 64
    stage = read_manifest(tmp_path / "run")["stages"]["tokenize"]
    assert stage["state"] == "done" and stage["samples"] == 14 and stage["tokens"] == summary.tokens


def test_bad_input_counts_by_reason_with_line_numbers(profile, tmp_path):
    source = write_jsonl(tmp_path / "mixed.jsonl", GOOD[:6] + BAD_LINES)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    summary = tokenize_completions(profile, [source, empty], tmp_path / "ds", workers=1, progress=False,
                                   allow_degenerate=True)     # 9 of 15 records rejected: above the gate's 50 %
    assert summary.rejects == dict(sorted(EXPECTED_REJECTS.items()))
    assert summary.samples == 6 and summary.records == 6 + len(BAD_LINES) + 1
    rejects = [json.loads(line) for line in Path(summary.rejects_path).read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects[:3]] == [(7, "invalid_json"), (8, "not_an_object"), (9, "missing_id")]
    assert rejects[-1]["source"] == str(empty) and rejects[-1]["reason"] == "empty_file"
    assert read_meta(tmp_path / "ds")["rejects"]["by_reason"] == summary.rejects


def test_output_identical_for_one_and_two_workers(profile, tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", GOOD + [MULTI] + BAD_LINES + GOOD[:0])
    first = tokenize_completions(profile, source, tmp_path / "w1", workers=1, progress=False)
    second = tokenize_completions(profile, source, tmp_path / "w2", workers=2, progress=False)
    assert first.samples == second.samples and first.rejects == second.rejects
    shards = lambda meta: [(s["filename"], s["sha256"]) for s in meta["shards"]]  # noqa: E731
    assert shards(read_meta(tmp_path / "w1")) == shards(read_meta(tmp_path / "w2"))
    assert Path(first.rejects_path).read_text() == Path(second.rejects_path).read_text()


def test_degenerate_share_gate_refuses_unless_allowed(profile, tmp_path):
    empties = [{"id": f"e{i}", "finish_reason": "length", "messages": turn("Hi", "x", "")} for i in range(8)]
    source = write_jsonl(tmp_path / "c.jsonl", GOOD[:4] + empties)
    with pytest.raises(DataError, match=r"66\.7% of the 12 samples are degenerate.*--allow-degenerate"):
        tokenize_completions(profile, source, tmp_path / "ds", workers=1, run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds.*"))
    assert read_manifest(tmp_path / "run")["stages"]["tokenize"]["state"] == "failed"
    tokenize_completions(profile, source, tmp_path / "ds", workers=1, allow_degenerate=True, progress=False)
    report = inspect_dataset(tmp_path / "ds")
    assert report.degenerate["finish_length"] == 8 and report.degenerate["low_loss_tokens"] == 0
    assert report.degenerate_samples == 8 and report.examples["finish_length"][:2] == ["e0", "e1"]
    strict = inspect_dataset(tmp_path / "ds", min_loss_tokens=20)
    assert strict.degenerate["low_loss_tokens"] == 8  # the empty answers are short, the good ones are not


def test_nothing_usable_is_an_input_error(profile, tmp_path):
    source = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES[:3])
    with pytest.raises(InputError, match="no usable records.*invalid_json=1"):
        tokenize_completions(profile, source, tmp_path / "ds", workers=1, progress=False)
    with pytest.raises(InputError, match="completions file not found"):
        tokenize_completions(profile, tmp_path / "missing.jsonl", tmp_path / "ds", workers=1, progress=False)


def test_cli_tokenize_and_inspect(tmp_path, qwen3_tokenizer_dir, repo_root):
    run_dir = tmp_path / "run"
    write_jsonl(tmp_path / "c.jsonl", GOOD[:5])
    profile = tmp_path / "p.toml"
    profile.write_text(f'[machine]\ndevice = "cpu"\n[model]\ntarget = "builtin:smollm2-135m-instruct"\n'
                       f'tokenizer = "{qwen3_tokenizer_dir}"\n[paths]\nrun_dir = "{run_dir}"\n'
                       f'completions = "{tmp_path / "c.jsonl"}"\n[data]\nmin_loss_tokens = 4\n')
    done = subprocess.run([sys.executable, "launcher.py", "tokenize", "--profile", str(profile), "--workers", "1",
                           "--no-progress"], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "tokenized 5 records -> 5 samples" in done.stdout and "degenerate samples 0" in done.stdout
    shown = subprocess.run([sys.executable, "launcher.py", "inspect", str(run_dir / "dataset"), "--json"],
                           cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and json.loads(shown.stdout)["samples"] == 5
    missing = subprocess.run([sys.executable, "launcher.py", "inspect", str(tmp_path / "nope")],
                             cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such dataset directory" in missing.stderr


def test_the_prompts_file_given_for_completions_is_refused_naming_it_and_the_likely_mistake(tmp_path, qwen3_tokenizer_dir,
                                                                                            repo_root):
    """The shipped prompts bank tokenized by mistake (494 of its 526 records have no assistant turn): rejected
    records count beside degenerate samples in the degenerate gate, so this is not exit 0 with a 32-sample
    dataset but exit 4, one line naming the file, its dominant reject reason and
    what was likely wrong; nothing written at the output. --allow-degenerate still writes it."""
    prompts = repo_root / "dflash" / "prompts" / "builtin_prompts.jsonl"
    profile = tmp_path / "p.toml"
    profile.write_text(f'extends = "cpu-demo"\n[model]\ntokenizer = "{qwen3_tokenizer_dir}"\n'
                       f'[paths]\nrun_dir = "{tmp_path / "run"}"\n')
    argv = [sys.executable, "launcher.py", "tokenize", "--profile", str(profile), "--input", str(prompts), "--output",
            str(tmp_path / "ds"), "--workers", "1", "--no-progress"]
    refused = subprocess.run(argv, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 4, refused.stdout + refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith(f"error: {prompts}: 494 record(s) rejected, 494 for no_assistant_turn: "), line
    assert "it looks like a prompts file (what `generate` reads), not the completions `generate` writes" in line
    assert "494 of the 526 records rejected and " in line and "limit data.max_degenerate_share = 75.0%" in line
    assert "Traceback" not in refused.stderr and not (tmp_path / "ds").exists()
    allowed = subprocess.run([*argv, "--allow-degenerate"], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0 and "rejected 494 records" in allowed.stdout, allowed.stderr


@pytest.mark.slow
def test_tokenize_killed_midway_publishes_nothing_and_rerun_cleans_up(tmp_path, qwen3_tokenizer_dir, repo_root):
    import os
    import signal
    import time

    from dflash.data.dataset_io import SHARD_DELAY_ENV

    write_jsonl(tmp_path / "c.jsonl", GOOD)
    profile = tmp_path / "p.toml"
    profile.write_text(f'[machine]\ndevice = "cpu"\n[model]\ntarget = "{qwen3_tokenizer_dir}"\n'
                       f'[paths]\nrun_dir = "{tmp_path / "run"}"\ncompletions = "{tmp_path / "c.jsonl"}"\n'
                       f'[data]\nshard_rows = 2\nmin_loss_tokens = 4\n')
    argv = [sys.executable, "launcher.py", "tokenize", "--profile", str(profile), "--workers", "1", "--no-progress"]
    process = subprocess.Popen(argv, cwd=repo_root, env={**os.environ, SHARD_DELAY_ENV: "0.5"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while not list((tmp_path / "run").glob(".dataset.tokenize-*/.shard-00001.arrow")):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert not (tmp_path / "run" / "dataset").exists()
    assert list((tmp_path / "run").glob(".dataset.tokenize-*"))  # the stale staging directory
    assert subprocess.run(argv, cwd=repo_root, capture_output=True, timeout=120).returncode == 0
    assert load_training_dataset(tmp_path / "run" / "dataset").num_rows == len(GOOD)
    assert not list((tmp_path / "run").glob(".dataset.*"))
