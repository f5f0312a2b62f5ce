"""`merge`: sums, de-duplication, refusals that name the difference, verified backup, kill safety,
bounded memory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.data import load_training_dataset, merge_datasets
from dflash.data.dataset_io import SHARD_DELAY_ENV, read_meta
from launcher_core.errors import ConfigError, DataError
from tests.data.conftest import build_dataset, directory_digest

IDS_A = [f"a{i}" for i in range(120)]
IDS_B = [f"b{i}" for i in range(80)]


def test_merge_to_new_output_sums_rows_and_tokens(dataset_factory, tmp_path):
    base, add = dataset_factory("base", IDS_A, seed=1), dataset_factory("add", IDS_B, seed=2)
    before = directory_digest(base)
    summary = merge_datasets(base, add, output=tmp_path / "merged", progress=False)
    merged = load_training_dataset(tmp_path / "merged")
    assert merged["id"] == IDS_A + IDS_B
    base_meta, add_meta, meta = read_meta(base), read_meta(add), read_meta(tmp_path / "merged")
    assert meta["rows"] == summary.rows == 200 and meta["tokens"] == base_meta["tokens"] + add_meta["tokens"]
    assert meta["loss_tokens"] == base_meta["loss_tokens"] + add_meta["loss_tokens"] == sum(merged["num_loss_tokens"])
    assert merged[150]["input_ids"] == load_training_dataset(add)[30]["input_ids"]
    assert [s["path"] for s in meta["sources"]] == ["synthetic-1", "synthetic-2"] and meta["history"][-1]["add_rows"] == 80
    assert directory_digest(base) == before


def test_dedup_by_id_and_by_content(dataset_factory, tmp_path):
    base = dataset_factory("base", IDS_A, seed=1)
    overlap = dataset_factory("overlap", IDS_A[:30] + IDS_B[:10] + IDS_B[:5], seed=3)  # 30 ids in base, 5 repeats
    by_id = merge_datasets(base, overlap, output=tmp_path / "by-id", dedup="id", progress=False)
    assert by_id.dropped_duplicates == 35 and by_id.rows == 130
    assert load_training_dataset(tmp_path / "by-id")["id"][120:] == IDS_B[:10]
    same_tokens = dataset_factory("same", [f"x{i}" for i in range(120)], seed=1)  # same content, new ids
    by_content = merge_datasets(base, same_tokens, output=tmp_path / "by-content", dedup="content", progress=False)
    assert by_content.dropped_duplicates == 120 and by_content.rows == 120
    assert by_content.dropped_tokens == read_meta(same_tokens)["tokens"]
    kept = merge_datasets(base, same_tokens, output=tmp_path / "kept", dedup="id", progress=False)
    assert kept.dropped_duplicates == 0 and kept.rows == 240


def test_refuses_mismatched_fingerprint_and_columns_naming_them(dataset_factory, tmp_path):
    base = dataset_factory("base", IDS_A[:20])
    other_tokenizer = dataset_factory("other", IDS_B[:20], fingerprint="tok-B")
    with pytest.raises(DataError, match="tokenizer fingerprint differs"):
        merge_datasets(base, other_tokenizer, output=tmp_path / "m", progress=False)
    retyped = _rewrite_column(dataset_factory("retyped", IDS_B[:20]), "length", "int64")
    with pytest.raises(DataError, match=r"column 'length' has dtype int32 in the base but int64 in the added"):
        merge_datasets(base, retyped, output=tmp_path / "m", progress=False)
    dropped = _rewrite_column(dataset_factory("dropped", IDS_B[:20]), "empty_reasoning", None)
    with pytest.raises(DataError, match=r"column 'empty_reasoning' is only in the base"):
        merge_datasets(base, dropped, output=tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()
    with pytest.raises(ConfigError, match="exactly one of --output DATASET or --in-place"):
        merge_datasets(base, other_tokenizer, progress=False)


def _rewrite_column(directory: Path, column: str, new_type: str | None) -> Path:
    """Rewrite every shard with `column` cast to `new_type` (or dropped)."""
    import pyarrow as pa

    for shard in sorted(directory.glob("data-*.arrow")):
        table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
        table = table.drop_columns([column]) if new_type is None else \
            table.set_column(table.schema.get_field_index(column), column, table[column].cast(new_type))
        with pa.OSFile(str(shard) + ".new", "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(str(shard) + ".new", shard)
    _rerecord_shards(directory)
    return directory


def _rerecord_shards(directory: Path) -> None:
    """Record the rewritten shards' sizes and sha256 (a consistent dataset with other columns)."""
    from dflash.data.dataset_io import META_NAME, file_sha256

    meta = json.loads((directory / META_NAME).read_text())
    for shard in meta["shards"]:
        path = directory / shard["filename"]
        shard["bytes"], shard["sha256"] = path.stat().st_size, file_sha256(path)
    (directory / META_NAME).write_text(json.dumps(meta))


def test_in_place_backs_up_verified_then_replaces(dataset_factory, tmp_path):
    base, add = dataset_factory("base", IDS_A, seed=1), dataset_factory("add", IDS_B, seed=2)
    before = directory_digest(base)
    summary = merge_datasets(base, add, in_place=True, progress=False)
    assert directory_digest(Path(summary.backup)) == before
    assert read_meta(base)["rows"] == 200 and load_training_dataset(base)["id"] == IDS_A + IDS_B
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_in_place_refuses_a_base_that_no_longer_matches_its_checksums(dataset_factory, tmp_path):
    base, add = dataset_factory("base", IDS_A, seed=1), dataset_factory("add", IDS_B, seed=2)
    shard = sorted(base.glob("data-*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = directory_digest(base)
    with pytest.raises(DataError, match="does not match the sha256.*nothing merged"):
        merge_datasets(base, add, in_place=True, progress=False)
    assert directory_digest(base) == before and not list(tmp_path.glob("base.backup-*"))


def _start_merge(repo_root: Path, args: list[str], delay: float) -> subprocess.Popen:
    env = {**os.environ, SHARD_DELAY_ENV: str(delay)}
    return subprocess.Popen([sys.executable, "launcher.py", "merge", "--no-progress", *args], cwd=repo_root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _kill_when(process: subprocess.Popen, condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "merge never reached the point to kill it at"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def _staged_shards(parent: Path, name: str) -> int:
    return sum(len(list(d.glob(".shard-*.arrow"))) for d in parent.glob(f".{name}.merge-*"))


@pytest.mark.slow
def test_merge_killed_halfway_leaves_base_intact_and_no_half_dataset(dataset_factory, tmp_path, repo_root):
    base, add = dataset_factory("base", IDS_A, seed=1), dataset_factory("add", IDS_B, seed=2)
    before = directory_digest(base)
    output = tmp_path / "merged"
    process = _start_merge(repo_root, ["--base", str(base), "--add", str(add), "--output", str(output),
                                       "--shard-rows", "20"], delay=0.3)
    _kill_when(process, lambda: _staged_shards(tmp_path, "merged") >= 2)
    assert not output.exists() and directory_digest(base) == before
    # in place: killed while writing the merged shards (the backup is done by then)
    process = _start_merge(repo_root, ["--base", str(base), "--add", str(add), "--in-place", "--shard-rows", "20"], 0.3)
    _kill_when(process, lambda: _staged_shards(tmp_path, "base") >= 2)
    assert directory_digest(base) == before and read_meta(base)["rows"] == 120
    # the next run cleans up the stale staging directories and completes
    done = _start_merge(repo_root, ["--base", str(base), "--add", str(add), "--output", str(output)], 0)
    assert done.wait(timeout=60) == 0, done.communicate()
    assert read_meta(output)["rows"] == 200 and not list(tmp_path.glob(".merged.*"))


@pytest.mark.slow
def test_merge_memory_stays_bounded(tmp_path, repo_root):
    """Merging ~180 MB of token rows must not hold them in memory: the Arrow pool's peak stays at
    a few record batches, and the peak RSS (after a warm-up merge of a tiny dataset has paid for
    imports and kernel set-up) grows by far less than the data."""
    base = build_dataset(tmp_path / "base", [f"r{i}" for i in range(3000)], seed=1, tokens=8000, shard_rows=500,
                         batch_rows=50)
    add = build_dataset(tmp_path / "add", [f"s{i}" for i in range(3000)], seed=2, tokens=8000, shard_rows=500,
                        batch_rows=50)
    tiny = [build_dataset(tmp_path / f"tiny{i}", [f"t{i}-{j}" for j in range(4)], seed=i) for i in range(2)]
    data_bytes = sum(p.stat().st_size for d in (base, add) for p in d.glob("*.arrow"))
    script = ("import json, re, sys, pyarrow as pa\n"
              "from dflash.data.merge import merge_datasets\n"
              "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) * 1024\n"
              "merge_datasets(sys.argv[4], sys.argv[5], output=sys.argv[6], dedup='content', progress=False)\n"
              "before = hwm()\n"
              "merge_datasets(sys.argv[1], sys.argv[2], output=sys.argv[3], dedup='content', progress=False)\n"
              "print(json.dumps({'before': before, 'peak': hwm(), 'pool': pa.default_memory_pool().max_memory()}))\n")
    done = subprocess.run([sys.executable, "-c", script, str(base), str(add), str(tmp_path / "merged"),
                           str(tiny[0]), str(tiny[1]), str(tmp_path / "tiny-merged")],
                          cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert data_bytes > 150e6 and read_meta(tmp_path / "merged")["rows"] == 6000
    assert figures["pool"] < data_bytes / 20, figures
    assert figures["peak"] - figures["before"] < data_bytes / 5, (figures, data_bytes)  # ~25 MB, flat in size
