"""The node's faults are not the user's: a read-only filesystem, a directory this user
may not write and the host out of memory are exit 7 (EXIT_NODE) with one line naming the path and what
to do, from every command, never exit 70 with a crash report; the user's own mistakes that could crash
(a file where paths.run_dir needs a directory, `latest` a directory, eval.engine_python missing, a
profile not UTF-8 or a directory) are exit 2 naming the key or the file. The read-only filesystems are
real mounts (a bind mount remounted read-only, a read-only tmpfs: they need root; skipped with the
reason where mount is refused); permission denied is a real non-root process (setpriv) writing into a
root-owned directory, since root itself ignores modes."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from launcher_core.errors import EXIT_NODE, EXIT_USAGE
from tests.safety.conftest import completions, save_real_checkpoint, tree_digest, write_tokenize_profile
from tests.safety.runs import REPO

READ_ONLY = "error: read-only filesystem: {path} cannot be written (the filesystem that holds it is mounted read-only"


def mount(*argv: str) -> None:
    result = subprocess.run(["mount", *argv], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount here (mount {' '.join(argv)} needs root): {result.stderr.strip()}")


@pytest.fixture(scope="module")
def read_only_tree(tmp_path_factory, tiny_qwen3_target, qwen3_tokenizer_dir) -> Iterator[dict[str, Path]]:
    """A run directory with a real checkpoint, a dataset to merge and a profile per command, all on a
    bind mount remounted read-only (what the commands see is `ro`; `src` is the same tree, writable)."""
    from tests.data.conftest import build_dataset
    from tests.train.conftest import write_dataset, write_profile

    top = tmp_path_factory.mktemp("node")
    src, ro = top / "src", top / "ro"
    src.mkdir()
    ro.mkdir()
    write_dataset(src / "data", rows=8)
    save_real_checkpoint(write_profile(top / "src.toml", tiny_qwen3_target, src / "data", src / "run"), src / "run", 1)
    build_dataset(src / "base", [f"b{i}" for i in range(10)])
    build_dataset(top / "add", [f"a{i}" for i in range(10)], seed=1)
    (src / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt": "What is 2 + 2?"}) + "\n", encoding="utf-8")
    tree = {"top": top, "ro": ro, "add": top / "add", "completions": completions(top / "in.jsonl", 4),
            "train": write_profile(top / "train.toml", tiny_qwen3_target, ro / "data", ro / "run"),
            "tokenize": write_tokenize_profile(top / "tok.toml", qwen3_tokenizer_dir, top / "tok-run")}
    mount("--bind", str(src), str(ro))
    try:
        mount("-o", "remount,bind,ro", str(ro))
        yield tree
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def launcher(*argv: object, cache: Path, user: str = "") -> subprocess.CompletedProcess:
    """`launcher.py ARGV` as a real process (as `user`, a uid, through setpriv, when given)."""
    prefix = ["setpriv", "--reuid", user, "--regid", user, "--clear-groups"] if user else []
    env = {**os.environ, "DFLASH_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HOME": str(cache)}
    return subprocess.run([*prefix, sys.executable, str(REPO / "launcher.py"), *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)


def assert_one_node_line(result: subprocess.CompletedProcess, starts: str, cache: Path) -> None:
    """Exit 7, the last line of stderr the one error line, no traceback and no crash report."""
    assert result.returncode == EXIT_NODE, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(starts), result.stderr
    assert "Traceback" not in result.stderr and "bug" not in result.stderr
    assert not (cache / "crashes").exists()


COMMANDS = {   # command -> (argv under the tree, the path its line names, relative to `ro`)
    "tokenize": (["tokenize", "--profile", "{tokenize}", "--input", "{completions}", "--output", "{ro}/ds",
                  "--workers", "1", "--no-progress"], ".ds.tokenize-"),
    "tokenize --force": (["tokenize", "--profile", "{tokenize}", "--input", "{completions}", "--output", "{ro}/base",
                          "--force", "--workers", "1", "--no-progress"], ".base.tokenize-"),
    "merge": (["merge", "--base", "{ro}/base", "--add", "{add}", "--output", "{ro}/merged", "--no-progress"],
              ".merged.merge-"),
    "merge --in-place": (["merge", "--base", "{ro}/base", "--add", "{add}", "--in-place", "--no-progress"],
                         ".base.backup-"),
    "export": (["export", "{ro}/run/train/checkpoints/step-1", "--for", "sglang", "-o", "{ro}/out"], ".out."),
    "train": (["train", "--profile", "{train}", "--skip-preflight"], "run/.run.lock"),
    "train --resume": (["train", "--profile", "{train}", "--skip-preflight", "--resume"], "run/.run.lock"),
    "eval": (["eval", "--profile", "{train}", "--num-prompts", "1", "--max-new-tokens", "2"], "run/.run.lock"),
    "generate": (["generate", "--profile", "{train}", "--input", "{ro}/prompts.jsonl", "--endpoint",
                  "http://127.0.0.1:9/v1", "--skip-preflight", "--no-progress"], "run/"),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_read_only_filesystem_is_the_nodes_fault(read_only_tree, command, tmp_path):
    """Each command writing onto the read-only mount: exit 7, the path it could not write, what to do;
    the tree is unchanged; no exit 70 and no crash report (EROFS on the lock or a staging path)."""
    argv, named = COMMANDS[command]
    ro = read_only_tree["ro"]
    before = tree_digest(ro)
    result = launcher(*(arg.format(**read_only_tree) for arg in argv), cache=tmp_path / "cache")
    assert_one_node_line(result, READ_ONLY.format(path=ro / named).split(" cannot")[0], tmp_path / "cache")
    assert ("; run on a node where it is writable, remount it read-write, or choose another directory"
            in result.stderr), result.stderr
    assert tree_digest(ro) == before


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can read (pytest's tmp_path is root's own), removed after the test."""
    top = Path(tempfile.mkdtemp(prefix="dflash-node-"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def test_a_directory_this_user_may_not_write_is_the_nodes_fault(shared_dir):
    """A process of uid 65534 merging into a root-owned 0755 directory (a run directory of another user):
    exit 7 naming the path, its owner and mode, and the uid that ran; nothing is written."""
    from tests.data.conftest import build_dataset

    if os.geteuid() != 0:
        pytest.skip("needs root to run a command as another user (setpriv)")
    base = build_dataset(shared_dir / "base", [f"b{i}" for i in range(10)])
    add = build_dataset(shared_dir / "add", [f"a{i}" for i in range(10)], seed=1)
    foreign, cache = shared_dir / "foreign", shared_dir / "cache"
    foreign.mkdir(mode=0o755)
    cache.mkdir()
    os.chown(cache, 65534, 65534)
    for path in shared_dir.rglob("*"):
        path.chmod(path.stat().st_mode | 0o055)     # readable by the other user (mkdir's umask may not allow it)
    foreign.chmod(0o755)
    result = launcher("merge", "--base", base, "--add", add, "--output", foreign / "merged", "--no-progress",
                      cache=cache, user="65534")
    assert_one_node_line(result, f"error: permission denied: {foreign}/.merged.merge-", cache)
    assert (f"({foreign} is owned by uid 0, mode 0755; this process runs as uid 65534); fix its owner or "
            f"permissions (chown, chmod), run as its owner, or use another directory or node") in result.stderr
    assert list(foreign.iterdir()) == []


@pytest.mark.slow
def test_a_rank_that_meets_a_read_only_checkpoints_folder_ends_the_run_as_the_nodes_fault(tmp_path, tiny_qwen3_target):
    """Two gloo ranks train into a run directory whose train/checkpoints is a read-only tmpfs: rank 0's
    first save meets EROFS. The rank records it (`kind` node_fault) and the launcher ends exit 7 with one
    line naming the rank and the path, the manifest's train stage `ended_by` "node fault"."""
    from tests.safety.runs import finish, start_train
    from tests.train.conftest import write_dataset, write_profile

    run_dir = tmp_path / "run"
    checkpoints = run_dir / "train" / "checkpoints"
    checkpoints.mkdir(parents=True)
    mount("-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(checkpoints))
    try:
        profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=8),
                                run_dir, max_steps=4, save_every_steps=2)
        code, out = finish(start_train(profile, run_dir))
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], capture_output=True)
    assert code == EXIT_NODE, out
    [line] = [line for line in out.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: rank 0: read-only filesystem: {checkpoints}/.step-2.") and "Traceback" not in out
    assert line.endswith("then no checkpoint was written yet: train again to start over"), line
    record = json.loads((run_dir / "train" / "failures" / "rank-0.json").read_text())
    assert record["kind"] == "node_fault"
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert entry["state"] == "failed" and entry["ended_by"] == "node fault"


def test_the_host_out_of_memory_is_the_nodes_fault_and_a_bisect_skip():
    """A real MemoryError (an allocation the host refuses) is a NodeFault naming the memory available; in
    `probe` (read by `git bisect run`) it is "cannot test", not "bad". A PermissionError naming no path
    (os.kill of another user's process) is not the node's: it stays a crash."""
    from launcher_core.crash import known_exit_code
    from launcher_core.errors import EXIT_CANNOT_TEST, exit_code_for
    from launcher_core.nodefault import known_error

    try:
        bytearray(1 << 62)
    except MemoryError as error:
        fault = known_error(error)
    assert fault is not None and str(fault).startswith("the host ran out of memory (MemoryError; ")
    assert " available now): free memory on this node (stop other processes) or run on a node with more" in str(fault)
    assert known_exit_code("train", exit_code_for(fault)) == EXIT_NODE
    assert known_exit_code("probe", exit_code_for(fault)) == EXIT_CANNOT_TEST
    assert known_error(PermissionError(errno.EPERM, "Operation not permitted")) is None    # os.kill's, no path


# The user's own mistakes that could end in exit 70: exit 2 naming the key or file.

def test_a_run_dir_under_a_file_names_the_key(cli, tmp_path, tiny_qwen3_target):
    from tests.train.conftest import write_dataset, write_profile

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=4),
                            blocker / "run")
    for argv in (("train", "--profile", profile, "--skip-preflight"), ("pipeline", "--profile", profile)):
        result = cli(*argv)
        assert result.code == EXIT_USAGE, result.err
        assert result.err.strip().splitlines()[-1] == (
            f"error: paths.run_dir (or --run-dir) = {blocker / 'run'}: {blocker} is a file, not a directory; set it "
            f"to a directory (an existing one or one it can create)"), result.err
    assert blocker.read_text() == "not a directory\n"


def test_a_latest_that_is_a_directory_is_named_and_left_alone(cli, tmp_path, tiny_qwen3_target):
    from tests.train.conftest import write_dataset, write_profile

    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=4),
                            tmp_path / "run")
    checkpoint = save_real_checkpoint(profile, tmp_path / "run", 1)
    pointer = checkpoint.parent / "latest"
    pointer.unlink()
    (pointer / "inside").mkdir(parents=True)
    for argv in (("export", checkpoint.parent, "--for", "vllm"),
                 ("train", "--profile", profile, "--skip-preflight", "--resume")):
        result = cli(*argv)
        assert result.code == EXIT_USAGE, result.err
        assert result.err.strip().splitlines()[-1] == (
            f"error: {pointer}: a directory, not the checkpoint pointer (a text file naming one step directory, e.g. "
            f"step-500); move it out of {checkpoint.parent} and run again (the launcher does not remove what it did "
            f"not write)"), result.err
    assert (pointer / "inside").is_dir()


def test_a_missing_engine_python_names_the_key():
    import dataclasses

    from dflash.eval.engines import check_engine_installed
    from launcher_core.errors import ConfigError
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    profile = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_python="/no/such/python"))
    with pytest.raises(ConfigError) as refused:
        check_engine_installed("vllm", profile)
    assert str(refused.value).startswith("eval.engine_python = '/no/such/python': no such file (or command on PATH); "
                                         "set it to the python of the environment that has the engine")


@pytest.mark.parametrize("content, said", [
    ('extends = "cpu-demo"\n'.encode("utf-16"), "not UTF-8 text (byte 0: b'\\xff')"),
    (b'extends = "cpu-demo"\n# caf\xe9\n', "not UTF-8 text (byte 26: b'\\xe9')"),
    (None, "a directory, not a profile; --profile takes a profile name (`launcher.py profiles` lists them) or a TOML file"),
])
def test_a_profile_not_utf8_or_a_directory_names_the_file(cli, tmp_path, content, said):
    path = tmp_path / "p.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    for given in ((path, tmp_path) if content is None else (path,)):
        result = cli("plan", "--profile", given)
        assert result.code == EXIT_USAGE and result.err.startswith(f"error: {given}: {said}"), result.err
