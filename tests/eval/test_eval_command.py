"""`launcher.py eval` end to end on a tiny target with a saved drafter checkpoint, then `status`."""
from __future__ import annotations

import json

import pytest
from test_dflash_drafter import save_random_drafter

import launcher
from launcher_core.manifest import read_manifest, update_stage


@pytest.fixture(scope="module")
def eval_run(tiny_qwen3_target, tiny_qwen3_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    profile = root / "tiny.toml"
    profile.write_text(f"""
description = "tiny target"
[machine]
device = "cpu"
[model]
target = "{tiny_qwen3_target}"
dtype = "float32"
[paths]
run_dir = "{root / 'run'}"
[generate]
thinking = false
[eval]
num_prompts = 3
max_new_tokens = 12
""")
    save_random_drafter(root / "run", tiny_qwen3_model, block_size=4)
    update_stage(root / "run", "train", "done", steps=3, last_loss=4.25)
    code = launcher.main(["eval", "--profile", str(profile)])
    return root / "run", profile, code


def test_eval_writes_report_plots_and_manifest(eval_run, capsys):
    run_dir, _, code = eval_run
    assert code == 0
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert set(report["methods"]) == {"target", "dflash", "prompt_lookup"}
    assert report["num_prompts"] == 3 and report["block_size"] == 4 and report["torch_threads"] == 1
    assert [p["id"] for p in report["prompts"]] == ["heldout-0000-math", "heldout-0001-math", "heldout-0002-word"]
    for name in ("dflash", "prompt_lookup"):
        method = report["methods"][name]
        assert method["identical_to_target"] is True
        assert sum(method["tau_histogram"].values()) == method["steps"]
        assert method["speedup"] > 0
    assert "| dflash |" in (run_dir / "eval" / "report.md").read_text()
    for png in ("tau_histogram.png", "position_acceptance.png"):
        assert (run_dir / "eval" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    entry = read_manifest(run_dir)["stages"]["eval"]
    assert entry["state"] == "done"
    assert entry["dflash_tau"] == pytest.approx(report["methods"]["dflash"]["mean_tau"], abs=1e-3)
    assert entry["dflash_lossless"] is True and entry["prompt_lookup_lossless"] is True


def test_status_shows_each_stage(eval_run, capsys):
    run_dir, profile, _ = eval_run
    capsys.readouterr()
    assert launcher.main(["status", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_stage = {line.split()[0]: line for line in lines[1:]}
    assert list(by_stage) == ["audit", "generate", "tokenize", "train", "eval"]
    assert by_stage["audit"].split()[1] == "pending"
    assert "steps=3" in by_stage["train"] and "last_loss=4.25" in by_stage["train"]
    assert by_stage["eval"].split()[1] == "done" and "dflash_tau=" in by_stage["eval"]
    assert launcher.main(["status", "--profile", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"]["train"]["steps"] == 3


def test_status_errors_name_the_directory(tmp_path, capsys):
    assert launcher.main(["status", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert launcher.main(["status", str(tmp_path)]) == 2
    assert "no stage has run" in capsys.readouterr().err


def test_eval_without_checkpoint_says_to_train_first(tmp_path, tiny_qwen3_target, capsys):
    profile = tmp_path / "p.toml"
    profile.write_text(f'[machine]\ndevice = "cpu"\n[model]\ntarget = "{tiny_qwen3_target}"\n'
                       f'[paths]\nrun_dir = "{tmp_path / "run"}"\n')
    assert launcher.main(["eval", "--profile", str(profile)]) == 2
    assert "no drafter checkpoint yet" in capsys.readouterr().err
    assert launcher.main(["eval", "--profile", str(profile), "--num-prompts", "0"]) == 2
