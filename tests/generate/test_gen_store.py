"""The completions store: exactly one line per id across kills, torn lines, and a stale index."""
from __future__ import annotations

import json
import os
import re

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


def completion_line(prompt_id: str) -> str:
    from dflash.generate.completions import completion_record
    from dflash.generate.prompt_files import PromptRecord

    response = {"choices": [{"message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    prompt = PromptRecord(id=prompt_id, messages=({"role": "user", "content": "2+2?"},))
    return json.dumps(completion_record(prompt, response, {"temperature": 0.0}, 0.0, 1.0, "m")) + "\n"


def test_output_rules_refuse_the_prompts_file_a_folder_and_a_foreign_file(tmp_path):
    from dflash.generate.store import check_output
    from launcher_core.errors import ConfigError

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp_path / "hard.jsonl")
    for same in (prompts, tmp_path / "link.jsonl", tmp_path / "hard.jsonl", tmp_path / "." / "prompts.jsonl"):
        with pytest.raises(ConfigError, match=f"--output {re.escape(str(same))} is the prompts file"):
            check_output(same, prompts, tmp_path / "run")
    other_prompts = tmp_path / "more-prompts.jsonl"
    other_prompts.write_text(prompts.read_text())
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes, no newline")          # would look torn: cut to nothing on open
    for foreign in (other_prompts, notes):
        with pytest.raises(ConfigError, match="is an existing file that is not a completions JSONL"):
            check_output(foreign, prompts, tmp_path / "run")
    with pytest.raises(ConfigError, match="is a directory"):
        check_output(tmp_path, prompts, tmp_path / "run")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_output(notes / "out.jsonl", prompts, tmp_path / "run")
    assert notes.read_text() == "my notes, no newline" and other_prompts.read_text() == prompts.read_text()


def test_output_rules_let_generate_resume_its_own_output(tmp_path):
    from dflash.generate.store import check_output
    from launcher_core.errors import ConfigError
    from launcher_core.manifest import update_stage

    prompts, run_dir = tmp_path / "prompts.jsonl", tmp_path / "run"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    output = tmp_path / "completions.jsonl"
    check_output(output, prompts, run_dir)                       # new
    output.write_text("")
    check_output(output, prompts, run_dir)                       # empty
    output.write_text(completion_line("a") + completion_line("b")[:40])
    check_output(output, prompts, run_dir)                       # ours, its last line torn
    output.write_text(completion_line("a")[:40])                 # a kill tore the first batch
    with pytest.raises(ConfigError, match="not a completions JSONL"):
        check_output(output, prompts, run_dir)
    update_stage(run_dir, "generate", "running", output=str(output))
    check_output(output, prompts, run_dir)                       # this run's manifest names it


def test_generate_command_refuses_its_prompts_as_output_with_exit_2(tmp_path, capsys):
    from gen_helpers import write_profile, write_prompts

    import launcher

    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 3)
    before = prompts.read_bytes()
    profile = write_profile(tmp_path / "p.toml", tmp_path / "no-model", tmp_path / "run", prompts)
    code = launcher.main(["generate", "--profile", str(profile), "--output", str(prompts), "--skip-preflight",
                          "--endpoint", "http://127.0.0.1:9", "--no-progress"])
    assert code == 2 and f"--output {prompts} is the prompts file" in capsys.readouterr().err
    assert prompts.read_bytes() == before



def earlier_run(run_dir, done: list[str], failed: list[str]) -> None:
    """What a run that completed `done` and failed `failed` leaves in `run_dir`."""
    store = CompletionStore(run_dir / "completions.jsonl", run_dir / "generate", flush_every=1)
    store.open()
    for prompt_id in done:
        store.add(json.loads(completion_line(prompt_id)))
    for prompt_id in failed:
        store.add_failure(prompt_id, "HTTP 500: boom", attempts=3)
    store.close()


def test_a_rerun_with_only_earlier_failures_left_sends_nothing_and_says_so(tmp_path):
    """The part that needs no server: one prompt done, one failed in an earlier run. A rerun without
    --retry-failed has nothing to send, which is not a success ("completed 0, failed 0", exit 0):
    NothingSent (exit 5) names the earlier failure and --retry-failed (no endpoint is tried: this one is dead);
    the pipeline goes on with the completion it has, as its first run did, and stops when there is none (no
    server starts: its target does not even exist)."""
    from dflash.generate import generate_from_profile
    from dflash.generate.generation_run import NothingSent
    from dflash.stages import PipelineContext, _generate
    from launcher_core.errors import exit_code_for
    from launcher_core.processes import free_port
    from launcher_core.profile import load_profile
    from tests.generate.gen_helpers import write_profile, write_prompts

    prompts = tmp_path / "prompts.jsonl"
    first, second = write_prompts(prompts, 2)
    partial, failed = tmp_path / "partial", tmp_path / "failed"
    earlier_run(partial, done=[first], failed=[second])
    earlier_run(failed, done=[], failed=[first, second])
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tmp_path / "no-model", partial, prompts)))
    with pytest.raises(NothingSent) as raised:
        generate_from_profile(profile, endpoints=[f"http://127.0.0.1:{free_port()}"], progress=False)
    assert exit_code_for(raised.value) == 5
    assert str(raised.value) == (f"nothing sent: 1 prompt(s) failed in an earlier run and are sent again only with "
                                 f"--retry-failed (1 done; each failure's reason is in {partial / 'generate' / 'failures.jsonl'}). "
                                 f"Fix the server or --endpoint, then rerun with --retry-failed")
    assert _generate(PipelineContext(profile=profile, run_dir=partial)) == (
        "nothing sent: 1 prompts have completions, 1 failed earlier (`launcher.py generate --retry-failed` sends them again)")
    with pytest.raises(NothingSent, match=r"^nothing sent: 2 prompt\(s\) failed in an earlier run .* \(0 done;"):
        _generate(PipelineContext(profile=profile, run_dir=failed))
