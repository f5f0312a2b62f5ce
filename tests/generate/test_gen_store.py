"""The completions store: exactly one line per id across kills, torn lines, and a stale index."""
from __future__ import annotations

import json

import pytest

from dflash.generate.store import CompletionStore
from launcher_core.errors import InputError


def open_store(tmp_path, flush_every=2):
    store = CompletionStore(tmp_path / "out.jsonl", tmp_path / "generate", flush_every=flush_every)
    return store, store.open()


def output_ids(tmp_path):
    return [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_batches_flush_and_reopen_sees_them(tmp_path):
    store, report = open_store(tmp_path, flush_every=2)
    assert report.done == 0
    store.add({"id": "a", "x": 1})
    assert not (tmp_path / "out.jsonl").read_text()  # still buffered
    store.add({"id": "b", "x": 2})
    assert output_ids(tmp_path) == ["a", "b"]
    store.add({"id": "c", "x": 3})
    store.close()
    store, report = open_store(tmp_path)
    assert store.done_ids == {"a", "b", "c"} and report.reindexed == 0 and not report.index_rebuilt


def test_torn_last_line_is_cut_and_the_id_runs_again(tmp_path):
    store, _ = open_store(tmp_path)
    for prompt_id in "ab":
        store.add({"id": prompt_id})
    store.close()
    with (tmp_path / "out.jsonl").open("ab") as handle:
        handle.write(b'{"id":"c","messages":[{"ro')  # a kill in the middle of a batch write
    store, report = open_store(tmp_path)
    assert report.torn_bytes_dropped == len(b'{"id":"c","messages":[{"ro')
    assert store.done_ids == {"a", "b"}
    store.add({"id": "c"})
    store.close()
    assert output_ids(tmp_path) == ["a", "b", "c"]


def test_lines_written_but_not_indexed_are_reindexed(tmp_path):
    store, _ = open_store(tmp_path)
    store.add({"id": "a"})
    store.close()
    with (tmp_path / "out.jsonl").open("a") as handle:  # killed after the output write, before the index
        handle.write(json.dumps({"id": "b"}) + "\n")
    with (tmp_path / "generate" / "done.index").open("a") as handle:
        handle.write('[99, "tor')  # and the index's own last entry torn
    store, report = open_store(tmp_path)
    assert store.done_ids == {"a", "b"} and report.reindexed == 1
    store.close()
    store, report = open_store(tmp_path)
    assert store.done_ids == {"a", "b"} and report.reindexed == 0


def test_index_that_does_not_match_output_is_rebuilt(tmp_path):
    (tmp_path / "out.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in ("x", "y")))
    (tmp_path / "generate").mkdir()
    (tmp_path / "generate" / "done.index").write_text('[5000, "x"]\n')  # beyond the output's end
    store, report = open_store(tmp_path)
    assert report.index_rebuilt and store.done_ids == {"x", "y"}


def test_corruption_in_the_middle_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "out.jsonl").write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(InputError, match=r"out.jsonl: line 2: not a complete completion record"):
        open_store(tmp_path)


def test_failures_are_kept_until_done_then_compacted(tmp_path):
    store, _ = open_store(tmp_path)
    store.add_failure("p", "HTTP 500: boom", attempts=4)
    store.add_failure("q", "timeout after 2 s", attempts=4)
    store.close()
    store, _ = open_store(tmp_path)
    assert set(store.failures) == {"p", "q"} and store.failures["p"]["reason"] == "HTTP 500: boom"
    store.add({"id": "p"})
    store.close()
    lines = (tmp_path / "generate" / "failures.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["q"]
