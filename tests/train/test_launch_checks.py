"""Launch-time profile checks (dflash.train.supervisor.launch_checks): each mistake a training rank would find
after loading the target is a ConfigError (exit 2) before launch, naming the file and the key."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash.tokenizer import tokenizer_mask_token_id
from dflash.train.supervisor.launch_checks import validate_profile_for_launch
from launcher_core.errors import EXIT_USAGE, ConfigError
from launcher_core.profile import load_profile

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


@pytest.fixture
def profiles_dir(tmp_path) -> Path:
    """The shipped rtx6000-x8 and flagship-twin profiles, where a test's variant can extend them."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    for name in ("rtx6000-x8", "flagship-twin"):
        shutil.copy(PROFILES / f"{name}.toml", folder / f"{name}.toml")
    return folder


def variant(folder: Path, body: str, base: str = "flagship-twin", target: str = "") -> Path:
    """A profile extending `base` with `body` (TOML sections); `target` replaces model.target."""
    path = folder / "variant.toml"
    model = f'[model]\ntarget = "{target}"\n' if target else ""
    path.write_text(f'extends = "{base}"\n{model}{body}\n', encoding="utf-8")
    return path


def check(path: Path):
    return validate_profile_for_launch(load_profile(str(path)), source=str(path))


def problems_of(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        check(path)
    assert caught.value.exit_code == EXIT_USAGE
    return str(caught.value)


@pytest.fixture(scope="module")
def qwen36_config_dir(fixtures_dir) -> Path:
    """Qwen3.6-27B's config.json (published facts; no weights): the flagship's real target shape."""
    return fixtures_dir / "targets" / "qwen3.6-27b"


def test_the_flagship_twin_profile_passes_with_the_flagship_policies(profiles_dir, flagship_twin_target):
    facts = check(variant(profiles_dir, "", target=str(flagship_twin_target)))
    assert facts.layer_ids == [1, 2, 3, 4, 5]            # default spacing over the twin's 8 layers
    assert facts.mask_token_id == 248070 and facts.decay_gamma == 7.0


def test_the_flagship_profile_passes_on_the_real_qwen36_config(profiles_dir, qwen36_config_dir):
    facts = check(variant(profiles_dir, "", base="rtx6000-x8", target=str(qwen36_config_dir)))
    assert facts.target.num_layers == 64 and facts.target.vocab_rows == 248320
    assert facts.layer_ids == [1, 16, 31, 46, 61] and facts.mask_token_id == 248070


def test_a_block_size_without_default_decay_names_train_decay_gamma(profiles_dir, flagship_twin_target):
    path = variant(profiles_dir, "[drafter]\nblock_size = 12", target=str(flagship_twin_target))
    message = problems_of(path)
    assert f"{path}: key 'train.decay_gamma': unset, and no default loss decay for block size 12" in message
    path = variant(profiles_dir, "[drafter]\nblock_size = 12\n[train]\ndecay_gamma = 6.0", target=str(flagship_twin_target))
    assert check(path).decay_gamma == 6.0


def test_a_target_too_shallow_for_the_default_taps_names_drafter_num_layers(profiles_dir, tiny_qwen3_target):
    """The default spacing (layer 1 to N-3) needs 5 target layers for 2 taps; the tiny Qwen3 has 4."""
    path = variant(profiles_dir, "[drafter]\nnum_layers = 2\nlayer_types = []\nsliding_window = 0\nmask_token_id = 7",
                   target=str(tiny_qwen3_target))
    message = problems_of(path)
    assert (f"{path}: key 'drafter.num_layers': a target with 4 layers is too shallow for 2 tap layers; "
            f"set drafter.target_layer_ids or fewer draft layers") in message
    fixed = variant(profiles_dir, "[drafter]\nnum_layers = 2\nlayer_types = []\nsliding_window = 0\nmask_token_id = 7\n"
                    "target_layer_ids = [1, 3]", target=str(tiny_qwen3_target))
    assert check(fixed).layer_ids == [1, 3]


def test_no_mask_token_names_the_file_that_should_set_it_and_the_row_to_use(tmp_path, profiles_dir, flagship_twin_target):
    """rtx6000-x8 before this fix: no mask_token_id, a tokenizer without a mask token."""
    (profiles_dir / "rtx6000-x8.toml").write_text(
        (PROFILES / "rtx6000-x8.toml").read_text(encoding="utf-8").replace("mask_token_id = 248070", ""), encoding="utf-8")
    path = variant(profiles_dir, "", target=str(flagship_twin_target))
    message = problems_of(path)
    assert f"{path}: key 'drafter.mask_token_id': unset, and the tokenizer in {flagship_twin_target} has no mask token" in message
    assert "248,320-row vocabulary: 248070" in message


def test_a_mask_token_outside_the_embedding_names_the_key(profiles_dir, flagship_twin_target):
    path = variant(profiles_dir, "[drafter]\nmask_token_id = 248320", target=str(flagship_twin_target))
    assert f"{path}: key 'drafter.mask_token_id': 248320 is not a row of the target's embedding (0..248319)" in problems_of(path)


def test_the_mask_token_is_inherited_from_the_file_that_sets_it(profiles_dir, flagship_twin_target):
    """A key set further up the `extends` chain is reported against that file."""
    (profiles_dir / "rtx6000-x8.toml").write_text(
        (PROFILES / "rtx6000-x8.toml").read_text(encoding="utf-8").replace("248070", "999999"), encoding="utf-8")
    message = problems_of(variant(profiles_dir, "", target=str(flagship_twin_target)))
    assert f"{profiles_dir / 'rtx6000-x8.toml'}: key 'drafter.mask_token_id': 999999" in message


def test_tap_layers_outside_the_target_are_named(profiles_dir, flagship_twin_target):
    path = variant(profiles_dir, "[drafter]\ntarget_layer_ids = [1, 4, 8]", target=str(flagship_twin_target))
    assert f"{path}: key 'drafter.target_layer_ids': [8] outside the target's layers 0..7" in problems_of(path)


def test_init_target_on_the_hybrid_flagship_is_refused_at_launch(profiles_dir, flagship_twin_target, qwen36_config_dir):
    for target in (flagship_twin_target, qwen36_config_dir):
        path = variant(profiles_dir, '[drafter]\ninit = "target"', target=str(target))
        message = problems_of(path)
        assert f"{path}: key 'drafter.init': \"target\": the draft layers would start as target layers" in message
        assert "linear_attention (Gated DeltaNet)" in message and 'drafter.init = "random"' in message


def test_init_target_on_a_gated_full_attention_source_is_refused(profiles_dir, flagship_twin_target):
    """One draft layer after tap 2: its source, layer 3, is full attention, but gated."""
    path = variant(profiles_dir, '[drafter]\ninit = "target"\nnum_layers = 1\ntarget_layer_ids = [2]',
                   target=str(flagship_twin_target))
    assert "key 'drafter.init': \"target\": target layers [3] use gated attention" in problems_of(path)


def test_every_problem_is_listed_at_once(profiles_dir, flagship_twin_target):
    path = variant(profiles_dir, "[drafter]\ndraft_vocab_size = 300000\nblock_size = 12",
                   target=str(flagship_twin_target))
    message = problems_of(path)
    assert "(2 problem(s))" in message
    for key in ("train.decay_gamma", "drafter.draft_vocab_size"):
        assert f"{path}: key '{key}'" in message


def test_a_target_without_config_json_is_named(profiles_dir, tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    assert f"{empty / 'config.json'}: cannot read the target's config" in problems_of(variant(profiles_dir, "", target=str(empty)))


def test_tokenizer_mask_token_from_its_files(tmp_path, qwen3_tokenizer_dir):
    assert tokenizer_mask_token_id(qwen3_tokenizer_dir) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"mask_token": {"content": "<mask>"}, "added_tokens_decoder": {"50264": {"content": "<mask>"}}}))
    assert tokenizer_mask_token_id(tmp_path) == 50264
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<mask>"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [], "model": {"vocab": {"<mask>": 7}}}))
    assert tokenizer_mask_token_id(tmp_path) == 7


def test_keys_fsdp2_replaced_are_refused_naming_what_replaced_them(profiles_dir, flagship_twin_target):
    for text, replaced in (('optimizer_sharding = "zero1"', "sharded over the ranks by FSDP2"),
                           ("grad_bucket_mib = 64", "FSDP2's reduce-scatter")):
        path = variant(profiles_dir, f"[train]\n{text}", target=str(flagship_twin_target))
        with pytest.raises(ConfigError) as caught:
            load_profile(str(path))
        assert caught.value.exit_code == EXIT_USAGE
        assert f"key 'train.{text.split()[0]}': no longer a profile key" in str(caught.value)
        assert replaced in str(caught.value) and "delete the key" in str(caught.value)


def test_the_fsdp2_keys_take_their_choices_only(profiles_dir, flagship_twin_target):
    for key, bad in (("gradient_sync", '"sometimes"'), ("activation_checkpointing", '"attention"'),
                     ("reshard_after_forward", '"yes"')):
        with pytest.raises(ConfigError, match=f"train.{key}"):
            load_profile(str(variant(profiles_dir, f"[train]\n{key} = {bad}", target=str(flagship_twin_target))))
    assert check(variant(profiles_dir, '[train]\ngradient_sync = "last_micro_batch"\nreshard_after_forward = false',
                         target=str(flagship_twin_target)))


def test_drafter_layer_and_rope_keys_are_checked_at_launch(profiles_dir, flagship_twin_target):
    path = variant(profiles_dir, '[drafter]\nlayer_types = ["sliding_attention", "full_attention"]\nsliding_window = 0\n'
                   'rope_scaling = "yarn"\nrope_scaling_factor = 1.0', target=str(flagship_twin_target))
    message = problems_of(path)
    assert f"{path}: key 'drafter.layer_types': layer_types has 2 entries for 5 layers" in message
    assert f"{path}: key 'drafter.layer_types': sliding_attention layers need sliding_window >= 1" in message
    assert f"{path}: key 'drafter.rope_scaling_factor': 1.0 with rope_scaling 'yarn'" in message


def test_an_unknown_layer_type_is_refused_by_the_schema(profiles_dir, flagship_twin_target):
    path = variant(profiles_dir, '[drafter]\nlayer_types = ["chunked_attention"]', target=str(flagship_twin_target))
    with pytest.raises(ConfigError, match="drafter.layer_types.*'sliding_attention'"):
        load_profile(str(path))


def test_init_drafter_needs_a_drafter_directory(profiles_dir, flagship_twin_target, tmp_path):
    path = variant(profiles_dir, '[drafter]\ninit = "drafter"', target=str(flagship_twin_target))
    assert f"{path}: key 'drafter.init_from': unset; drafter.init = \"drafter\" needs" in problems_of(path)
    path = variant(profiles_dir, f'[drafter]\ninit = "drafter"\ninit_from = "{tmp_path}"', target=str(flagship_twin_target))
    assert f"key 'drafter.init_from': {tmp_path}: no config.json" in problems_of(path)
    path = variant(profiles_dir, f'[drafter]\ninit_from = "{tmp_path}"', target=str(flagship_twin_target))
    assert "is set but drafter.init is 'random'" in problems_of(path)


def test_a_dflash2_profile_passes_on_the_real_qwen36_config_with_the_published_settings(profiles_dir, qwen36_config_dir):
    check(variant(profiles_dir, '[drafter]\nkind = "dflash2"', base="rtx6000-x8", target=str(qwen36_config_dir)))


def test_dflash2_groups_must_tile_the_hidden_size_and_top_k_fit_the_vocabulary(profiles_dir, qwen36_config_dir):
    body = '[drafter]\nkind = "dflash2"\nconv_group_size = 48\nselector_top_k = 300000'
    text = problems_of(variant(profiles_dir, body, base="rtx6000-x8", target=str(qwen36_config_dir)))
    assert "key 'drafter.conv_group_size': 48 does not divide the target's hidden size 5120" in text
    assert "key 'drafter.selector_top_k': 300000 exceeds the target's vocabulary (248320)" in text


@pytest.mark.parametrize("dataset_state", ["missing", "empty_folder"])
def test_train_before_tokenize_is_exit_2_before_the_audit_naming_the_dataset_and_tokenize(
        cli, tmp_path, tiny_qwen3_target, private_cache, dataset_state):
    """`train` with no dataset at paths.dataset (tokenize never ran, or wrote elsewhere): exit 2 from the
    launcher naming the path and `launcher.py tokenize --profile P`, before the preflight audit, torchrun
    or any model load (not the ranks after launch: no exit 5, no traceback per rank)."""
    from tests.train.conftest import write_profile

    dataset, run_dir = tmp_path / "data" / "dataset", tmp_path / "run"
    if dataset_state == "empty_folder":
        dataset.mkdir(parents=True)
    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, dataset, run_dir)
    result = cli("train", "--profile", profile)
    assert result.code == 2, result.err
    said = ("no training dataset there (paths.dataset of profile p); run "
            f"`launcher.py tokenize --profile {profile}` first" if dataset_state == "missing" else
            "not a dataset (paths.dataset of profile p: a directory with dflash_meta.json or state.json")
    assert result.err.startswith(f"error: {dataset}: {said}"), result.err
    assert "Traceback" not in result.err and "preflight" not in result.out + result.err
    assert not (run_dir / "train").exists() and not (run_dir / "audit").exists()
    printed = cli("train", "--profile", profile, "--print-command")       # starts nothing: no dataset needed
    assert printed.code == 0 and "dflash.train.supervisor.agent" in printed.out, printed.err
