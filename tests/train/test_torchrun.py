"""Real torchrun runs on CPU (gloo, 2 ranks) with the tiny random Qwen3 target.

The drafter proposes from a draft vocabulary of the data's 50 tokens (drafter.draft_vocab_size,
DATA_VOCAB) in every run here: on the tiny target (hidden 64) the head over Qwen3's 151,936 rows was
two thirds of a rank's CPU (its logits, their recomputation and their backward; a 24-step run of 2
ranks 21 -> 12 machine CPU s), and what these runs test (resume, resharding, the OOM restarts, the
feature cache, failures, the rendezvous) does not depend on the head's width. The head over
the whole vocabulary is trained on real ranks by tests/train/test_validation.py, test_plan_launch.py,
test_dflash2_train.py (DFlash 2 has no draft vocabulary) and the flagship twin."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.drafter.checkpoint_files import read_weights
from dflash.train.supervisor.launch import build_torchrun_command, run_training
from launcher_core.errors import RunFailed
from launcher_core.processes import free_port
from launcher_core.profile import load_profile
from tests.train.conftest import DATA_VOCAB, write_profile

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
RESUME_STEP = 20


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    """24 steps on 2 ranks, a checkpoint at step 20 (mid-epoch: 8 steps an epoch) and at the end; the resume
    tests continue from step 20, 4 steps, as many as a resume needs to show it is on the curve. Every
    process of the run imports an exit hook (exit_hook_env) that marks the interpreter's finalization."""
    root = tmp_path_factory.mktemp("run")
    profile = load_profile(str(write_profile(root / "p.toml", tiny_qwen3_target, tiny_dataset, root / "run",
                                             save_every_steps=RESUME_STEP, drafter=DATA_VOCAB)))
    assert run_training(profile, run_dir=root / "run", extra_env=exit_hook_env(root / "exit-hook")) == 0
    return profile, root / "run"


EXIT_HOOK = """import atexit, os

def _mark(event):
    open(os.path.join(os.environ["EXIT_HOOK_MARKS"], f"{event}-{os.environ.get('RANK', 'none')}-{os.getpid()}"), "w").close()

if "RANK" in os.environ:              # a rank started as a command of its own (and the control)
    _mark("started")
os.register_at_fork(after_in_child=lambda: _mark("started"))   # a rank forked by torchrun's forkserver
atexit.register(lambda: _mark("finalized"))
"""


def exit_hook_env(folder: Path) -> dict[str, str]:
    """A sitecustomize on PYTHONPATH that marks, in folder/marks, each process that starts with it
    loaded, by its RANK (`started-R-pid`: at interpreter start where RANK is set, at fork, where it is
    not yet: `started-none-pid`), and each whose interpreter finalized (`finalized-R-pid`, RANK as at exit)."""
    (folder / "marks").mkdir(parents=True)
    (folder / "sitecustomize.py").write_text(EXIT_HOOK, encoding="utf-8")
    return {"PYTHONPATH": os.pathsep.join([str(REPO), str(folder)]), "EXIT_HOOK_MARKS": str(folder / "marks")}


def test_a_rank_that_finished_ends_without_the_interpreters_finalization(trained):
    """A rank past its last checkpoint and destroy_process_group ends before the interpreter's
    finalization, where a gloo rank has died of SIGABRT after a complete run: a forked rank returns to
    torchrun's elastic agent and multiprocessing ends it with os._exit (dflash.train.rank.worker end_rank), a
    rank started as a command of its own ends with launcher_core.processes.exit_without_finalization.
    Controls: the same hook marks the finalization of a plain Python process and of a forked child that
    ends through the interpreter."""
    _, run_dir = trained
    hook = run_dir.parent / "exit-hook"

    def marks(event: str) -> list[str]:
        return sorted(p.name.split("-")[1] for p in (hook / "marks").glob(f"{event}-*"))

    assert len(marks("started")) == 2                   # both ranks ran with the hook loaded (forked: RANK unset yet)
    assert not {"0", "1"} & set(marks("finalized"))     # neither rank finalized (the forkserver itself may)
    control = {**os.environ, "PYTHONPATH": str(hook), "EXIT_HOOK_MARKS": str(hook / "marks"), "RANK": "control"}
    subprocess.run([sys.executable, "-c", "pass"], env=control, check=True)
    forked = "import os, sys\nif os.fork() == 0:\n    os.environ['RANK'] = 'forked'\n    sys.exit(0)\nos.wait()"
    subprocess.run([sys.executable, "-c", forked], env={**control, "RANK": "parent"}, check=True)
    assert {"control", "forked"} <= set(marks("finalized"))


def test_two_rank_loss_goes_down_and_everything_is_logged(trained):
    from safetensors.torch import load_file

    _, run_dir = trained
    lines = metrics(run_dir)
    assert [line["step"] for line in lines] == list(range(1, 25))
    first, last = sum(line["loss"] for line in lines[:4]) / 4, sum(line["loss"] for line in lines[-4:]) / 4
    assert last < first - 0.15, (first, last)          # ln(50) = 3.91 at the start
    assert len(lines[-1]["acc"]) == 3 and len(lines[-1]["mem_mib"]) == 2 and lines[-1]["tokens_per_s"] > 0
    assert lines[-1]["sim_tau"] == pytest.approx(1 + sum(                # tau as eval counts it: accepted + 1
        __import__("math").prod(lines[-1]["acc"][:k]) for k in range(1, 4)))
    assert any((run_dir / "train" / "tb").glob("events.out.tfevents.*"))
    checkpoints = run_dir / "train" / "checkpoints"
    draft_vocab = read_weights(checkpoints / f"step-{RESUME_STEP}")["draft_vocab"]     # from its DCP shards
    assert draft_vocab.tolist() == list(range(1000, 1050))      # DATA_VOCAB: every token the data has
    assert load_file(str(checkpoints / "step-24" / "model.safetensors"))["draft_vocab"].tolist() == draft_vocab.tolist()
    assert (checkpoints / "latest").read_text().strip() == "step-24"
    assert {p.name for p in (checkpoints / f"step-{RESUME_STEP}").iterdir()} == {"config.json", "training_state.pt",
                                                                                "training_data.json", "dcp"}
    assert {p.name for p in (checkpoints / "step-24").iterdir()} == {"model.safetensors", "config.json", "training_state.pt",
                                                                     "training_data.json", "dcp"}     # the last one
    # each checkpoint carries the record of the data it was trained on (eval's mode check reads it; this
    # dataset of bare token rows has no meta, so no rendering is known)
    profile, _ = trained
    record = json.loads((run_dir / "train" / "training_data.json").read_text())
    assert record == {"dataset": profile.paths.dataset, "meta": f"{profile.paths.dataset}/dflash_meta.json",
                      "rendering": None}
    assert all(json.loads((checkpoints / step / "training_data.json").read_text()) == record
               for step in (f"step-{RESUME_STEP}", "step-24"))
    assert {p.name for p in (checkpoints / f"step-{RESUME_STEP}" / "dcp").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert stage["state"] == "done" and stage["steps"] == 24


def test_resume_of_a_finished_run_says_so_and_writes_nothing(trained, tmp_path, cli, private_cache):
    """`train --resume` on a finished run says the run is finished and writes nothing (its last checkpoint's
    dcp/.metadata and the manifest's last_loss untouched), whether the profile plans its steps by train.max_steps or by train.epochs over the data;
    a profile that plans more steps resumes (the control, decided without a launch)."""
    from dflash.train.supervisor.resume import finished_run
    from tests.safety.conftest import tree_digest

    profile, run_dir = trained
    copy = Path(shutil.copytree(run_dir, tmp_path / "run"))
    before = tree_digest(copy)
    result = cli("train", "--profile", run_dir.parent / "p.toml", "--run-dir", copy, "--resume", "--skip-preflight")
    assert result.code == 0, result.err
    assert f"train: the run in {copy} is finished: step-24 holds its last step (24 planned by profile p)" in result.out
    assert "torchrun" not in result.out + result.err and tree_digest(copy) == before
    by_epochs = dataclasses.replace(profile, train=dataclasses.replace(profile.train, max_steps=0, epochs=3))
    assert finished_run(by_epochs, copy) is not None          # 32 rows // global batch 4 = 8 steps an epoch
    for longer in (dataclasses.replace(profile.train, max_steps=26), dataclasses.replace(by_epochs.train, epochs=4)):
        assert finished_run(dataclasses.replace(profile, train=longer), copy) is None


def copy_checkpoint(run_dir: Path, step: int, into: Path) -> Path:
    shutil.copytree(run_dir / "train" / "checkpoints" / f"step-{step}", into / "train" / "checkpoints" / f"step-{step}")
    (into / "train" / "checkpoints" / "latest").write_text(f"step-{step}\n")
    return into


def test_a_sharded_checkpoint_of_2_ranks_resumes_on_1_onto_the_same_curve(trained, tmp_path):
    """Every rank wrote its shards of the weights and AdamW states (torch.distributed.checkpoint);
    one rank loads both halves (resharding on load) and continues the 2-rank run's loss curve, and
    the last checkpoint's whole weights (model.safetensors) are its DCP shards put together."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    profile, run_dir = trained
    saved_at = run_dir / "train" / "checkpoints" / f"step-{RESUME_STEP}"
    saved = torch.load(saved_at / "training_state.pt", weights_only=True)
    assert saved["world_size"] == 2 and saved["step"] == RESUME_STEP and "optimizer" not in saved
    last = run_dir / "train" / "checkpoints" / "step-24"
    weights = load_file(str(last / "model.safetensors"))
    whole = {name: torch.empty_like(tensor) for name, tensor in weights.items()}
    dcp.load({"model": whole}, checkpoint_id=str(last / "dcp"))
    assert all(torch.equal(whole[name], weights[name]) for name in weights)
    one_rank = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, nproc_per_node=1))
    resumed = copy_checkpoint(run_dir, RESUME_STEP, tmp_path / "one")
    assert run_training(one_rank, run_dir=resumed, resume=True) == 0
    again = {line["step"]: line["loss"] for line in metrics(resumed)}
    original = {line["step"]: line["loss"] for line in metrics(run_dir)}
    assert sorted(again) == list(range(RESUME_STEP + 1, 25))
    for step, loss in again.items():
        assert loss == pytest.approx(original[step], rel=1e-4), step
    assert len(metrics(resumed)[-1]["mem_mib"]) == 1


def test_an_oom_in_each_phase_of_the_step_restarts_every_rank_at_half_the_micro_batch(trained, tmp_path):
    """Out of memory on one rank in the forward (step 2), a draft layer's backward (step 3), the
    gradient reduction inside FSDP2's reduce-scatter (step 4) and the update (step 5): each time
    the rank records it and exits, the launcher starts every rank again from the last checkpoint
    (one a step) at half the micro-batch, 16 -> 8 -> 4 -> 2 -> 1. The loss curve is the same as
    an uninterrupted run's, every step is in metrics.jsonl once, autobatch.json says what happened: the
    phase each step had reached (the reduction runs inside the backward; the update's mark is "update")."""
    profile, run_dir = trained
    settings = {"global_batch": 32, "max_micro_batch": 16, "max_steps": 6, "save_every_steps": 1}
    plain = training_process(write_profile(tmp_path / "wide.toml", Path(profile.model.target), Path(profile.paths.dataset),
                                           tmp_path / "plain", drafter=DATA_VOCAB, **settings), tmp_path / "plain")
    wide = dataclasses.replace(profile, train=dataclasses.replace(profile.train, **settings))   # the same, in this process
    inject = "rank=1,step=2;rank=0,step=3,phase=backward;rank=1,step=4,phase=sync;rank=0,step=5,phase=optimizer"
    assert run_training(wide, run_dir=tmp_path / "oom", extra_env={"DFLASH_INJECT_OOM": inject}) == 0
    assert plain.wait(timeout=300) == 0        # the uninterrupted reference, run beside it
    lines, plain = metrics(tmp_path / "oom"), metrics(tmp_path / "plain")
    assert [line["step"] for line in lines] == list(range(1, 7))                  # none twice, none lost
    assert [line["micro_batch"] for line in lines] == [16, 8, 4, 2, 1, 1]
    for line, reference in zip(lines, plain):
        assert line["loss"] == pytest.approx(reference["loss"], rel=1e-4), line["step"]
    reductions = json.loads((tmp_path / "oom" / "train" / "autobatch.json").read_text())["reductions"]
    assert [(r["step"], r["phase"], r["from"], r["to"]) for r in reductions] == \
        [(2, "forward", 16, 8), (3, "backward", 8, 4), (4, "backward", 4, 2), (5, "update", 2, 1)]
    assert json.loads((tmp_path / "oom" / "manifest.json").read_text())["stages"]["train"]["state"] == "done"


def test_an_oom_at_micro_batch_one_fails_with_what_to_change(trained, tmp_path):
    profile, _ = trained
    short = dataclasses.replace(profile, train=dataclasses.replace(profile.train, max_steps=3))
    with pytest.raises(RunFailed, match="rank 1 ran out of memory at step 2, micro-batch 1 .forward.*data.max_length"):
        run_training(short, run_dir=tmp_path / "fatal", extra_env={"DFLASH_INJECT_OOM": "rank=1,step=2"})


def test_feature_cache_skips_the_target_after_epoch_one_and_keeps_the_loss_curve(trained, tmp_path):
    """train.feature_cache: 24 steps = 3 epochs of 8; each row is extracted once (by the rank that
    meets it first), later epochs read it whichever rank gets it, and the loss curve is the
    online run's. The files are gone when training ends."""
    profile, run_dir = trained
    cached = dataclasses.replace(profile, train=dataclasses.replace(profile.train, feature_cache=True))
    assert run_training(cached, run_dir=tmp_path / "cached") == 0
    lines, original = metrics(tmp_path / "cached"), metrics(run_dir)
    for line, reference in zip(lines, original):
        assert line["loss"] == pytest.approx(reference["loss"], rel=1e-4), line["step"]
    after_epoch_one, last = lines[7]["feature_cache"], lines[-1]["feature_cache"]
    assert after_epoch_one == {**after_epoch_one, "hits": 0, "misses": 16, "rows": 32}   # rank 0: 8 steps x 2 rows
    assert last == {**last, "hits": 32, "misses": 16, "rows": 32} and last["mib"] > 0   # no row extracted twice
    assert not (tmp_path / "cached" / "train" / "feature_cache").exists()


def test_target_init_draft_vocabulary_and_bf16_autocast_train_and_reload(tiny_qwen3_target, tiny_dataset, tmp_path):
    """The CPU-demo settings together: drafter from the target's layers, a 40-token draft
    vocabulary (the data uses 50), the feature cache; with the flagship's numbers (bf16 autocast, the
    drafter gathered by FSDP2 in bf16 for compute, as rtx6000-x8 runs it: the CPU twin computes in
    float32); the checkpoint reloads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dflash.drafter.checkpoint_files import load_drafter
    from dflash.drafter.draft_vocab import count_loss_tokens, draft_vocabulary

    run_dir = tmp_path / "run"
    path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, run_dir, max_steps=16,
                         feature_cache=True, autocast="bfloat16", compute_dtype="bfloat16", lr=3e-3,
                         drafter={"num_layers": 2, "target_layer_ids": [1], "init": "target", "draft_vocab_size": 40})
    profile = load_profile(str(path))
    assert run_training(profile, run_dir=run_dir) == 0
    lines = metrics(run_dir)
    assert sum(line["loss"] for line in lines[-4:]) / 4 < sum(line["loss"] for line in lines[:4]) / 4 - 0.1
    assert lines[0]["loss"] < 5.0            # softmax over 40 columns: ln(40) = 3.7, not ln(151936) = 11.9
    import datasets

    expected = draft_vocabulary(count_loss_tokens(datasets.load_from_disk(str(tiny_dataset)), 512), 40)
    weights = load_file(str(run_dir / "train" / "checkpoints" / "step-16" / "model.safetensors"))
    assert weights["draft_vocab"].tolist() == expected and len(expected) == 40
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, dtype="float32", local_files_only=True)
    drafter = load_drafter(run_dir / "train" / "checkpoints", target)
    assert drafter.draft_vocab.tolist() == expected and len(drafter.layers) == 2


def test_a_failing_rank_is_reported_with_its_rank_and_traceback(trained, tmp_path):
    profile, _ = trained
    with pytest.raises(RunFailed) as failure:
        run_training(profile, run_dir=tmp_path / "fail", extra_env={"DFLASH_FAIL_RANK": "1:3"})
    message = str(failure.value)
    assert message.startswith("rank 1 failed first") and "injected failure on rank 1 at step 3" in message
    assert "Traceback" in message or "File " in message
    stage = json.loads((tmp_path / "fail" / "manifest.json").read_text())["stages"]["train"]
    assert stage["state"] == "failed" and stage["failed_rank"] == 1


def listeners_by_role(root, seen: dict[str, set], rank_pids: set[int]) -> None:
    """Every listening TCP socket of the launcher (`root`), its torchrun agent and the ranks."""
    import psutil

    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            command = " ".join(process.cmdline())
            role = ("launcher" if process.pid == root.pid else "rank" if "dflash.train.rank.worker" in command
                    else "agent" if "dflash.train.supervisor.agent" in command else "other")
            rank_pids.update([process.pid] if role == "rank" else [])
            seen.setdefault(role, set()).update((process.pid, c.laddr.ip, c.laddr.port)
                                                for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


def agent_tempdirs(root, found: dict[str, set[str]]) -> None:
    """The TMPDIR of each torchrun agent under the launcher (`root`), and what is in it now."""
    import psutil

    for process in root.children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):
            if "dflash.train.supervisor.agent" in " ".join(process.cmdline()):
                folder = process.environ().get("TMPDIR", "")
                found.setdefault(folder, set()).update(os.listdir(folder) if folder else [])


def training_process(profile_path: Path, run_dir: Path, env: dict[str, str] | None = None,
                     resume: bool = False) -> subprocess.Popen:
    """`run_training` of the profile file in a Python process of its own (the launcher, as `train` runs it)."""
    code = ("import sys; from launcher_core.profile import load_profile; from dflash.train.supervisor.launch import run_training; "
            f"sys.exit(run_training(load_profile({str(profile_path)!r}), run_dir={str(run_dir)!r}, resume={resume!r}))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_one_node_listens_on_loopback_only_and_a_restart_rendezvouses_again(trained, tmp_path):
    """The launcher hosts the rendezvous store on 127.0.0.1, torchrun joins it, the ranks' store
    and gloo stay on loopback; the trained run is resumed from step 20 (`--resume`), rank 1 fails at
    step 21 of attempt 0, torchrun --max-restarts 1 restarts both ranks, they meet again on the same
    store, resume from step 20 again and finish on the uninterrupted run's loss curve (steps 21-24). The
    agent, its forkserver and the ranks wrote their temporary files in the run's own folder, gone once
    the run has ended."""
    import psutil

    profile, trained_dir = trained
    run_dir = copy_checkpoint(trained_dir, RESUME_STEP, tmp_path / "run")
    path = write_profile(tmp_path / "p.toml", Path(profile.model.target), Path(profile.paths.dataset), run_dir,
                         save_every_steps=RESUME_STEP, max_restarts=1, drafter=DATA_VOCAB)   # the trained run's, restartable
    process = training_process(path, run_dir, {"DFLASH_FAIL_RANK": f"1:{RESUME_STEP + 1}:0"}, resume=True)
    seen: dict[str, set] = {}
    rank_pids: set[int] = set()
    tempdirs: dict[str, set[str]] = {}
    deadline = time.time() + 240
    while process.poll() is None and time.time() < deadline:
        listeners_by_role(psutil.Process(process.pid), seen, rank_pids)
        agent_tempdirs(psutil.Process(process.pid), tempdirs)
        time.sleep(0.2)
    assert process.wait(timeout=10) == 0
    assert len(tempdirs) == 1, tempdirs                                 # one agent, both attempts
    (folder, entries), = tempdirs.items()
    assert Path(folder).name.startswith("dflash-train-") and any(name.startswith("pymp-") for name in entries), tempdirs
    assert not Path(folder).exists()
    addresses = {ip for sockets in seen.values() for _, ip, _ in sockets}
    assert addresses <= {"127.0.0.1", "::1"}, seen                   # never 0.0.0.0 or ::
    assert len(seen["launcher"]) == 1, seen                            # the store, in the launcher
    assert len({pid for pid, _, _ in seen["rank"]}) >= 2, seen        # gloo's pairs, on loopback too
    assert len(rank_pids) >= 4, rank_pids                              # two attempts of two ranks
    failure = json.loads((run_dir / "train" / "failures" / "rank-1.json").read_text())
    assert f"injected failure on rank 1 at step {RESUME_STEP + 1}" in failure["error"]
    assert (run_dir / "train" / "checkpoints" / "latest").read_text().strip() == "step-24"
    again = {line["step"]: line["loss"] for line in metrics(run_dir)}
    original = {line["step"]: line["loss"] for line in metrics(trained_dir)}
    assert sorted(again) == list(range(RESUME_STEP + 1, 25))
    for step, loss in again.items():
        assert loss == pytest.approx(original[step], rel=1e-5), step


def test_two_agents_rendezvous_over_c10d_on_localhost(tiny_qwen3_target, tiny_dataset, tmp_path):
    """Two nodes of one rank each; their ranks started as commands of their own (train.rank_start =
    "command": `-m dflash.train.rank.worker`, the path every other run here leaves for the forkserver)."""
    from dflash.train.supervisor.launch import TrainPaths, prepare_run_dir

    run_dir = tmp_path / "run"
    machine = {"nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"}
    profile = load_profile(str(write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, run_dir,
                                             machine=machine, max_steps=3, rank_start="command", drafter=DATA_VOCAB)))
    prepare_run_dir(profile, TrainPaths(run_dir), resume=False, start_over=False)
    argv, env = build_torchrun_command(profile, run_dir)
    assert argv[argv.index("-m", 3) + 1] == "dflash.train.rank.worker" and "--start-method" not in argv
    agents = [subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for _ in range(2)]
    assert [agent.wait(timeout=180) for agent in agents] == [0, 0]
    lines = metrics(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3] and len(lines[-1]["mem_mib"]) == 2
