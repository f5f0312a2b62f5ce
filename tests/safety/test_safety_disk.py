"""A full disk is the environment's error, not a bug (issue rows "disk full" and "`train --run-dir D`
with the preflight"): every writer (tokenize, merge, export, generate, a training checkpoint) onto
a real, small tmpfs exits 7 (EXIT_NODE: the node's fault, not the input's) with "disk full", the path,
the bytes it needed and the bytes free; nothing the user had is changed, no staging is left on the full disk, and no crash report is
written. The preflight's disk check reads the directory the command will write."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from launcher_core.errors import EXIT_NODE
from tests.safety.conftest import fill, save_real_checkpoint, tree_digest, write_tokenize_profile

NEEDED = re.compile(r"needs about ([\d,]+) bytes")


def needed_bytes(message: str) -> int:
    match = NEEDED.search(message)
    assert match, message
    return int(match.group(1).replace(",", ""))


def long_completions(path: Path, count: int) -> Path:
    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}? " * 20},
                                             {"role": "assistant", "reasoning_content": "Adding the two. " * 30,
                                              "content": f"It is {2 * i}. " * 20}]} for i in range(count)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def assert_disk_full(result, path: Path, what: str, private_cache: Path) -> None:
    assert result.code == EXIT_NODE, result.err
    assert f"error: disk full: writing {what} to {path} needs about " in result.err, result.err
    assert "free on that filesystem" in result.err and "bug" not in result.err and "Traceback" not in result.err
    assert not (private_cache / "crashes").exists()


def test_tokenize_onto_a_full_disk(cli, small_fs, tmp_path, qwen3_tokenizer_dir, private_cache):
    disk = small_fs("disk", 256 * 1024)
    profile = write_tokenize_profile(tmp_path / "p.toml", qwen3_tokenizer_dir, tmp_path / "run")
    source = long_completions(tmp_path / "in.jsonl", 400)          # ~1 MB of dataset
    before = tree_digest(source)
    args = ("tokenize", "--profile", profile, "--input", source, "--workers", "1", "--no-progress")
    result = cli(*args, "--output", disk / "ds")
    assert_disk_full(result, disk / "ds", "the tokenized dataset", private_cache)
    assert list(disk.iterdir()) == [] and tree_digest(source) == before       # no staging left, input intact
    control = cli(*args, "--output", tmp_path / "ds")                          # the same, with room
    assert control.code == 0, control.err
    actual = sum(p.stat().st_size for p in (tmp_path / "ds").iterdir())
    assert 0.5 * actual < needed_bytes(result.err) < 2 * actual


def test_export_onto_a_full_disk(cli, small_fs, tmp_path, tiny_qwen3_target, private_cache):
    from tests.train.conftest import write_dataset, write_profile

    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=8), tmp_path / "run")
    checkpoint = save_real_checkpoint(profile, tmp_path / "run", 1)
    before = tree_digest(checkpoint)
    disk = small_fs("disk", 64 * 1024)
    result = cli("export", checkpoint, "--for", "sglang", "-o", disk / "out")
    assert_disk_full(result, disk / "out", "the exported drafter", private_cache)
    weights = (checkpoint / "model.safetensors").stat().st_size
    assert weights <= needed_bytes(result.err) < weights + 2**17
    assert list(disk.iterdir()) == [] and tree_digest(checkpoint) == before


def merge_inputs(tmp_path: Path) -> tuple[Path, Path]:
    from tests.data.conftest import build_dataset

    base = build_dataset(tmp_path / "base", [f"b{i}" for i in range(400)], tokens=256)
    add = build_dataset(tmp_path / "add", [f"a{i}" for i in range(400)], seed=1, tokens=256)
    return base, add


def test_merge_onto_a_full_disk_and_a_full_backup_disk(cli, small_fs, tmp_path, private_cache):
    base, add = merge_inputs(tmp_path)
    before = {**tree_digest(base), **{f"add/{k}": v for k, v in tree_digest(add).items()}}
    disk = small_fs("disk", 256 * 1024)
    result = cli("merge", "--base", base, "--add", add, "--output", disk / "merged", "--no-progress")
    assert_disk_full(result, disk / "merged", "the merged dataset", private_cache)
    inputs = sum(p.stat().st_size for p in (*base.iterdir(), *add.iterdir()))
    assert needed_bytes(result.err) == inputs
    in_place = cli("merge", "--base", base, "--add", add, "--in-place", "--backup-dir", disk, "--no-progress")
    assert_disk_full(in_place, disk, "the backup of the base (then the merged dataset)", private_cache)
    assert needed_bytes(in_place.err) == inputs + sum(p.stat().st_size for p in base.iterdir())
    assert list(disk.iterdir()) == [] and not list(tmp_path.glob(".base*"))
    assert {**tree_digest(base), **{f"add/{k}": v for k, v in tree_digest(add).items()}} == before


def test_a_kill_during_merge_in_place_leaves_a_copy_the_next_merge_removes(cli, tmp_path):
    """Row "kill -9 during merge --in-place": the base is intact, and the partial backup copy the
    kill left is removed by the next merge, which says so."""
    import signal
    import sys

    from tests.safety.runs import REPO, Inotify

    base, add = merge_inputs(tmp_path)
    before = tree_digest(base)
    watch = Inotify(tmp_path)
    merge = subprocess.Popen([sys.executable, str(REPO / "launcher.py"), "merge", "--base", str(base), "--add", str(add),
                              "--in-place", "--no-progress"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import select

        copy = None
        while copy is None and merge.poll() is None:
            select.select([watch.fd], [], [], 1.0)
            copy = next((n for n in watch.names() if n.startswith(".base.backup-") and ".copy-" in n), None)
        merge.send_signal(signal.SIGSTOP)             # hold it inside the copy, then kill it there
        assert copy is not None and (tmp_path / copy).is_dir(), "the merge finished before its copy was caught"
        merge.kill()
        merge.wait()
    finally:
        watch.close()
        merge.kill()
    assert tree_digest(base) == before and (tmp_path / copy).is_dir()
    again = cli("merge", "--base", base, "--add", add, "--in-place", "--no-progress")
    assert again.code == 0, again.err
    assert f"note: removed {tmp_path / copy}: left behind by an interrupted merge or tokenize" in again.out
    assert not (tmp_path / copy).exists()


def test_generate_onto_a_full_disk_keeps_every_whole_completion(small_fs, tmp_path, served_tiny_model, tiny_qwen3_target):
    import sys

    from tests.generate.gen_helpers import launcher_env, read_output_ids, write_prompts
    from tests.generate.gen_helpers import write_profile as write_generate_profile
    from tests.safety.runs import REPO

    ids = write_prompts(tmp_path / "prompts.jsonl", 60)
    profile = write_generate_profile(tmp_path / "p.toml", tiny_qwen3_target, tmp_path / "run", tmp_path / "prompts.jsonl")
    disk = small_fs("disk", 8 * 1024)
    argv = [sys.executable, str(REPO / "launcher.py"), "generate", "--profile", str(profile), "--endpoint",
            served_tiny_model, "--output", str(disk / "completions.jsonl"), "--skip-preflight", "--no-progress"]
    env = {**launcher_env(), "DFLASH_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == EXIT_NODE, result.stderr
    assert f"error: disk full: writing 60 completions to {disk / 'completions.jsonl'} needs about" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "cache" / "crashes").exists()
    written = read_output_ids(disk / "completions.jsonl")                   # whole lines only
    assert written and len(written) < 60 and len(set(written)) == len(written)
    subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)      # room again: it resumes
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert sorted(read_output_ids(disk / "completions.jsonl")) == sorted(ids)       # every prompt once
    whole = (disk / "completions.jsonl").stat().st_size
    assert 0.7 * whole < needed_bytes(result.stderr) < 1.5 * whole


@pytest.mark.slow
def test_a_full_disk_inside_a_checkpoint_save(small_fs, tmp_path, tiny_qwen3_target):
    """Two gloo ranks; after the step-2 checkpoint the disk is filled to ~250 KiB free, so the next save
    fails (in torch.distributed.checkpoint's shard files or in torch.save of training_state.pt,
    whichever meets the full disk first) and leaves no staging directory. On a loaded machine the ranks
    may have saved step-4 before the disk is filled: the save that fails is then a later one, and the
    message names the checkpoint `latest` points to (40 steps: there is always a later save)."""
    from dflash.drafter.verify import verify_checkpoint
    from tests.safety.runs import finish, start_train, wait_for
    from tests.train.conftest import write_dataset, write_profile

    disk = small_fs("disk", 64 * 2**20)
    run_dir = disk / "run"
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data"), run_dir,
                            max_steps=40, save_every_steps=2)
    process = start_train(profile, run_dir)
    pointer = run_dir / "train" / "checkpoints" / "latest"
    wait_for(lambda: pointer.exists() and pointer.read_text().strip() == "step-2", what="the step-2 checkpoint")
    fill(disk, 250 * 1024)
    code, out = finish(process)
    assert code == EXIT_NODE, out
    # every rank writes its shards (torch.distributed.checkpoint): whichever met the full disk first is named
    assert re.search(rf"error: rank [01]: disk full: writing a checkpoint \(and the run's logs\) to "
                     rf"{re.escape(str(run_dir / 'train'))} needs about", out), out
    latest = pointer.read_text().strip()
    assert latest != "step-40", out                           # the full disk stopped the run
    assert f"then the last complete checkpoint is {latest}: continue from it with --resume" in out
    assert "unexpected pos" not in out and "failed unexpectedly" not in out and "Traceback" not in out
    step = run_dir / "train" / "checkpoints" / latest
    whole = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    assert whole < needed_bytes(out) < 1.2 * whole           # what the save writes, judged from the drafter's state
    assert verify_checkpoint(step) == [] and not list(step.parent.glob(".step-*"))
    records = [json.loads(p.read_text()) for p in (run_dir / "train" / "failures").glob("rank-*.json")]
    assert any(record["kind"] == "disk_full" for record in records)
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert entry["state"] == "failed" and entry["ended_by"] == "disk full"


def test_a_checkpoint_writer_error_is_a_full_disk_only_where_the_save_does_not_fit(small_fs):
    """What both ranks of a save get when torch's zip writer met ENOSPC: DCP's CheckpointException holding
    each rank's "unexpected pos" RuntimeError (the OSError is lost). It is a full disk where the save needs
    more than the filesystem has free (judged before the staging directory goes), and not where the save
    fits: a writer error on a disk with room keeps its own words. An ENOSPC OSError inside it is a full
    disk whatever the figures. The staging directory is removed either way."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from dflash.train.rank.sharded_checkpoints import abandon_save
    from launcher_core.errors import DiskFull

    disk = small_fs("disk", 3 * 2**20)
    run_dir = disk / "run"
    writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    gathered = CheckpointException("write", {0: (writer, []), 1: (writer, [])})

    folder = run_dir / "train" / "checkpoints" / ".step-2.x.tmp"

    def staging() -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    full = abandon_save(gathered, staging(), run_dir, True, 6_900_000)
    assert isinstance(full, DiskFull) and str(full).startswith(f"disk full: writing a checkpoint (and the run's logs) "
                                                               f"to {run_dir / 'train'} needs about 6,900,000 bytes")
    assert not folder.exists()
    assert abandon_save(gathered, staging(), run_dir, True, 200_000) is None and not folder.exists()
    enospc = OSError(errno.ENOSPC, "No space left on device")
    assert isinstance(abandon_save(CheckpointException("write", {1: (enospc, [])}), staging(), run_dir, False, 100), DiskFull)


BIG_DRAFTER = {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128}   # checkpoints of 6.9 MB, the last 9.1
FREE = re.compile(r"; ([\d,]+) bytes(?: \([\d.]+ [KMG]iB\))? free on that filesystem")


def assert_one_disk_full_line(code: int, out: str, run_dir: Path) -> str:
    """Exit 2 and one line naming the full disk, with the bytes the save needs (more than were free), and
    no traceback, torch writer's words or torchrun failure report anywhere in the output."""
    assert code == EXIT_NODE, out
    [line] = [line for line in out.splitlines() if "disk full" in line]
    assert re.match(rf"error: rank [01]: disk full: writing a checkpoint \(and the run's logs\) to "
                    rf"{re.escape(str(run_dir / 'train'))} needs about [\d,]+ bytes", line), out
    free = FREE.search(line)
    assert free and needed_bytes(line) > int(free.group(1).replace(",", "")), line
    for noise in ("Traceback", "unexpected pos", "CheckpointException", "FAILED", "failed (exitcode"):
        assert noise not in out, out
    return line


def assert_ended_by_disk_full(run_dir: Path) -> None:
    records = [json.loads(p.read_text()) for p in (run_dir / "train" / "failures").glob("rank-*.json")]
    assert any(record.get("kind") == "disk_full" for record in records)
    entry = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert entry["state"] == "failed" and entry["ended_by"] == "disk full"


@pytest.mark.slow
def test_a_full_disk_at_the_first_save_is_named_with_what_the_save_needs(small_fs, tmp_path, tiny_qwen3_target):
    """The run directory on a 3 MB filesystem: the first checkpoint (6.9 MB, written by DCP's thread,
    train.async_save) cannot fit. The writer's ENOSPC reaches both ranks as DCP's CheckpointException holding
    torch's zip writer's "unexpected pos 704 vs 598", and once the staging directory is removed the disk has
    2.9 MB free again, more than a fixed 1 MiB floor would call full. Judged where the save fails, against
    what it writes, it is the full disk: exit 7 (EXIT_NODE), one line, nothing written.
    `--skip-resource-checks` lets the run start: the launch's disk check would refuse it before any rank (the
    writer's own handling is what this holds)."""
    from tests.safety.runs import finish, start_train
    from tests.train.conftest import write_dataset, write_profile

    disk = small_fs("disk", 3 * 2**20)
    run_dir = disk / "run"
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data"), run_dir,
                            max_steps=4, save_every_steps=2, drafter=BIG_DRAFTER)
    code, out = finish(start_train(profile, run_dir, "--skip-resource-checks"))     # the check would refuse it first
    line = assert_one_disk_full_line(code, out, run_dir)
    assert needed_bytes(line) > 3 * 2**20 and line.endswith("then no checkpoint was written yet: train again to start over")
    assert list((run_dir / "train" / "checkpoints").iterdir()) == []          # no step, no staging, no `latest`
    assert_ended_by_disk_full(run_dir)


@pytest.mark.slow
def test_a_full_disk_at_the_last_save_keeps_the_previous_checkpoint(small_fs, tmp_path, tiny_qwen3_target):
    """The last save also writes model.safetensors (9.1 MB where step-2 took 6.9): on a 14.8 MB filesystem
    step-2 fits and the last save does not. Rank 0 meets the full disk writing the weights; rank 1, waiting
    at the save's barrier, the closed connection (an echo, whose traceback stays off the terminal). The
    message names the last save's own bytes, not the 6.8 MB of step-2 (with 8.2 MB free, which would not
    read as a full disk). step-2 stays whole and `latest`; nothing of step-4 is left."""
    from dflash.drafter.verify import verify_checkpoint
    from tests.safety.runs import finish, start_train
    from tests.train.conftest import write_dataset, write_profile

    disk = small_fs("disk", 15155 * 1024)
    run_dir = disk / "run"
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data"), run_dir,
                            max_steps=4, save_every_steps=2, drafter=BIG_DRAFTER)
    code, out = finish(start_train(profile, run_dir, "--skip-resource-checks"))
    line = assert_one_disk_full_line(code, out, run_dir)
    assert line.endswith("then the last complete checkpoint is step-2: continue from it with --resume")
    checkpoints = run_dir / "train" / "checkpoints"
    step = checkpoints / "step-2"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-2"] and verify_checkpoint(step) == []
    assert (checkpoints / "latest").read_text().strip() == "step-2"
    assert needed_bytes(line) > 1.25 * sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    assert_ended_by_disk_full(run_dir)


def test_the_preflight_disk_check_reads_the_run_dir_the_command_writes(cli, small_fs, tmp_path, tiny_qwen3_target):
    from tests.train.conftest import write_dataset, write_profile

    disk = small_fs("disk", 3 * 2**20)
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "d", rows=4),
                            tmp_path / "profile-run")
    refused = cli("train", "--profile", profile, "--run-dir", disk / "run")
    assert refused.code == 1, refused.err
    assert "preflight audit found 1 FAIL(s):\n  host.disk: free disk at" in refused.err
    recorded = json.loads((disk / "run" / "audit" / "findings.json").read_text())        # the run dir's own record
    disk_finding = next(f for f in recorded["findings"] if f["id"] == "host.disk")
    assert re.fullmatch(rf"free disk at {re.escape(str(disk / 'run'))}: [0-3] MiB, profile needs 10240 MiB",
                        disk_finding["message"]) and disk_finding["status"] == "FAIL"
    assert not (disk / "run" / "train").exists()
    control = cli("audit", "--profile", profile, "--json")          # the profile's own run_dir: the big disk
    finding = next(f for f in json.loads(control.out)["findings"] if f["id"] == "host.disk")
    assert finding["status"] == "PASS" and f"free disk at {tmp_path / 'profile-run'}" in finding["message"]


def test_the_disk_refusal_fires_at_the_default_when_the_checkpoints_do_not_fit(small_fs, tmp_path, tiny_qwen3_target):
    """train.keep_checkpoints defaults to 3: the run holds at most 5 checkpoints (the newest 3, the best, one being
    written) and the last's model.safetensors, and a run directory whose disk has less is refused before any rank
    starts, naming both figures, what to change and the flag that skips the check. With every checkpoint kept
    (0) the run needs at least one of them: a disk that holds one passes, one that does not is refused."""
    from dflash.train.supervisor.launch import check_checkpoint_disk, run_training
    from launcher_core.errors import PreflightFailed

    profile, plan, disk_model = planned(tmp_path, tiny_qwen3_target, tmp_path / "sizes", drafter=BIG_DRAFTER)
    assert profile.train.keep_checkpoints == 3 and disk_model.held == 5
    each, weights = disk_model.each_mib * 2**20, disk_model.weights_mib * 2**20
    disk = small_fs("disk", 64 * 2**20)
    fill(disk, int(3 * each + weights))                                 # one fits, five do not
    run_dir = disk / "run"
    with pytest.raises(PreflightFailed) as refused:
        run_training(profile, run_dir=run_dir)
    message = str(refused.value)
    assert message.startswith("train: the run's checkpoints need ") and f"and {run_dir} has " in message
    assert "(5 x " in message and "lower train.keep_checkpoints, free space or move paths.run_dir" in message
    assert message.endswith("(or pass --skip-resource-checks to train anyway)")
    assert not (run_dir / "train").exists()                             # nothing of a run written
    every = dataclasses.replace(profile, train=dataclasses.replace(profile.train, keep_checkpoints=0))
    check_checkpoint_disk(every, plan, run_dir)                         # one checkpoint and the weights fit
    fill(disk, int(0.8 * (each + weights)))
    with pytest.raises(PreflightFailed, match=r"one checkpoint of the run needs .* keeps every one\) and "):
        check_checkpoint_disk(every, plan, run_dir)


def planned(tmp_path: Path, target: Path, run_dir: Path, **train: object):
    """The tests' tiny profile (train.keep_checkpoints at its default unless given), its plan and checkpoint sizes
    (a drafter of several MiB a checkpoint: the free disk is read in whole MiB)."""
    from dflash.memory.checkpoint_costs import checkpoint_disk
    from dflash.memory.launch_plan import plan_for_launch, read_inputs
    from launcher_core.profile import load_profile
    from tests.train.conftest import write_dataset, write_profile

    profile = load_profile(str(write_profile(tmp_path / "p.toml", target, write_dataset(tmp_path / "data"), run_dir,
                                             **train)))
    plan = plan_for_launch(profile, read_inputs(profile))
    return profile, plan, checkpoint_disk(plan, profile.train)


def own_checkpoint(run_dir: Path, step: int, size: int) -> Path:
    """A whole checkpoint of the run as retention counts it (config, training state, DCP metadata), of `size` bytes."""
    path = run_dir / "train" / "checkpoints" / f"step-{step}"
    (path / "dcp").mkdir(parents=True)
    for name in ("config.json", "training_state.pt", "dcp/.metadata"):
        (path / name).write_bytes(b"{}")
    (path / "dcp" / "__0_0.distcp").write_bytes(b"\0" * size)
    (path.parent / "latest").write_text(f"step-{step}\n")
    return path


def test_a_resume_counts_the_runs_own_checkpoints_already_on_disk(small_fs, tmp_path, tiny_qwen3_target):
    """A resumed run's own 3 checkpoints already fill the disk, and retention removes them as new ones come: it
    needs 2 more and the last's weights, not 5. On a disk with room for that the resume passes the check; a
    start from nothing on the same disk (5 at once) does not; the refusal of a resume names what it counted."""
    from dflash.train.supervisor.launch import check_checkpoint_disk
    from launcher_core.errors import PreflightFailed

    profile, plan, disk_model = planned(tmp_path, tiny_qwen3_target, tmp_path / "sizes", drafter=BIG_DRAFTER)
    each, weights = int(disk_model.each_mib * 2**20), int(disk_model.weights_mib * 2**20)
    disk = small_fs("disk", 64 * 2**20)
    for step in (12, 24, 36):
        own_checkpoint(disk / "run", step, each)
    fill(disk, int(2.5 * each) + weights)
    check_checkpoint_disk(profile, plan, disk / "run", resume=True)     # 2 more and the weights fit
    with pytest.raises(PreflightFailed, match=r"the run's checkpoints need .* at once \(5 x "):
        check_checkpoint_disk(profile, plan, disk / "run")
    fill(disk, int(1.5 * each) + weights)                               # now 2 more do not fit
    with pytest.raises(PreflightFailed) as refused:
        check_checkpoint_disk(profile, plan, disk / "run", resume=True)
    assert "the resumed run's checkpoints need " in str(refused.value)
    assert "(2 x " in str(refused.value) and "beside the 3 of its own already there" in str(refused.value)


def test_force_starts_over_and_still_runs_the_checks_the_earlier_run_named(small_fs, tmp_path, tiny_qwen3_target, cli):
    """`train --force` (and --start-over) starts over with the old train/ kept beside it, on the same disk: the disk
    check still runs (it was skipped by --force before), the earlier run is not moved, and the message names what
    the runs moved aside before hold. The pipeline's --redo train starts over the same way (no skip)."""
    from dflash.stages import PipelineContext, with_run_dir
    from dflash.stages import _train as pipeline_train
    from launcher_core.errors import PreflightFailed
    from launcher_core.manifest import update_stage
    from launcher_core.profile import load_profile

    _, _, disk_model = planned(tmp_path, tiny_qwen3_target, tmp_path / "sizes", drafter=BIG_DRAFTER)
    each, weights = int(disk_model.each_mib * 2**20), int(disk_model.weights_mib * 2**20)
    disk = small_fs("disk", 64 * 2**20)
    run_dir = disk / "run"
    profile = tmp_path / "p.toml"
    own_checkpoint(run_dir, 12, each)
    earlier = own_checkpoint(disk / "elsewhere", 6, each).parents[2] / "train"
    earlier.rename(run_dir / "train.prev-20260101-000000")
    fill(disk, 4 * each + weights)                                      # 4 more checkpoints and the weights
    for flag in ("--force", "--start-over"):
        refused = cli("train", "--profile", profile, "--run-dir", run_dir, "--skip-preflight", flag)
        assert refused.code == 1, refused.err
        assert "the run's checkpoints need " in refused.err and "--skip-resource-checks to train anyway" in refused.err
        assert "earlier runs moved aside by --start-over hold " in refused.err and "train.prev-20260101-000000" in refused.err
        assert (run_dir / "train" / "checkpoints" / "step-12").is_dir()      # not moved aside: nothing started
    update_stage(run_dir, "train", "done")
    redo = PipelineContext(with_run_dir(load_profile(str(profile)), run_dir), run_dir, redo=frozenset({"train"}))
    with pytest.raises(PreflightFailed, match="earlier runs moved aside by --start-over hold "):
        pipeline_train(redo)                                            # --redo train starts over: the checks run
    assert (run_dir / "train" / "checkpoints" / "step-12").is_dir()
