"""Profiles: strict validation, `extends` merging, clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from launcher_core.errors import ConfigError
from launcher_core.profile import list_profiles, load_profile


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path


BASE = """
description = "base"
[machine]
device = "cuda"
gpu_count = 8
[model]
target = "/models/x"
[train]
global_batch = 64
"""


def test_shipped_profiles_load_and_variants_inherit():
    assert {"rtx6000-x8", "b200-x8", "h200-x1", "cpu-demo"} <= set(list_profiles())
    base, variant = load_profile("rtx6000-x8"), load_profile("b200-x8")
    assert variant.machine.compute_capability == "10.0" and variant.machine.cuda == "13.0"
    assert variant.machine.gpu_count == base.machine.gpu_count == 8  # inherited, not restated
    assert variant.model.target == base.model.target
    assert load_profile("cpu-demo").machine.backend == "gloo"


def test_variant_states_only_what_differs(tmp_path):
    write(tmp_path, "base", BASE)
    write(tmp_path, "small", 'extends = "base"\n[machine]\ngpu_count = 2\n')
    profile = load_profile("small", tmp_path)
    assert profile.machine.gpu_count == 2
    assert profile.machine.device == "cuda" and profile.train.global_batch == 64


def test_unknown_key_names_file_key_and_valid_keys(tmp_path):
    path = write(tmp_path, "bad", BASE + "[data]\nmax_lenght = 5\n")
    with pytest.raises(ConfigError) as info:
        load_profile("bad", tmp_path)
    message = str(info.value)
    assert str(path) in message and "data.max_lenght" in message and "max_length" in message


def test_wrong_type_and_bad_choice_are_named(tmp_path):
    write(tmp_path, "t", BASE.replace("gpu_count = 8", 'gpu_count = "eight"'))
    with pytest.raises(ConfigError, match=r"machine.gpu_count.*expected an integer"):
        load_profile("t", tmp_path)
    write(tmp_path, "c", BASE.replace('device = "cuda"', 'device = "tpu"'))
    with pytest.raises(ConfigError, match=r"machine.device.*one of: 'cuda', 'cpu'"):
        load_profile("c", tmp_path)


def test_missing_required_value(tmp_path):
    write(tmp_path, "m", BASE.replace('target = "/models/x"', ""))
    with pytest.raises(ConfigError, match=r"model.target.*required"):
        load_profile("m", tmp_path)


def test_extends_unknown_and_cycle(tmp_path):
    write(tmp_path, "a", 'extends = "b"\n' + BASE)
    write(tmp_path, "b", 'extends = "a"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_profile("a", tmp_path)
    write(tmp_path, "c", 'extends = "nowhere"\n')
    with pytest.raises(ConfigError, match="unknown profile 'nowhere'"):
        load_profile("c", tmp_path)


def test_a_profile_outside_profiles_extends_a_shipped_one_and_a_neighbour_comes_first(tmp_path):
    from launcher_core.profile import load_profile

    mine = tmp_path / "mine.toml"
    mine.write_text('extends = "cpu-demo"\n[train]\nlr = 0.5\n')
    loaded = load_profile(str(mine))
    assert loaded.train.lr == 0.5 and loaded.machine.nproc_per_node == load_profile("cpu-demo").machine.nproc_per_node
    (tmp_path / "cpu-demo.toml").write_text('extends = "rtx6000-x8"\n')     # a file next to it wins
    assert load_profile(str(mine)).machine.device == "cuda"


def test_profile_json_round_trip_is_validated_like_toml(tmp_path):
    import json

    import pytest

    from launcher_core.errors import ConfigError
    from launcher_core.profile import load_profile, profile_from_json, profile_to_json

    profile = load_profile("rtx6000-x8")
    path = tmp_path / "profile.json"
    path.write_text(profile_to_json(profile))
    assert profile_from_json(path) == profile
    document = json.loads(path.read_text())
    document["train"]["no_such_key"] = 1
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="train.no_such_key"):
        profile_from_json(path)
