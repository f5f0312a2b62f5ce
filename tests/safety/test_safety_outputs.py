"""Rows 1-4 of the safety table, and the same rules for merge and snapshot -o: an output path that
exists and is not this command's own kind is refused (exit 2, named, nothing touched); an input
inside, or equal to, the output is refused; an existing dataset is replaced only with --force,
and kept as a backup. The CLI runs in process; datasets are a few rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.conftest import build_dataset
from tests.safety.conftest import completions, tree_digest, write_tokenize_profile


@pytest.fixture
def profile(tmp_path, qwen3_tokenizer_dir) -> Path:
    return write_tokenize_profile(tmp_path / "p.toml", qwen3_tokenizer_dir, tmp_path / "run")


def tokenize(cli, profile: Path, source: Path, output: Path, *extra: str):
    return cli("tokenize", "--profile", profile, "--input", source, "--output", output, "--workers", "1",
               "--no-progress", *extra)


def test_tokenize_refuses_a_folder_holding_a_users_file(cli, profile, tmp_path):
    source = completions(tmp_path / "in.jsonl", 3)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    before = tree_digest(folder)
    result = tokenize(cli, profile, source, folder)
    assert result.code == 2
    assert f"--output {folder} is an existing folder that is not a dflash dataset" in result.err
    assert tree_digest(folder) == before and "Traceback" not in result.err


def test_tokenize_refuses_the_folder_holding_its_own_input(cli, profile, tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    source = completions(folder / "in.jsonl", 3)
    (folder / "neighbour.txt").write_text("keep me")
    before = tree_digest(folder)
    result = tokenize(cli, profile, source, folder)
    assert result.code == 2 and f"contains the input {source}" in result.err
    assert tree_digest(folder) == before


def test_tokenize_refuses_the_input_file_itself(cli, profile, tmp_path):
    source = completions(tmp_path / "in.jsonl", 3)
    before = tree_digest(source)
    result = tokenize(cli, profile, source, source)
    assert result.code == 2 and f"--output {source} is the input {source} itself" in result.err
    assert source.is_file() and tree_digest(source) == before


def test_tokenize_replaces_a_dataset_only_with_force_and_keeps_a_backup(cli, profile, tmp_path):
    dataset = tmp_path / "ds"
    assert tokenize(cli, profile, completions(tmp_path / "big.jsonl", 30), dataset).code == 0
    before = tree_digest(dataset)
    small = completions(tmp_path / "small.jsonl", 4, start=100)
    refused = tokenize(cli, profile, small, dataset)
    assert refused.code == 2 and f"--output {dataset} is an existing dflash dataset; pass --force" in refused.err
    assert tree_digest(dataset) == before
    replaced = tokenize(cli, profile, small, dataset, "--force")
    assert replaced.code == 0, replaced.err
    backups = sorted(tmp_path.glob("ds.backup-*"))
    assert len(backups) == 1 and tree_digest(backups[0]) == before
    assert f"the dataset it replaced is kept at {backups[0]}" in replaced.out
    assert json.loads((dataset / "dflash_meta.json").read_text())["rows"] == 4


def test_tokenize_into_an_empty_folder_is_fine(cli, profile, tmp_path):
    (tmp_path / "empty").mkdir()
    assert tokenize(cli, profile, completions(tmp_path / "in.jsonl", 3), tmp_path / "empty").code == 0
    assert (tmp_path / "empty" / "dflash_meta.json").exists()


def test_merge_output_follows_the_same_rules(cli, tmp_path):
    base, add = build_dataset(tmp_path / "base", ["a", "b"]), build_dataset(tmp_path / "add", ["c"], seed=1)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"\0" * 10)
    inputs = {"base": tree_digest(base), "add": tree_digest(add), "mine": tree_digest(folder)}
    foreign = cli("merge", "--base", base, "--add", add, "--output", folder, "--no-progress", "--force")
    assert foreign.code == 2 and "is an existing folder that is not a dflash dataset" in foreign.err
    itself = cli("merge", "--base", base, "--add", add, "--output", base, "--no-progress")
    assert itself.code == 2 and f"is the input {base} itself" in itself.err
    assert {"base": tree_digest(base), "add": tree_digest(add), "mine": tree_digest(folder)} == inputs
    merged = tmp_path / "merged"
    assert cli("merge", "--base", base, "--add", add, "--output", merged, "--no-progress").code == 0
    first = tree_digest(merged)
    again = cli("merge", "--base", base, "--add", add, "--output", merged, "--no-progress")
    assert again.code == 2 and "pass --force" in again.err and tree_digest(merged) == first
    forced = cli("merge", "--base", base, "--add", add, "--output", merged, "--no-progress", "--force")
    assert forced.code == 0 and "the dataset it replaced is kept at" in forced.out
    assert tree_digest(next(tmp_path.glob("merged.backup-*"))) == first


def test_snapshot_output_refuses_a_directory_and_a_foreign_file(cli, tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    result = cli("snapshot", "-o", folder)
    assert result.code == 2 and f"-o {folder} is a directory; name a file" in result.err
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "data"}')
    foreign = cli("snapshot", "-o", mine)
    assert foreign.code == 2 and "is an existing file that is not a snapshot" in foreign.err
    assert mine.read_text() == '{"my": "data"}'


def test_the_pipeline_replaces_only_its_own_dataset_keeping_a_backup(tmp_path, qwen3_tokenizer_dir):
    from dflash.stages import PipelineContext, _tokenize
    from launcher_core.errors import ConfigError
    from launcher_core.profile import load_profile

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    completions(run_dir / "completions.jsonl", 5)
    profile_path = write_tokenize_profile(tmp_path / "p.toml", qwen3_tokenizer_dir, run_dir)
    ctx = PipelineContext(load_profile(str(profile_path)), run_dir)
    _tokenize(ctx)
    first = tree_digest(run_dir / "dataset")
    completions(run_dir / "completions.jsonl", 8)            # generate added completions: tokenize reruns
    _tokenize(ctx)
    assert tree_digest(next(run_dir.glob("dataset.backup-*"))) == first
    other = tmp_path / "run2"
    build_dataset(other / "dataset", ["a"])                  # a dataset this run dir's pipeline never wrote
    completions(other / "completions.jsonl", 3)
    with pytest.raises(ConfigError, match="pass --force"):
        _tokenize(PipelineContext(load_profile(str(write_tokenize_profile(tmp_path / "q.toml", qwen3_tokenizer_dir,
                                                                           other))), other))
