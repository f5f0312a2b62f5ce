"""eval renders its prompts in the training data's mode (the dataset meta's `rendering` block): a
thinking mode or chat template other than the data's is refused (exit 2, both sides named) unless
`--allow-mode-mismatch` measures it on purpose, which the report marks; older datasets still evaluate.
The tiny target carries the real Qwen3 tokenizer, whose template renders the two modes differently."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
from test_dflash_drafter import save_random_drafter

import launcher
from dflash.data import tokenize_completions
from dflash.data.dataset_io import META_NAME
from launcher_core.manifest import read_manifest
from launcher_core.profile import load_profile, profile_to_json

RECORDS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Say {i}."},
                                         {"role": "assistant", "content": f"{i}."}],
            "sampling": {"temperature": 0.0, "thinking": False}} for i in range(3)]


def write_profile(root, name: str, target, thinking: bool, dataset, tokenizer=None):
    profile = root / f"{name}.toml"
    profile.write_text(f"""
[machine]
device = "cpu"
[model]
target = "{target}"
dtype = "float32"
{f'tokenizer = "{tokenizer}"' if tokenizer else ''}
[paths]
run_dir = "{root / 'run'}"
dataset = "{dataset}"
[generate]
thinking = {'true' if thinking else 'false'}
[data]
min_loss_tokens = 1
max_degenerate_share = 1.0
[eval]
num_prompts = 1
max_new_tokens = 4
""")
    return profile


def tokenize(profile_path, records, output):
    source = output.parent / f"{output.name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenize_completions(load_profile(str(profile_path)), source, output, workers=1, progress=False)
    return output / META_NAME


@pytest.fixture(scope="module")
def setup(tiny_qwen3_target, tiny_qwen3_model, tmp_path_factory):
    """A drafter and its thinking-off training data (tokenized by the real tokenize)."""
    root = tmp_path_factory.mktemp("mode")
    off = write_profile(root, "tiny-off", tiny_qwen3_target, False, root / "data")
    on = write_profile(root, "tiny-on", tiny_qwen3_target, True, root / "data")
    meta = tokenize(off, RECORDS, root / "data")
    save_random_drafter(root / "run", tiny_qwen3_model, block_size=4)
    return root, off, on, meta


def eval_report(root) -> dict:
    return json.loads((root / "run" / "eval" / "report.json").read_text())


def test_a_thinking_mismatch_is_refused_naming_both_sides(setup, capsys):
    root, off, on, meta = setup
    assert json.loads(meta.read_text())["rendering"]["thinking"] == "off"
    (root / "run" / "eval" / "report.json").unlink(missing_ok=True)
    assert launcher.main(["eval", "--profile", str(off), "--thinking", "on"]) == 2
    err = capsys.readouterr().err
    assert f'data {meta} rendering.thinking = "off", eval --thinking = on' in err
    assert "--allow-mode-mismatch" in err and len(err.strip().splitlines()) == 1
    assert launcher.main(["eval", "--profile", str(on)]) == 2        # the profile's generate.thinking asks it
    assert f'eval generate.thinking of profile {on.stem} = on' in capsys.readouterr().err
    assert not (root / "run" / "eval" / "report.json").exists()


def test_allow_mode_mismatch_measures_the_other_mode_and_marks_the_report(setup, capsys):
    root, off, on, meta = setup
    assert launcher.main(["eval", "--profile", str(on), "--thinking", "off"]) == 0   # the flag wins: the data's mode
    matching = eval_report(root)
    assert "mode_mismatch" not in matching and "mode_mismatch" not in read_manifest(root / "run")["stages"]["eval"]
    assert matching["rendering"].startswith("thinking off (--thinking), chat template ")
    assert "matches the training data's (thinking off, chat template" in matching["rendering"] and str(meta) in matching["rendering"]
    capsys.readouterr()

    assert launcher.main(["eval", "--profile", str(on), "--allow-mode-mismatch"]) == 0
    out = capsys.readouterr().out
    report = eval_report(root)
    assert report["mode_mismatch"].startswith("mode mismatch (on purpose, --allow-mode-mismatch): thinking: data ")
    assert "differs from the training data's (thinking off" in report["rendering"]
    assert report["mode_mismatch"] in out and read_manifest(root / "run")["stages"]["eval"]["mode_mismatch"] is True
    markdown = (root / "run" / "eval" / "report.md").read_text()
    assert f"**{report['mode_mismatch']}**" in markdown
    assert "| dflash (mode mismatch, on purpose) |" in markdown and "| target (mode mismatch, on purpose) |" in markdown
    # the mode reached the prompts: Qwen3 closes an empty think block in the generation prompt when thinking is off
    assert matching["prompts"][0]["prompt_tokens"] == report["prompts"][0]["prompt_tokens"] + 4


def test_a_dataset_written_before_the_block_still_evaluates_with_a_note(setup, tmp_path, capsys):
    root, off, on, meta = setup
    old = shutil.copytree(meta.parent, tmp_path / "old")
    document = json.loads((old / META_NAME).read_text())
    del document["rendering"]
    (old / META_NAME).write_text(json.dumps(document))
    profile = tmp_path / "old.toml"
    profile.write_text(on.read_text().replace(f'dataset = "{meta.parent}"', f'dataset = "{old}"'))
    assert launcher.main(["eval", "--profile", str(profile)]) == 0
    assert f"{old / META_NAME} predates the rendering record (re-run tokenize to write it)" in capsys.readouterr().out
    assert "mode_mismatch" not in eval_report(root)


def test_another_chat_template_than_the_datas_is_refused(setup, smollm2_dir, tiny_qwen3_target, capsys):
    """Data rendered with SmolLM2's template, eval with Qwen3's: both fingerprints and files named."""
    root, off, _, _ = setup
    smol = write_profile(root, "smol", tiny_qwen3_target, False, root / "smol-data", tokenizer=smollm2_dir)
    meta = tokenize(smol, RECORDS, root / "smol-data")
    qwen = write_profile(root, "qwen", tiny_qwen3_target, False, root / "smol-data")
    assert launcher.main(["eval", "--profile", str(qwen)]) == 2
    err = capsys.readouterr().err
    data_fingerprint = json.loads(meta.read_text())["rendering"]["chat_template_fingerprint"][:8]
    assert f"chat template: data {meta} rendering.chat_template_fingerprint = {data_fingerprint}, eval model.target" in err
    assert str(tiny_qwen3_target) in err and "--allow-mode-mismatch" in err

    # SmolLM2's template ignores enable_thinking: thinking on renders the data's prompts, nothing to refuse
    from dflash.eval.mode import resolve_render_mode
    from dflash.tokenizer import load_tokenizer

    mode = resolve_render_mode(load_profile(str(smol)), root / "run" / "train" / "checkpoints",
                               load_tokenizer(smollm2_dir), thinking=True, allow_mismatch=False)
    assert mode.thinking and mode.mismatch is None
    assert mode.describe().startswith(f"thinking on (--thinking; this chat template renders both modes alike), "
                                      f"chat template {data_fingerprint}; matches the training data's (thinking off")


def test_the_training_runs_own_dataset_is_the_one_compared(setup, tiny_qwen3_target, tmp_path, capsys):
    """A drafter whose run recorded its profile (train/profile.json) is held against that profile's
    dataset, not the eval profile's; a served check refuses before any server starts."""
    from dflash.eval.options import EvalOptions
    from dflash.eval.served import evaluate_with_engine
    from launcher_core.errors import ConfigError

    root, off, on, meta = setup
    trained = tmp_path / "run"
    shutil.copytree(root / "run" / "train" / "checkpoints", trained / "train" / "checkpoints")
    (trained / "train" / "profile.json").write_text(profile_to_json(load_profile(str(off))))
    elsewhere = write_profile(tmp_path, "elsewhere", tiny_qwen3_target, True, tmp_path / "no-such-dataset")
    assert launcher.main(["eval", "--profile", str(elsewhere), "--run-dir", str(trained)]) == 2
    err = capsys.readouterr().err
    assert f'data {meta} rendering.thinking = "off"' in err

    # a run moved since it trained: its `{run_dir}` paths are found under its directory now
    document = json.loads((trained / "train" / "profile.json").read_text())
    document["paths"].update(run_dir=str(tmp_path / "moved-from"), dataset="{run_dir}/dataset")
    (trained / "train" / "profile.json").write_text(json.dumps(document))
    shutil.copytree(meta.parent, trained / "dataset")
    assert launcher.main(["eval", "--profile", str(elsewhere), "--run-dir", str(trained)]) == 2
    assert f'data {trained / "dataset" / META_NAME} rendering.thinking = "off"' in capsys.readouterr().err
    with pytest.raises(ConfigError, match="rendering.thinking"):
        evaluate_with_engine(load_profile(str(elsewhere)), trained, trained / "train" / "checkpoints",
                             EvalOptions(), "vllm", launch=["false"])


def test_the_served_check_renders_in_the_same_mode_and_marks_its_report(setup, tmp_path):
    """`eval --engine` with --allow-mode-mismatch: engine-<engine>.md / .json carry the mode and the mark;
    the token ids it serves are rendered (by inprocess_decode) with the settings' mode, the eval's.
    The stand-in engine serves our own decoder behind SGLang's API (tests/eval/engine_standin.py)."""
    import contextlib
    import dataclasses
    import sys
    from pathlib import Path

    from dflash.eval.options import EvalOptions
    from dflash.eval.report_schema import read_report
    from dflash.eval.served import evaluate_with_engine
    from launcher_core.errors import ParityFailed
    from tests.generate.gen_helpers import free_port

    root, off, on, meta = setup
    profile = load_profile(str(on))
    profile = dataclasses.replace(profile, eval=dataclasses.replace(profile.eval, engine_port=free_port()))
    standin = Path(__file__).resolve().parent / "engine_standin.py"
    with contextlib.suppress(ParityFailed):       # a random target's near-ties may fail the gate; the report is written first
        evaluate_with_engine(profile, root / "run", root / "run" / "train" / "checkpoints",
                             EvalOptions(allow_mode_mismatch=True), "sglang",
                             launch=[sys.executable, str(standin), "sglang", "--mode", "honest"])
    report = read_report(root / "run" / "eval" / "engine-sglang.json")
    assert report.context.mode_mismatch and "thinking: data" in report.context.mode_mismatch
    assert report.context.rendering.startswith(f"thinking on (generate.thinking of profile {on.stem})")
    markdown = (root / "run" / "eval" / "engine-sglang.md").read_text()
    assert f"**{report.context.mode_mismatch}**" in markdown and "| dflash (mode mismatch, on purpose) |" in markdown
    from dflash.eval.served import engine_settings

    assert engine_settings(profile, EvalOptions(thinking=False)).thinking is False and engine_settings(profile, EvalOptions()).thinking


def test_an_exported_drafter_is_held_against_the_data_it_was_trained_on(setup, tiny_qwen3_target, tmp_path, capsys):
    """The export carries its training data's record (training_data.json: from the checkpoint, or for a
    checkpoint written before it from its run's train/profile.json): eval of the export elsewhere, with a
    profile whose own dataset is another one, compares with the trained data's mode and names the record."""
    root, off, on, meta = setup
    trained = tmp_path / "run"
    shutil.copytree(root / "run" / "train" / "checkpoints", trained / "train" / "checkpoints")
    (trained / "train" / "profile.json").write_text(profile_to_json(load_profile(str(off))))
    exported = tmp_path / "shipped" / "drafter"
    assert launcher.main(["export", str(trained / "train" / "checkpoints"), "--for", "reference", "-o",
                          str(exported)]) == 0
    record = json.loads((exported / "training_data.json").read_text())
    assert record["meta"] == str(meta) and record["rendering"]["thinking"] == "off"
    shutil.rmtree(trained)                                  # the run is gone: the export alone says what it learned
    thinking_data = tokenize(on, [{**r, "sampling": {"thinking": True}} for r in RECORDS], tmp_path / "on-data")
    elsewhere = write_profile(tmp_path, "elsewhere", tiny_qwen3_target, True, thinking_data.parent)
    capsys.readouterr()
    assert launcher.main(["eval", "--profile", str(elsewhere), "--draft", str(exported)]) == 2
    err = capsys.readouterr().err
    assert f'data {meta} (as {exported / "training_data.json"} records it) rendering.thinking = "off"' in err
    again = tmp_path / "again"
    assert launcher.main(["export", str(exported), "--for", "vllm", "-o", str(again)]) == 0    # the record goes on
    assert json.loads((again / "training_data.json").read_text()) == record


@pytest.mark.parametrize("damage, named", [
    (lambda meta: "{not json", "line 1: not valid JSON"),
    (lambda meta: {**meta, "rendering": {**meta["rendering"], "thinking": "sometimes"}},
     'rendering.thinking = "sometimes"; valid: on, off, mixed'),
    (lambda meta: {**meta, "rendering": {**meta["rendering"], "records_by_thinking": {"on": "3"}}},
     'rendering.records_by_thinking = {"on": "3"}; valid: {"on": N, "off": M}'),
    (lambda meta: {**meta, "rendering": {**meta["rendering"], "records_by_thinking": {"on": 3, "off": 0}}},
     'rendering.thinking = "off" disagrees with .records_by_thinking = {"on": 3, "off": 0} ("on")'),
])
def test_a_damaged_meta_is_an_error_naming_the_file_and_field(setup, tmp_path, damage, named):
    """Not taken for a dataset without a record (which is compared with nothing): eval names the file and the
    field, and so does train at launch, before anything of a run is written."""
    from dflash.eval.mode import resolve_render_mode
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for
    from dflash.train.supervisor.launch import training_data
    from launcher_core.errors import InputError

    root, off, on, meta = setup
    damaged = shutil.copytree(meta.parent, tmp_path / "damaged")
    document = damage(json.loads(meta.read_text()))
    (damaged / META_NAME).write_text(document if isinstance(document, str) else json.dumps(document))
    profile = load_profile(str(off))
    profile = dataclasses.replace(profile, paths=dataclasses.replace(profile.paths, dataset=str(damaged)))
    tokenizer = load_tokenizer(tokenizer_dir_for(profile))
    with pytest.raises(InputError) as raised:
        resolve_render_mode(profile, root / "run" / "train" / "checkpoints", tokenizer, thinking=None,
                            allow_mismatch=False)
    assert str(raised.value).startswith(f"{damaged / META_NAME}: ") and named in str(raised.value)
    with pytest.raises(InputError, match=re.escape(named)):
        training_data(profile)


def test_mixed_data_compares_thinking_per_record_share(setup, tiny_qwen3_target, tmp_path):
    """9 of 10 records rendered thinking on (a turn with reasoning), 1 off: eval in either mode is accepted, its
    share of the records stated; data with no record in eval's mode is refused (the first test)."""
    from dflash.eval.mode import resolve_render_mode
    from dflash.tokenizer import load_tokenizer

    root, off, on, meta = setup
    reasoning = [{"id": f"m{i}", "messages": [{"role": "user", "content": f"Add {i}."},
                                              {"role": "assistant", "reasoning_content": "Adding.",
                                               "content": f"{i + i}."}]} for i in range(9)]
    mixed = tokenize(off, [*reasoning, RECORDS[0]], tmp_path / "mixed")
    block = json.loads(mixed.read_text())["rendering"]
    assert block["thinking"] == "mixed" and block["records_by_thinking"] == {"on": 9, "off": 1}
    profile = load_profile(str(write_profile(tmp_path, "mixed", tiny_qwen3_target, False, mixed.parent)))
    tokenizer = load_tokenizer(tiny_qwen3_target)
    for thinking, share in ((False, "10% of its records (1 of 10) were rendered thinking off"),
                            (True, "90% of its records (9 of 10) were rendered thinking on")):
        mode = resolve_render_mode(profile, root / "run" / "train" / "checkpoints", tokenizer, thinking=thinking,
                                   allow_mismatch=False)
        assert mode.mismatch is None and f"matches the training data's (thinking mixed: {share}, as eval " \
                                          f"renders, chat template" in mode.describe()


def test_the_drafters_record_comes_first_and_is_checked_as_the_meta_is(setup, tmp_path):
    """A checkpoint's training_data.json decides, whatever the eval profile's dataset says: a record without a
    rendering is not compared (a note says so), a damaged one is an error naming the record and the field."""
    from dflash.eval.mode import resolve_render_mode
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for
    from launcher_core.errors import InputError

    root, off, on, meta = setup
    step = shutil.copytree(root / "run" / "train" / "checkpoints" / "step-3", tmp_path / "elsewhere" / "step-3")
    profile = load_profile(str(on))                                  # its dataset is thinking off: not consulted
    tokenizer = load_tokenizer(tokenizer_dir_for(profile))
    record = {"dataset": str(tmp_path / "gone"), "meta": str(tmp_path / "gone" / META_NAME), "rendering": None}
    (step / "training_data.json").write_text(json.dumps(record))
    mode = resolve_render_mode(profile, step, tokenizer, thinking=None, allow_mismatch=False)
    assert mode.mismatch is None and f"{step / 'training_data.json'} records no rendering of its training data" \
        in mode.describe()
    record["rendering"] = {**json.loads(meta.read_text())["rendering"], "chat_template_fingerprint": 7}
    (step / "training_data.json").write_text(json.dumps(record))
    with pytest.raises(InputError, match=re.escape(f"{step / 'training_data.json'}: rendering.chat_template_fingerprint "
                                                   f"= 7; valid: a string")):
        resolve_render_mode(profile, step, tokenizer, thinking=None, allow_mismatch=False)
