"""Rows 7-13 of the safety table: damaged inputs end in exit 2 or 4 and one line naming the file
and what to do, never a traceback; nothing is written over them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.data.conftest import build_dataset
from tests.safety.conftest import tree_digest


def first_shard(dataset: Path) -> Path:
    return dataset / json.loads((dataset / "dflash_meta.json").read_text())["shards"][0]["filename"]


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def flip_bytes(path: Path, count: int = 100) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + count] = bytes(255 - b for b in data[middle: middle + count])
    path.write_bytes(bytes(data))


@pytest.fixture
def dataset(tmp_path) -> Path:
    return build_dataset(tmp_path / "ds", [f"r{i}" for i in range(60)], shard_rows=30)


@pytest.mark.parametrize("damage", ["truncated", "zero_bytes"])
def test_inspect_of_a_truncated_shard_names_it_and_what_to_do(cli, dataset, damage):
    shard = first_shard(dataset)
    truncate(shard, 0 if damage == "zero_bytes" else shard.stat().st_size // 2)
    before = tree_digest(dataset)
    result = cli("inspect", dataset)
    assert result.code == 4 and "Traceback" not in result.err
    assert f"{shard}: " in result.err and "recorded in dflash_meta.json" in result.err
    assert "rebuild it with `launcher.py tokenize`" in result.err and len(result.err.strip().splitlines()) == 1
    assert tree_digest(dataset) == before


def test_inspect_of_garbage_meta_names_the_file(cli, dataset):
    (dataset / "dflash_meta.json").write_bytes(b"\x00\x01garbage{")
    result = cli("inspect", dataset)
    assert result.code == 2 and f"{dataset / 'dflash_meta.json'}" in result.err and "Traceback" not in result.err


def test_inspect_and_the_loader_refuse_flipped_bytes_naming_the_backup(cli, dataset, tmp_path):
    from dflash.train.rank.data import verify_dataset
    from launcher_core.errors import DataError

    backup = tmp_path / "ds.backup-20260101-000000"
    shutil.copytree(dataset, backup)
    shard = first_shard(dataset)
    flip_bytes(shard)
    result = cli("inspect", dataset)
    assert result.code == 4 and f"{shard}: its sha256 does not match" in result.err
    assert f"restore it from the backup {backup}" in result.err
    with pytest.raises(DataError, match="sha256 does not match"):
        verify_dataset(dataset, hashes=True)
    verify_dataset(backup, hashes=True)                      # the intact copy passes


@pytest.mark.parametrize("damage", ["bytes_changed", "truncated"])
def test_train_on_a_damaged_shard_is_exit_4_in_one_line_before_launch(cli, dataset, tmp_path, tiny_qwen3_target,
                                                                       private_cache, damage):
    """A shard whose bytes changed (same size: only its sha256 tells) or that was cut short: the launcher
    checks the shards as `inspect` does before torchrun starts: exit 4, one line naming the shard, the
    dataset not used, nothing of a run written (no rank traceback, no exit 5)."""
    from tests.train.conftest import write_profile

    shard, run_dir = first_shard(dataset), tmp_path / "run"
    flip_bytes(shard) if damage == "bytes_changed" else truncate(shard, 100)
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, dataset, run_dir)
    result = cli("train", "--profile", profile, "--skip-preflight")
    assert result.code == 4, result.out + result.err
    [line] = result.err.strip().splitlines()
    problem = "its sha256 does not match" if damage == "bytes_changed" else "100 bytes on disk"
    assert line.startswith(f"error: {shard}: {problem}") and "the dataset is damaged and was not used" in line, line
    assert not (run_dir / "train").exists()


def test_the_loader_checks_sizes_on_every_rank(dataset):
    from dflash.train.rank.data import verify_dataset
    from launcher_core.errors import DataError

    truncate(first_shard(dataset), 100)
    with pytest.raises(DataError, match="bytes on disk"):
        verify_dataset(dataset, hashes=False)


@pytest.mark.parametrize("side", ["base", "add"])
def test_merge_output_refuses_a_corrupt_side(cli, tmp_path, side):
    base, add = build_dataset(tmp_path / "base", ["a", "b"]), build_dataset(tmp_path / "add", ["c"], seed=1)
    flip_bytes(first_shard(base if side == "base" else add), 20)
    result = cli("merge", "--base", base, "--add", add, "--output", tmp_path / "m", "--no-progress")
    assert result.code == 4 and "sha256 does not match" in result.err
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.*"))


def test_merge_with_a_truncated_add_shard_is_exit_4(cli, tmp_path):
    base, add = build_dataset(tmp_path / "base", ["a", "b"]), build_dataset(tmp_path / "add", ["c"], seed=1)
    before = tree_digest(base)
    truncate(first_shard(add), 50)
    for target in (["--output", tmp_path / "m"], ["--in-place"]):
        result = cli("merge", "--base", base, "--add", add, *target, "--no-progress")
        assert result.code == 4 and f"{first_shard(add)}" in result.err and "Traceback" not in result.err
    assert tree_digest(base) == before


def test_a_garbage_shard_with_the_right_size_and_no_hash_is_exit_4(cli, dataset):
    meta_path = dataset / "dflash_meta.json"
    meta = json.loads(meta_path.read_text())
    for shard in meta["shards"]:
        shard.pop("sha256")
    meta_path.write_text(json.dumps(meta))
    shard = first_shard(dataset)
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    result = cli("inspect", dataset)
    assert result.code == 4 and f"{shard}: not a readable Arrow shard" in result.err


@pytest.mark.parametrize("command", [["audit", "--snapshot", "{list}"], ["baseline", "diff", "{list}", "{good}"]])
def test_a_snapshot_that_is_a_json_list_is_exit_2(cli, tmp_path, fixtures_dir, command):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2, 3]")
    good = fixtures_dir / "snapshots" / "rtx6000-x8-baseline.json"
    result = cli(*[part.format(list=listed, good=good) for part in command])
    assert result.code == 2 and f"{listed}: expected a snapshot (a JSON object), found a JSON array" in result.err


def test_writing_a_json_file_over_a_directory_is_exit_2(tmp_path):
    from launcher_core.errors import InputError
    from launcher_core.fileio import write_json_atomic

    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match="is a directory"):
        write_json_atomic(tmp_path / "out", {"a": 1})
    assert (tmp_path / "out").is_dir() and not any((tmp_path / "out").iterdir())


def test_status_of_a_damaged_manifest_is_exit_2(cli, tmp_path):
    (tmp_path / "manifest.json").write_text("[1]")
    result = cli("status", tmp_path)
    assert result.code == 2 and f"{tmp_path / 'manifest.json'}: expected a run manifest" in result.err
    assert (tmp_path / "manifest.json").read_text() == "[1]"


def test_a_snapshot_without_a_key_it_always_has_is_exit_2_naming_the_key(cli, tmp_path, fixtures_dir):
    """Row "a snapshot without its packages key": not a machine without packages ("24 packages not
    installed"), a damaged file."""
    document = json.loads((fixtures_dir / "snapshots" / "rtx6000-x8-baseline.json").read_text())
    intact = tmp_path / "intact.json"
    intact.write_text(json.dumps(document))
    del document["packages"]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(document))
    result = cli("audit", "--profile", "rtx6000-x8", "--snapshot", cut)
    assert result.code == 2 and "Traceback" not in result.err
    assert result.err.startswith(f"error: {cut}: not a valid snapshot: missing key(s) packages (")
    assert "not installed" not in result.out + result.err
    control = cli("audit", "--profile", "rtx6000-x8", "--snapshot", intact)
    assert control.code != 2 and "not a valid snapshot" not in control.err



# A damage to both stage entries (generate's and eval's): what the error says about the first, generate's.
DAMAGED_MANIFESTS = {
    "entry_a_number": ("5", "stages.generate is a number, not an object"),
    "entry_a_list": ("[1]", "stages.generate is an array, not an object"),
    "state_unknown": ('{"state": 3}', "stages.generate.state is 3; valid: pending, running, done, failed, skipped"),
    "path_a_number": ('{"state": "done", "output": 7, "checkpoint": 7}',
                      "stages.generate.output is a number; valid: a string (or null)"),
}


@pytest.mark.parametrize("damage", [*sorted(DAMAGED_MANIFESTS), "truncated"])
def test_generate_and_eval_on_a_damaged_manifest_are_exit_2_naming_it(cli, tmp_path, tiny_qwen3_target, damage,
                                                                     private_cache):
    """Row "a damaged manifest.json": wrong JSON types in a stage entry, or a file cut short, is exit 2
    naming the file and the key, for the commands that update it (generate, eval) as for status; the
    file is left as it is (no TypeError from launcher_core.manifest, no exit 70)."""
    from tests.generate.gen_helpers import write_profile, write_prompts

    entry, said = DAMAGED_MANIFESTS.get(damage, ("", "line 1: not valid JSON"))
    text = f'{{"stages": {{"generate": {entry}, "eval": {entry}}}}}' if entry else '{"stages": {"generate": {"sta'
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manifest = run_dir / "manifest.json"
    manifest.write_text(text)
    write_prompts(tmp_path / "prompts.jsonl", 2)
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, run_dir, tmp_path / "prompts.jsonl")
    (tmp_path / "draft").mkdir()
    for argv in (["generate", "--profile", profile, "--skip-preflight", "--no-progress", "--endpoint", "http://127.0.0.1:9"],
                 ["eval", "--profile", profile, "--draft", tmp_path / "draft", "--run-dir", run_dir],
                 ["status", run_dir]):
        result = cli(*argv)
        assert result.code == 2, (argv[0], result.err)
        assert result.err.startswith(f"error: {manifest}: ") and said in result.err, result.err
        assert "Traceback" not in result.err and manifest.read_text() == text
    assert not (private_cache / "crashes").exists()


@pytest.mark.parametrize("field, value", [("host.ram_total_mib", -1), ("host.ram_available_mib", -65536),
                                          ("gpus.0.memory_free_mib", -5), ("host.disks.0.free_mib", -1)])
def test_a_snapshot_with_a_negative_size_is_exit_2_naming_the_field_and_the_range(cli, tmp_path, fixtures_dir,
                                                                                  field, value):
    """Row "a snapshot with negative RAM": refused as a damaged file (exit 2: the file, the field, the value and
    the valid range), not audited or planned as a machine with less than no memory. The control: the intact
    file audits."""
    document = json.loads((fixtures_dir / "snapshots" / "rtx6000-x8-baseline.json").read_text())
    node = document
    *parents, last = field.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[last] = value
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(document))
    shown = field.replace(".0.", "[0].").replace(".0", "[0]")
    for command in (["audit", "--profile", "rtx6000-x8", "--snapshot", damaged],
                    ["plan", "--profile", "rtx6000-x8", "--snapshot", damaged]):
        result = cli(*command)
        assert result.code == 2 and "Traceback" not in result.err, result.err
        assert result.err.strip() == (f"error: {damaged}: not a valid snapshot: snapshot.{shown}: {value} is out of "
                                      "range; valid: an integer >= 0"), result.err
    control = cli("audit", "--profile", "rtx6000-x8", "--snapshot", fixtures_dir / "snapshots" / "rtx6000-x8-baseline.json")
    assert control.code != 2 and "not a valid snapshot" not in control.err
