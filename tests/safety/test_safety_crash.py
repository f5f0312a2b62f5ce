"""The funnel for unexpected errors (deliverable 2): an exception that is not a LauncherError exits
70 (probe: 125, so `git bisect run` skips), prints one line naming the command and the traceback
file, and the file holds the traceback with secrets masked. Row 20: an oversize record is rejected
before it is rendered, and counted."""
from __future__ import annotations

import json

import pytest

from launcher_core.errors import EXIT_CANNOT_TEST, EXIT_CRASH
from tests.safety.conftest import completions, write_tokenize_profile

SECRET = "hf_" + "q" * 30


@pytest.mark.parametrize("command, module, code", [
    (["profiles"], "dflash.commands.profiles", EXIT_CRASH),
    (["probe"], "envcheck.commands.probe", EXIT_CANNOT_TEST),
])
def test_an_unexpected_error_is_one_line_a_traceback_file_and_its_own_code(cli, monkeypatch, private_cache,
                                                                          command, module, code):
    import importlib

    def boom(args):
        raise RuntimeError(f"internal failure with token {SECRET}")

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(importlib.import_module(module), "run", boom)
    result = cli(*command)
    assert result.code == code and code not in (1, 2)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and f"launcher.py {command[0]} failed unexpectedly (RuntimeError)" in lines[0]
    reports = list((private_cache / "crashes").glob(f"{command[0]}-*.txt"))
    assert len(reports) == 1 and str(reports[0]) in lines[0]
    text = reports[0].read_text()
    assert "Traceback (most recent call last)" in text and "in boom" in text
    assert SECRET not in text + result.err and "<redacted>" in text


def test_launcher_errors_keep_their_codes(cli, tmp_path):
    result = cli("inspect", tmp_path / "missing")
    assert result.code == 2 and result.err.startswith("error: ") and not (tmp_path / "cache" / "crashes").exists()


def test_an_oversize_record_is_rejected_before_rendering_and_counted(cli, tmp_path, qwen3_tokenizer_dir):
    from dflash.data.tokenize import record_byte_limit

    profile = write_tokenize_profile(tmp_path / "p.toml", qwen3_tokenizer_dir, tmp_path / "run")
    source = completions(tmp_path / "in.jsonl", 3)
    huge = {"id": "huge", "messages": [{"role": "user", "content": "x" * (10 << 20)},
                                       {"role": "assistant", "content": "ok"}]}
    with source.open("a") as handle:
        handle.write(json.dumps(huge) + "\n")
    result = cli("tokenize", "--profile", profile, "--input", source, "--output", tmp_path / "ds",
                 "--workers", "1", "--no-progress")
    assert result.code == 0, result.err
    assert "rejected 1 records (record_too_long=1)" in result.out
    meta = json.loads((tmp_path / "ds" / "dflash_meta.json").read_text())
    assert meta["rows"] == 3 and meta["rejects"]["by_reason"] == {"record_too_long": 1}
    reject = json.loads((tmp_path / "ds.rejects.jsonl").read_text().splitlines()[0])
    assert reject["line"] == 4 and f"over the limit of {record_byte_limit(512):,}" in reject["detail"]
