"""train.keep_checkpoints: the newest N whole checkpoints kept, with the best by held-out tau and the one
`latest` names; nothing else of the run's folder is touched. On 2 gloo ranks under torchrun: a run keeps
exactly that, and what is kept still resumes, loads, exports and starts a new drafter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.drafter.checkpoint_files import CONFIG, DCP_DIR, LATEST, STATE, WEIGHTS, checkpoints_dir
from dflash.train.rank.retention import complete_checkpoints, prune_checkpoints
from tests.train.conftest import write_profile


def fake_checkpoint(run_dir: Path, step: int, *, whole: bool = True) -> Path:
    """A step-N directory with the files of a checkpoint (empty), or without its DCP metadata."""
    folder = checkpoints_dir(run_dir) / f"step-{step}"
    (folder / DCP_DIR).mkdir(parents=True)
    for name in (WEIGHTS, CONFIG, STATE, *([f"{DCP_DIR}/.metadata"] if whole else [])):
        (folder / name).write_bytes(b"x")
    return folder


def steps_on_disk(run_dir: Path) -> list[str]:
    return sorted(path.name for path in checkpoints_dir(run_dir).iterdir())


def test_the_newest_n_the_best_and_the_latest_are_kept_and_nothing_else_is_touched(tmp_path):
    for step in (10, 20, 30, 40, 50):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 5, whole=False)                        # not written whole by this trainer: left alone
    staging = checkpoints_dir(tmp_path) / ".step-60.abc.tmp"         # a checkpoint being written
    staging.mkdir()
    (checkpoints_dir(tmp_path) / "notes").mkdir()                    # the user's own folder
    (checkpoints_dir(tmp_path) / LATEST).write_text("step-30\n")     # pointed back at an older one by hand
    done = prune_checkpoints(tmp_path, 2, best=10)
    assert (sorted(done.kept), done.removed) == ([10, 30, 40, 50], [20])
    assert steps_on_disk(tmp_path) == [".step-60.abc.tmp", "latest", "notes", "step-10", "step-30", "step-40",
                                       "step-5", "step-50"]
    assert done.line() == ("checkpoints: removed step-20; kept step-10 (the best by held-out tau), step-30 (latest), "
                           "step-40 (the newest 2), step-50 (the newest 2) (train.keep_checkpoints)")


def test_keeping_0_keeps_every_checkpoint_and_1_keeps_the_newest_with_the_latest(tmp_path):
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step)
    (checkpoints_dir(tmp_path) / LATEST).write_text("step-30\n")
    assert prune_checkpoints(tmp_path, 0, best=10).removed == [] and len(complete_checkpoints(tmp_path)) == 3
    assert prune_checkpoints(tmp_path, 1).removed == [10, 20]
    assert sorted(complete_checkpoints(tmp_path)) == [30]


def test_the_key_has_its_range(tmp_path, tiny_dataset):
    from launcher_core.errors import ConfigError
    from launcher_core.profile import load_profile

    with pytest.raises(ConfigError, match="train.keep_checkpoints"):
        load_profile(str(write_profile(tmp_path / "p.toml", Path("unused"), tiny_dataset, tmp_path, keep_checkpoints=-1)))


# --- the real thing: 2 gloo ranks under torchrun ------------------------------------------------

@pytest.fixture(scope="module")
def retained(tmp_path_factory, tiny_qwen3_target, tiny_dataset):
    """16 steps on 2 ranks, a checkpoint and a held-out measurement every 4 steps, the newest one kept (and
    the best)."""
    from dflash.train.supervisor.launch import run_training
    from launcher_core.profile import load_profile

    root = tmp_path_factory.mktemp("retained")
    profile = load_profile(str(write_profile(root / "p.toml", tiny_qwen3_target, tiny_dataset, root / "run",
                                             max_steps=16, save_every_steps=4, keep_checkpoints=1,
                                             validation_share=0.16, validation_every_steps=4,
                                             drafter={"draft_vocab_size": 50})))
    assert run_training(profile, run_dir=root / "run") == 0
    return profile, root / "run"


@pytest.mark.slow
def test_a_run_keeps_its_newest_checkpoint_and_its_best_and_the_manifest_points_at_kept_ones(retained):
    _, run_dir = retained
    best = json.loads((run_dir / "train" / "validation.json").read_text())["best"]["step"]
    assert sorted(complete_checkpoints(run_dir)) == sorted({16, best})
    assert [p for p in steps_on_disk(run_dir) if p.startswith(".")] == []          # no staging left behind
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert Path(stage["checkpoint"]).name == "step-16" and Path(stage["validation_best_checkpoint"]).name == f"step-{best}"
    assert all(Path(stage[key]).is_dir() for key in ("checkpoint", "validation_best_checkpoint"))


@pytest.mark.slow
def test_the_kept_checkpoints_load_export_and_start_a_drafter_and_the_run_resumes_from_them(
        retained, tiny_qwen3_target, tmp_path):
    import dataclasses

    from transformers import AutoModelForCausalLM

    from dflash.drafter.checkpoint_files import init_from_drafter, load_drafter
    from dflash.drafter.export import export_drafter
    from dflash.train.supervisor.launch import run_training

    profile, run_dir = retained
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_target, local_files_only=True).eval()
    for step, path in complete_checkpoints(run_dir).items():
        drafter = load_drafter(path, target)
        assert init_from_drafter(drafter, path).name == f"step-{step}"
        assert (export_drafter(path, "vllm", tmp_path / f"export-{step}", target=tiny_qwen3_target).directory
                / WEIGHTS).is_file()
    longer = dataclasses.replace(profile, train=dataclasses.replace(profile.train, max_steps=20))
    assert run_training(longer, run_dir=run_dir, resume=True) == 0
    best = json.loads((run_dir / "train" / "validation.json").read_text())["best"]["step"]
    assert sorted(complete_checkpoints(run_dir)) == sorted({20, best})
    steps = [json.loads(line)["step"] for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-4:] == [17, 18, 19, 20]


@pytest.mark.slow
def test_the_plan_s_checkpoint_size_is_what_a_checkpoint_takes_on_disk(retained):
    """dflash.memory.checkpoint_costs: 3 x the drafter's float32 weights (the shards' weights and AdamW states) a
    checkpoint, and the last also model.safetensors (1 x), against the kept checkpoints' files: model.safetensors
    to 2 %; the whole within what does not scale with the weights (config, training state, DCP's metadata and
    per-tensor records: 0.2 MiB on this 0.6 MiB drafter; the demo's step-550, 167 MiB modelled, takes 168)."""
    from dflash.memory.checkpoint_costs import checkpoint_disk
    from dflash.memory.launch_plan import plan_for_launch, read_inputs

    profile, run_dir = retained
    model = checkpoint_disk(plan_for_launch(profile, read_inputs(profile)), profile.train)
    kept = complete_checkpoints(run_dir)
    last, earlier = kept[max(kept)], [path for step, path in kept.items() if step < max(kept)]
    assert all(not (path / WEIGHTS).exists() for path in earlier)              # their weights are in dcp/ only
    weights = (last / WEIGHTS).stat().st_size / 2**20
    whole = sum(p.stat().st_size for p in last.rglob("*") if p.is_file()) / 2**20
    intermediate = [whole - weights] + [sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20
                                        for path in earlier]
    assert model.weights_mib == pytest.approx(weights, rel=0.02)
    assert model.last_mib <= whole <= 1.02 * model.last_mib + 0.3, (model, whole)
    assert all(model.each_mib <= size <= 1.02 * model.each_mib + 0.3 for size in intermediate), (model, intermediate)
