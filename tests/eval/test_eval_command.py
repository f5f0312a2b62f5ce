"""`launcher.py eval` end to end on a tiny target with a saved drafter checkpoint, then `status`."""
from __future__ import annotations

import json

import pytest
from test_dflash_drafter import save_random_drafter

import launcher
from launcher_core.manifest import read_manifest, update_stage


def write_eval_profile(root, target, eval_settings: str):
    """A CPU profile on the tiny target, run dir `root/run`, with these `[eval]` lines."""
    profile = root / "tiny.toml"
    profile.write_text(f"""
description = "tiny target"
[machine]
device = "cpu"
[model]
target = "{target}"
dtype = "float32"
[paths]
run_dir = "{root / 'run'}"
[generate]
thinking = false
[eval]
{eval_settings}
""")
    return profile


@pytest.fixture(scope="module")
def eval_run(tiny_qwen3_target, tiny_qwen3_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    profile = write_eval_profile(root, tiny_qwen3_target, "num_prompts = 3\nmax_new_tokens = 12")
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
    assert [p["id"] for p in report["prompts"]] == ["everyday-00-word-problem", "everyday-01-code", "everyday-02-explain"]
    assert report["prompt_set"] == "out-of-template held-out (everyday_prompts.jsonl)"
    for name in ("dflash", "prompt_lookup"):
        method = report["methods"][name]
        assert method["identical_to_target"] is True
        assert sum(method["tau_histogram"].values()) == method["steps"]
        assert method["speedup"] > 0
    markdown = (run_dir / "eval" / "report.md").read_text()
    assert "| dflash |" in markdown and "3 prompts: out-of-template held-out (everyday_prompts.jsonl)." in markdown
    for png in ("tau_histogram.png", "position_acceptance.png"):
        assert (run_dir / "eval" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    entry = read_manifest(run_dir)["stages"]["eval"]
    assert entry["state"] == "done"
    assert entry["dflash_tau"] == pytest.approx(report["methods"]["dflash"]["mean_tau"], abs=1e-3)
    assert entry["dflash_lossless"] is True and entry["prompt_lookup_lossless"] is True
    assert entry["prompt_set"] == report["prompt_set"]


def test_the_report_on_disk_reads_back_into_what_status_plots_and_the_markdown_show(eval_run, tmp_path):
    """The in-process writer and the typed readers agree: the manifest entry `status` prints is the
    figures of the report read back from disk, and so are report.md and the plots."""
    from dflash.commands.eval import summary_lines
    from dflash.eval.evaluate import manifest_figures
    from dflash.eval.plots import write_plots
    from dflash.eval.report_schema import read_report
    from dflash.eval.report_writer import render_markdown

    run_dir, _, _ = eval_run
    report = read_report(run_dir / "eval" / "report.json")
    entry = read_manifest(run_dir)["stages"]["eval"]
    assert manifest_figures(report) == {k: v for k, v in entry.items() if k not in ("state", "updated_at", "checkpoint")}
    assert render_markdown(report) == (run_dir / "eval" / "report.md").read_text()
    assert report.context.torch_threads == 1 and len(report.prompts) == 3 == report.num_prompts
    assert [p.name for p in write_plots(report, tmp_path, None)] == ["tau_histogram.png", "position_acceptance.png"]
    assert f"dflash         tau {report.methods['dflash'].mean_tau:.2f}" in summary_lines(report)


def test_pipeline_summary_line_names_the_prompt_set(eval_run):
    from dflash.commands.pipeline import final_figures
    from launcher_core.profile import load_profile

    run_dir, profile, _ = eval_run
    entry = read_manifest(run_dir)["stages"]["eval"]
    line = final_figures(load_profile(str(profile)), None).splitlines()[0]
    assert line.startswith("tau on 3 prompts, out-of-template held-out (everyday_prompts.jsonl): "
                           f"DFlash {entry['dflash_tau']} vs prompt lookup {entry['prompt_lookup_tau']}")


def test_eval_prompts_flag_labels_the_in_distribution_set(eval_run, capsys):
    from dflash.eval.options import INDIST_EVAL_PROMPTS

    run_dir, profile, _ = eval_run
    assert launcher.main(["eval", "--profile", str(profile), "--prompts", str(INDIST_EVAL_PROMPTS),
                          "--num-prompts", "1", "--max-new-tokens", "4"]) == 0
    assert "1 prompts (in-distribution held-out (indist_prompts.jsonl))" in capsys.readouterr().out
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["prompt_set"] == "in-distribution held-out (indist_prompts.jsonl)"
    assert [p["id"] for p in report["prompts"]] == ["indist-0000-explain"]


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


def test_eval_also_measures_the_in_distribution_set_and_labels_each(tiny_qwen3_target, tiny_qwen3_model, tmp_path, capsys):
    """`eval.also_prompts`: the in-distribution set decoded beside the default one, written apart
    (eval/indist_prompts/), listed in the main report, the printed summary, the manifest and the
    pipeline's closing lines; `--prompts` measures only the set it names."""
    from dflash.commands.pipeline import final_figures
    from dflash.eval.options import INDIST_EVAL_PROMPTS
    from dflash.generate.prompt_files import load_prompts
    from launcher_core.profile import load_profile

    profile = write_eval_profile(tmp_path, tiny_qwen3_target,
                                 f'num_prompts = 2\nmax_new_tokens = 6\nalso_prompts = ["{INDIST_EVAL_PROMPTS}"]')
    run_dir = tmp_path / "run"
    save_random_drafter(run_dir, tiny_qwen3_model, block_size=4)
    assert launcher.main(["eval", "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    main = json.loads((run_dir / "eval" / "report.json").read_text())
    extra = json.loads((run_dir / "eval" / "indist_prompts" / "report.json").read_text())
    assert main["prompt_set"] == "out-of-template held-out (everyday_prompts.jsonl)"
    assert extra["prompt_set"] == "in-distribution held-out (indist_prompts.jsonl)"
    assert [p["id"] for p in extra["prompts"]] == [record.id for record in load_prompts(INDIST_EVAL_PROMPTS)[:2]]
    [brief] = main["also_sets"]
    assert brief["prompt_set"] == extra["prompt_set"] and brief["num_prompts"] == 2
    for name in ("dflash", "prompt_lookup"):
        assert brief["methods"][name]["mean_tau"] == extra["methods"][name]["mean_tau"]
        assert extra["methods"][name]["identical_to_target"] is True
    assert "also 2 prompts (in-distribution held-out (indist_prompts.jsonl)): dflash tau" in out
    assert "## Other prompt sets" in (run_dir / "eval" / "report.md").read_text()
    entry = read_manifest(run_dir)["stages"]["eval"]
    assert entry["indist_prompts_dflash_tau"] == pytest.approx(extra["methods"]["dflash"]["mean_tau"], abs=1e-3)
    lines = final_figures(load_profile(str(profile)), None).splitlines()
    assert lines[1] == (f"tau on 2 prompts, in-distribution held-out (indist_prompts.jsonl): DFlash "
                        f"{extra['methods']['dflash']['mean_tau']:.3f} vs prompt lookup "
                        f"{extra['methods']['prompt_lookup']['mean_tau']:.3f}")

    assert launcher.main(["eval", "--profile", str(profile), "--prompts", str(INDIST_EVAL_PROMPTS)]) == 0
    assert "also_sets" not in json.loads((run_dir / "eval" / "report.json").read_text())


def test_a_missing_also_prompts_file_is_named_before_the_target_loads(tiny_qwen3_target, tiny_qwen3_model, tmp_path, capsys):
    profile = write_eval_profile(tmp_path, tiny_qwen3_target, f'also_prompts = ["{tmp_path / "nope.jsonl"}"]')
    save_random_drafter(tmp_path / "run", tiny_qwen3_model, block_size=4)
    assert launcher.main(["eval", "--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert "eval.also_prompts: no such prompts file" in err and "nope.jsonl" in err
    assert not (tmp_path / "run" / "eval" / "report.json").exists()


def unloadable_target(source, root):
    """The tiny target's config and tokenizer with weights no loader can read: an eval that loads it fails
    on them, so a refusal that names the real problem came before the target loaded."""
    import shutil

    target = shutil.copytree(source, root / "target-unloadable")
    (target / "model.safetensors").write_bytes(b"not weights")
    return target


def test_an_empty_prompts_file_and_a_draft_that_is_no_checkpoint_are_refused_before_any_model_loads(
        tiny_qwen3_target, tiny_qwen3_model, tmp_path, capsys):
    """`--prompts` with an empty file, and `--draft` at a directory that holds no drafter, are each one line,
    exit 2, before any model loads or any benchmark row decodes (the target here cannot load: its error would show)."""
    profile = write_eval_profile(tmp_path, unloadable_target(tiny_qwen3_target, tmp_path), "num_prompts = 2")
    save_random_drafter(tmp_path / "run", tiny_qwen3_model, block_size=4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert launcher.main(["eval", "--profile", str(profile), "--prompts", str(empty), "--bench", "humaneval"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {empty}: no prompts in the file"
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "readme.txt").write_text("hello")
    assert launcher.main(["eval", "--profile", str(profile), "--draft", str(not_a_checkpoint)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --draft {not_a_checkpoint}: not a drafter checkpoint: {not_a_checkpoint}: no config.json; expected a "
        f"DFlash drafter directory (config.json + *.safetensors)")
    assert "eval" not in read_manifest(tmp_path / "run")["stages"]
