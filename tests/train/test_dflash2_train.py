"""DFlash 2 in training: two gloo ranks train it and log the selector's own figures; a published-format
DFlash2 directory (SpecForge's / z-lab's config layout, bf16 weights) and a DFlash drafter start a
`drafter.init = "drafter"` run; configs this launcher cannot run as trained are refused by name."""
from __future__ import annotations

import json
import math

import pytest
import torch

from launcher_core.errors import InputError
from launcher_core.profile import load_profile
from tests.train.conftest import write_profile

DFLASH2 = {"num_layers": 2, "target_layer_ids": [1, 2], "kind": "dflash2", "conv_group_size": 16,
           "selector_rank": 8, "selector_top_k": 4}


def profile_for(root, name, target, dataset, nproc: int = 1, **drafter):
    path = write_profile(root / f"{name}.toml", target, dataset, root / name, machine={"nproc_per_node": nproc},
                         max_steps=2, save_every_steps=2, drafter={**DFLASH2, **drafter})
    return load_profile(str(path))


@pytest.mark.slow
def test_two_ranks_train_dflash2_and_log_the_selectors_figures(tmp_path, tiny_qwen3_target, tiny_dataset):
    from dflash.train.supervisor.launch import run_training

    path = write_profile(tmp_path / "p.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "run", max_steps=4,
                         save_every_steps=4, selector_loss_alpha=0.5, drafter=DFLASH2)
    assert run_training(load_profile(str(path)), run_dir=tmp_path / "run") == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        figures = line["selector"]
        assert math.isclose(line["loss"], figures["unary_loss"] + 0.5 * figures["selector_loss"], rel_tol=1e-6)
        assert len(figures["candidate_recall"]) == 3 and all(0 <= r <= 1 for r in figures["candidate_recall"] if r is not None)
        assert math.isclose(figures["lift"], figures["selector_tau"] - figures["unary_tau"], abs_tol=1e-12)
    assert lines[-1]["selector"]["unary_loss"] < lines[0]["selector"]["unary_loss"]
    rank_logs = [path.read_text(errors="replace") for path in (tmp_path / "run").rglob("stderr.log")]
    assert rank_logs and not any("returned a view tensor" in text for text in rank_logs)   # FSDP2's warning on the selector


def published_dflash2(target, directory, top_k: int = 4, **dflash_extra):
    """A DFlash 2 drafter directory as published: SpecForge's configs/qwen3.6-27b-dflash2.json layout
    (the DFlash 2 keys in dflash_config, explicit is_causal, auto_map, a top-level rope_theta, no
    use_sliding_window), bf16 weights with the bare codebook names."""
    from safetensors.torch import save_file

    from dflash.drafter.checkpoint_files import config_document
    from dflash.drafter.dflash2 import DFlash2Options, drafter_for_config, with_dflash2
    from dflash.drafter.network import drafter_config

    config = drafter_config(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 2], mask_token_id=151669,
                            layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    config.num_target_layers = target.config.num_hidden_layers
    config = with_dflash2(config, DFlash2Options(conv_group_size=16, selector_rank=8, selector_top_k=top_k))
    torch.manual_seed(11)
    drafter = drafter_for_config(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    document = config_document(drafter.config)
    for key in ("rope_parameters", "use_sliding_window", "dtype", "torch_dtype"):
        document.pop(key, None)
    document.update(auto_map={"AutoModel": "dflash.DFlash2DraftModel"}, rope_theta=1e6, is_causal=True, dtype="bfloat16")
    document["dflash_config"].update(dflash_extra)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(document))
    tensors = {name: value.to(torch.bfloat16).contiguous() for name, value in drafter.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory, tensors


def test_a_published_dflash2_directory_starts_a_dflash2_profile(tmp_path, tiny_target_model, tiny_qwen3_target, tiny_dataset):
    from dflash.train.rank.setup import build_drafter

    directory, tensors = published_dflash2(tiny_target_model, tmp_path / "published")
    profile = profile_for(tmp_path, "from-published", tiny_qwen3_target, tiny_dataset, init="drafter",
                          init_from=str(directory), layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    drafter = build_drafter(profile, tiny_target_model, [1, 2], 4)
    assert type(drafter).__name__ == "DFlash2Drafter"
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, tensors[name].float()), name


def test_a_dflash_drafter_starts_a_dflash2_profile_as_itself(tmp_path, tiny_target_model, tiny_qwen3_target, tiny_dataset):
    """Backbone from the DFlash checkpoint; identity convolutions and a no-op selector: the same drafts."""
    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.train.rank.setup import build_drafter

    plain = profile_for(tmp_path, "plain", tiny_qwen3_target, tiny_dataset, kind="dflash", conv_group_size=16,
                        selector_rank=256, selector_top_k=16)
    source = build_drafter(plain, tiny_target_model, [1, 2], 4)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    checkpoint = save_checkpoint(tmp_path / "plain-run", source, 1, {})
    second = build_drafter(profile_for(tmp_path, "second", tiny_qwen3_target, tiny_dataset, init="drafter",
                                       init_from=str(checkpoint)), tiny_target_model, [1, 2], 4)
    features, anchor = torch.randn(1, 9, 128), 1005
    hidden = second.draft_hidden(features, anchor, 9)
    torch.testing.assert_close(hidden, source.draft_hidden(features, anchor, 9), rtol=0, atol=0)
    walk = second.selector.walk(second.logits(hidden[1:]), hidden[1:], anchor)
    assert walk.tokens.tolist() == source.logits(hidden[1:]).argmax(-1).tolist()


def test_a_dflash2_directory_with_other_selector_settings_is_refused_listing_them(tmp_path, tiny_target_model,
                                                                                 tiny_qwen3_target, tiny_dataset):
    from dflash.train.rank.setup import build_drafter

    directory, _ = published_dflash2(tiny_target_model, tmp_path / "published", top_k=6, output_multiplier=2.0)
    profile = profile_for(tmp_path, "mismatch", tiny_qwen3_target, tiny_dataset, init="drafter", init_from=str(directory),
                          layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    with pytest.raises(InputError) as caught:
        build_drafter(profile, tiny_target_model, [1, 2], 4)
    assert "dflash_config.selector_top_k: 6 there, 4 in the profile" in str(caught.value)
    assert "dflash_config.output_multiplier: 2.0 there, 1.0 in the profile" in str(caught.value)


@pytest.mark.parametrize("change, named", [
    ({"input_embedding_scale": 2.0}, "input_embedding_scale 2.0: the block embedding is not scaled here"),
    ({"selector_rank": None}, "dflash_config.selector_rank missing"),
    ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 64"),
])
def test_dflash2_configs_it_cannot_run_as_trained_are_refused_by_name(tmp_path, tiny_target_model, change, named):
    from dflash.drafter.checkpoint_files import init_source_problem, load_drafter

    directory, _ = published_dflash2(tiny_target_model, tmp_path / "published")
    document = json.loads((directory / "config.json").read_text())
    document["dflash_config"].update(change)
    (directory / "config.json").write_text(json.dumps(document))
    with pytest.raises(InputError, match=named):
        load_drafter(directory, tiny_target_model)
    assert named in init_source_problem(directory)
