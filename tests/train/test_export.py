"""`launcher.py export` and the drafter directory formats: ours, the engines' (fields each engine
reads, from its source: dflash.drafter.export.ENGINE_READS, listed in docs/checkpoints.md) and the
published z-lab format that `--draft` also accepts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflash.drafter.checkpoint_files import load_drafter, save_checkpoint
from dflash.drafter.export import ENGINE_READS, export_drafter, missing_fields
from dflash.drafter.network import DFlashDrafter, drafter_config
from launcher_core.errors import InputError

REPO = Path(__file__).resolve().parents[2]
MASK_ID = 151669


def make_drafter(target, vocab_ids=None) -> DFlashDrafter:
    torch.manual_seed(0)
    config = drafter_config(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 2], mask_token_id=MASK_ID,
                            draft_vocab_size=len(vocab_ids or []))
    drafter = DFlashDrafter(config).attach_target(target)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    if vocab_ids:
        drafter.set_draft_vocab(torch.tensor(vocab_ids))
    return drafter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_target_model) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"), make_drafter(tiny_target_model), 3, {})


@pytest.fixture(scope="module")
def vocab_checkpoint(tmp_path_factory, tiny_target_model) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("vckpt"), make_drafter(tiny_target_model, [5, 900, 1000, 70000]), 3, {})


@pytest.mark.parametrize("engine", sorted(ENGINE_READS))
def test_export_has_every_field_the_engine_reads(checkpoint, engine, tmp_path):
    out = export_drafter(checkpoint, engine, tmp_path / engine).directory
    document = json.loads((out / "config.json").read_text())
    assert missing_fields(document, engine) == []
    assert document["rope_theta"] == document["rope_parameters"]["rope_theta"]
    assert document["dflash_config"]["block_size"] == document["block_size"] == 4
    for key, engine_default in ENGINE_READS[engine]["defaults_that_bite"].items():
        assert document[key] != engine_default or key not in document
    if engine == "vllm":
        assert document["eagle_aux_hidden_state_layer_ids"] == [2, 3]    # hidden_states index = layer id + 1


def test_our_training_config_already_carries_what_sglang_and_the_reference_read(checkpoint):
    document = json.loads((checkpoint / "config.json").read_text())
    assert missing_fields(document, "sglang") == [] and missing_fields(document, "reference") == []


def test_docs_list_the_same_fields_per_engine():
    text = (REPO / "docs" / "checkpoints.md").read_text()
    for engine, reads in ENGINE_READS.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| {engine} |")), None)
        assert row is not None, f"docs/checkpoints.md has no row for {engine}"
        listed = set(re.findall(r"`([\w.]+)`", row.split("|")[3]))
        assert listed == set(reads["required"]), (engine, listed ^ set(reads["required"]))
        sliding = set(re.findall(r"`([\w.]+)`", row.split("|")[5]))
        assert sliding == set(reads["sliding"]), (engine, sliding ^ set(reads["sliding"]))
        assert reads["version"] in row


def test_draft_vocabulary_is_refused_where_the_engine_cannot_hold_it(vocab_checkpoint, tmp_path):
    for engine in ("sglang", "reference"):
        with pytest.raises(InputError, match="--full-vocab"):
            export_drafter(vocab_checkpoint, engine, tmp_path / engine)
        assert not (tmp_path / engine).exists()
    result = export_drafter(vocab_checkpoint, "sglang", tmp_path / "full", full_vocab=True)
    assert "whole vocabulary" in result.notes[0]
    from safetensors.torch import load_file

    assert "draft_vocab" not in load_file(str(tmp_path / "full" / "model.safetensors"))
    assert "draft_vocab_size" not in json.loads((tmp_path / "full" / "config.json").read_text())["dflash_config"]


def test_vllm_export_converts_the_draft_vocabulary_to_lm_head_rows_and_d2t(vocab_checkpoint, tiny_qwen3_target,
                                                                          tiny_target_model, tmp_path):
    from safetensors.torch import load_file

    with pytest.raises(InputError, match="--target"):
        export_drafter(vocab_checkpoint, "vllm", tmp_path / "no-target")
    out = export_drafter(vocab_checkpoint, "vllm", tmp_path / "v", target=tiny_qwen3_target).directory
    weights = load_file(str(out / "model.safetensors"))
    ids = torch.tensor([5, 900, 1000, 70000])
    assert torch.equal(weights["d2t"] + torch.arange(4), ids)
    torch.testing.assert_close(weights["lm_head.weight"], tiny_target_model.lm_head.weight[ids])
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 4


def test_the_writer_itself_refuses_what_it_did_not_write(checkpoint, tiny_qwen3_target, tmp_path):
    """Any caller of export_drafter (the export command, the eval engines) gets the output rules."""
    from launcher_core.errors import ConfigError

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="is an existing folder that is not a drafter export"):
        export_drafter(checkpoint, "vllm", folder, force=True)
    assert [p.name for p in folder.iterdir()] == ["mine.txt"]
    before = sorted(p.name for p in checkpoint.iterdir())
    for output in (checkpoint, checkpoint.parent, Path(tiny_qwen3_target)):
        with pytest.raises(ConfigError, match="(is the input|contains the input)"):
            export_drafter(checkpoint, "vllm", output, force=True, target=Path(tiny_qwen3_target))
    assert sorted(p.name for p in checkpoint.iterdir()) == before and "training_state.pt" in before
    out = export_drafter(checkpoint, "vllm", tmp_path / "exported").directory
    with pytest.raises(ConfigError, match="is an existing drafter export; pass --force"):
        export_drafter(checkpoint, "sglang", out)
    export_drafter(checkpoint, "sglang", out, force=True)
    assert json.loads((out / "config.json").read_text())["block_size"] == 4


def test_export_command(checkpoint, tmp_path, capsys):
    from launcher import main

    assert main(["export", str(checkpoint), "--for", "sglang", "-o", str(tmp_path / "s")]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "s" / "model.safetensors").exists()


def test_export_command_names_the_sglang_release_it_refuses(sliding_checkpoint, tmp_path, capsys):
    from launcher import main

    code = main(["export", str(sliding_checkpoint), "--for", "sglang", "-o", str(tmp_path / "s"), "--sglang-version", "0.5.13"])
    assert code == 2 and "SGLang 0.5.13 would not serve this drafter" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def write_published_format(drafter: DFlashDrafter, directory: Path) -> None:
    """A drafter directory as z-lab publishes them: auto_map to their code, top-level rope_theta and
    block_size, no rope_parameters, layer_types, bf16 weights with the reference's names."""
    from safetensors.torch import save_file

    config = drafter.config
    directory.mkdir(parents=True)
    document = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_parameters["rope_theta"], "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "layer_types": ["full_attention"] * config.num_hidden_layers, "use_sliding_window": False,
        "block_size": drafter.block_size, "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": drafter.target_layer_ids},
    }
    (directory / "config.json").write_text(json.dumps(document))
    weights = {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in drafter.state_dict().items()}
    save_file(weights, str(directory / "model.safetensors"))


def test_draft_accepts_a_published_zlab_drafter_directory(tiny_target_model, tmp_path):
    ours = make_drafter(tiny_target_model)
    write_published_format(ours, tmp_path / "z-lab")
    loaded = load_drafter(tmp_path / "z-lab", tiny_target_model)
    with torch.no_grad():       # the same weights, rounded to bf16 as the published file holds them
        for parameter in ours.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    features = torch.randn(1, 9, 2 * tiny_target_model.config.hidden_size)
    torch.testing.assert_close(loaded.draft_logits(features, 1234, 9), ours.draft_logits(features, 1234, 9))
    assert (loaded.block_size, loaded.target_layer_ids) == (4, [1, 2])


def test_unsupported_published_drafters_are_refused_by_name(tiny_target_model, tmp_path):
    write_published_format(make_drafter(tiny_target_model), tmp_path / "d2")
    document = json.loads((tmp_path / "d2" / "config.json").read_text())
    (tmp_path / "d2" / "config.json").write_text(json.dumps({**document, "architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(InputError, match="DFlash 2"):
        load_drafter(tmp_path / "d2", tiny_target_model)
    (tmp_path / "d2" / "config.json").write_text(json.dumps({**document, "layer_types": ["sliding_attention"] * 2}))
    with pytest.raises(InputError, match="sliding_attention"):
        load_drafter(tmp_path / "d2", tiny_target_model)


def test_a_drafter_for_another_target_is_refused_naming_its_mask_token(checkpoint):
    """The mask token of the checkpoint's config must be a row of the target it is loaded onto."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    small = Qwen3ForCausalLM(Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    with pytest.raises(InputError, match=r"config.json: dflash_config.mask_token_id 151669 is not a row of the "
                                         r"target's embedding \(0..999\)"):
        load_drafter(checkpoint, small)


@pytest.fixture(scope="module")
def sliding_checkpoint(tmp_path_factory, tiny_target_model) -> Path:
    torch.manual_seed(0)
    config = drafter_config(tiny_target_model.config, num_layers=2, block_size=4, target_layer_ids=[1, 2],
                            mask_token_id=MASK_ID, layer_types=("sliding_attention", "full_attention"), sliding_window=6,
                            rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})
    return save_checkpoint(tmp_path_factory.mktemp("swa"), DFlashDrafter(config).attach_target(tiny_target_model), 1, {})


@pytest.mark.parametrize("engine", sorted(ENGINE_READS))
def test_sliding_layers_and_yarn_reach_every_export(sliding_checkpoint, engine, tmp_path):
    result = export_drafter(sliding_checkpoint, engine, tmp_path / engine)
    document = json.loads((result.directory / "config.json").read_text())
    assert missing_fields(document, engine) == []
    assert set(ENGINE_READS[engine]["sliding"]) <= set(document)
    assert document["layer_types"] == ["sliding_attention", "full_attention"] and document["sliding_window"] == 6
    assert document["use_sliding_window"] is True and "is_causal" not in document   # causal sliding layers everywhere
    assert document["rope_scaling"] == {"type": "yarn", "rope_type": "yarn", "factor": 2.0,
                                        "original_max_position_embeddings": 128}
    assert document["rope_parameters"]["rope_type"] == "yarn" and document["rope_theta"] > 0
    assert any("VLLM_USE_V2_MODEL_RUNNER=1" in note for note in result.notes) == (engine == "vllm")


def test_sglang_export_refuses_layers_the_serving_release_would_run_otherwise(sliding_checkpoint, tmp_path):
    import shutil

    with pytest.raises(InputError, match=r"SGLang 0\.5\.11 would not serve this drafter as it was trained: layer 0 "
                                         r"\(sliding_attention\): trained causal, window 6, served bidirectional, no window"):
        export_drafter(sliding_checkpoint, "sglang", tmp_path / "old", sglang_version="0.5.11")
    assert not (tmp_path / "old").exists()
    export_drafter(sliding_checkpoint, "sglang", tmp_path / "new", sglang_version="0.5.14")
    unknown = export_drafter(sliding_checkpoint, "sglang", tmp_path / "any")       # no release known: a note
    assert any("from 0.5.14 on" in note for note in unknown.notes)
    copy = tmp_path / "bidirectional"
    shutil.copytree(sliding_checkpoint, copy)
    document = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**document, "is_causal": False}))
    with pytest.raises(InputError, match=r"SGLang 0\.5\.17 would not serve .* trained bidirectional, window 6, served causal"):
        export_drafter(copy, "sglang", tmp_path / "out", sglang_version="0.5.17")
    served = export_drafter(copy, "sglang", tmp_path / "out", sglang_version="0.5.19").directory    # is_causal honoured
    assert json.loads((served / "config.json").read_text())["is_causal"] is False
    assert json.loads((export_drafter(copy, "vllm", tmp_path / "v").directory / "config.json").read_text())["is_causal"] is False


@pytest.fixture(scope="module")
def dflash2_checkpoint(tmp_path_factory, tiny_target_model) -> Path:
    from dflash.drafter.dflash2 import DFlash2Options, drafter_for_config, with_dflash2

    config = drafter_config(tiny_target_model.config, num_layers=2, block_size=4, target_layer_ids=[1, 2],
                            mask_token_id=MASK_ID)
    config.num_target_layers = tiny_target_model.config.num_hidden_layers
    config = with_dflash2(config, DFlash2Options(conv_group_size=16, selector_rank=8, selector_top_k=4,
                                                 final_logit_softcapping=20.0))
    torch.manual_seed(0)
    return save_checkpoint(tmp_path_factory.mktemp("d2ckpt"), drafter_for_config(config).attach_target(tiny_target_model),
                           3, {})


@pytest.mark.parametrize("engine", sorted(ENGINE_READS))
def test_a_dflash2_export_carries_what_each_engine_reads_for_it(dflash2_checkpoint, engine, tmp_path):
    from safetensors import safe_open

    from dflash.drafter.export import DFLASH2_READS

    result = export_drafter(dflash2_checkpoint, engine, tmp_path / engine)
    document = json.loads((result.directory / "config.json").read_text())
    assert document["architectures"] == ["DFlash2DraftModel"] and missing_fields(document, engine) == []
    assert {key.split(".", 1)[1] for key in DFLASH2_READS[engine]["required"]} <= set(document["dflash_config"])
    assert document["dflash_config"]["final_logit_softcapping"] == 20.0
    with safe_open(str(result.directory / "model.safetensors"), "pt") as handle, \
            safe_open(str(dflash2_checkpoint / "model.safetensors"), "pt") as source:
        assert set(handle.keys()) == set(source.keys())
    assert any("V2 model runner" in note for note in result.notes) == (engine == "vllm")
    assert any("0.5.19" in note for note in result.notes) == (engine == "sglang")
    without = {**document, "dflash_config": {k: v for k, v in document["dflash_config"].items() if k != "selector_rank"}}
    assert missing_fields(without, engine) == ["dflash_config.selector_rank"]       # the check can fail
