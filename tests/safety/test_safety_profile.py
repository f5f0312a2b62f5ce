"""Rows 14-15 of the safety table: numeric profile keys out of range (and cross-field rules that
need no target) are refused with exit 2 by plan, train, the pipeline and the ranks alike, naming
file, key, value and the valid range. Each range is declared on its key's field (`launcher_core.schema`,
`key(default, meaning, valid=Range(...))`), each cross-field rule once, as a `@cross_field_rule`."""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from launcher_core import schema
from launcher_core.errors import ConfigError

CASES = [
    ("machine", "nproc_per_node = 0", "machine.nproc_per_node", "0", "an integer >= 1 and <= 1024"),
    ("drafter", "block_size = 0", "drafter.block_size", "0", "an integer >= 2 and <= 4096"),
    ("train", "lr = -0.001", "train.lr", "-0.001", "a finite number > 0"),
    ("train", "lr = nan", "train.lr", "nan", "a finite number > 0"),
    ("train", "warmup_ratio = inf", "train.warmup_ratio", "inf", "a finite number >= 0 and < 1"),
    ("generate", "port = 99999", "generate.port", "99999", "an integer >= 1 and <= 65535"),
    ("eval", "engine_port = 0", "eval.engine_port", "0", "an integer >= 1 and <= 65535"),
    ("eval", "bench_samples = -1", "eval.bench_samples", "-1", "an integer >= 1 and <= 1000000 (or 0: eval.num_prompts)"),
    ("data", "max_length = -1", "data.max_length", "-1", "an integer >= 2 and <= 4194304"),
    ("data", "max_degenerate_share = 7.5", "data.max_degenerate_share", "7.5", "a finite number >= 0 and <= 1"),
    ("drafter", "target_layer_ids = [1, -3]", "drafter.target_layer_ids", "-3 in [1, -3]", "an integer >= 0 and <= 4096"),
    # absurd sizes: bounded by what the plan and the ranks can represent
    ("train", "global_batch = 1000000000000", "train.global_batch", "1000000000000", "an integer >= 1 and <= 1048576"),
    ("drafter", "num_layers = 1000000000000", "drafter.num_layers", "1000000000000", "an integer >= 1 and <= 1024"),
    ("machine", "nproc_per_node = 100000000", "machine.nproc_per_node", "100000000", "an integer >= 1 and <= 1024"),
    ("data", "num_workers = 1000000000000", "data.num_workers", "1000000000000", "an integer >= 0 and <= 1024"),
    ("drafter", "output_multiplier = 0.0", "drafter.output_multiplier", "0.0", "a finite number > 0"),
    ("drafter", "selector_rank = 0", "drafter.selector_rank", "0", "an integer >= 1"),
    ("train", "selector_loss_alpha = -1.0", "train.selector_loss_alpha", "-1.0", "a finite number >= 0"),
]


def bad_profile(tmp_path: Path, section: str, line: str) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(f'extends = "cpu-demo"\n[{section}]\n{line}\n', encoding="utf-8")
    return path


@pytest.mark.parametrize("section, line, key, value, valid", CASES)
def test_plan_refuses_an_out_of_range_value_naming_everything(cli, tmp_path, section, line, key, value, valid):
    profile = bad_profile(tmp_path, section, line)
    result = cli("plan", "--profile", profile)
    assert result.code == 2 and "Traceback" not in result.err
    assert result.err.strip() == f"error: {profile}: key '{key}': {value} is out of range; valid: {valid}"


@pytest.mark.parametrize("command", [["train", "--print-command"], ["pipeline", "--stop-after", "audit"]])
def test_train_and_the_pipeline_refuse_the_same_profile(cli, tmp_path, command):
    profile = bad_profile(tmp_path, "machine", "nproc_per_node = 0")
    result = cli(command[0], "--profile", profile, *command[1:])
    assert result.code == 2 and "key 'machine.nproc_per_node': 0 is out of range" in result.err


def test_the_ranks_refuse_the_same_profile_from_json(tmp_path):
    from launcher_core.profile import load_profile, profile_as_dict, profile_from_json

    document = profile_as_dict(load_profile("cpu-demo"))
    document["train"]["lr"] = -1.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match=rf"{path}: key 'train.lr': -1.0 is out of range"):
        profile_from_json(path)


@pytest.mark.parametrize("section, lines, key, problem", [
    ("train", "global_batch = 5", "train.global_batch", "not a positive multiple of the 2 ranks"),
    ("machine", "nnodes = 2", "machine.rdzv_endpoint", "machine.nnodes = 2 needs it"),
    ("data", "min_loss_tokens = 600", "data.min_loss_tokens", "not below data.max_length 512"),
    ("drafter", "num_attention_heads = 6\nnum_key_value_heads = 4", "drafter.num_key_value_heads", "does not divide"),
    ("drafter", "head_dim = 63", "drafter.head_dim", "63 is odd; valid: an even number"),
    ("drafter", 'kind = "dflash2"', "drafter.draft_vocab_size", "need the target's whole vocabulary at the head"),
    ("drafter", 'kind = "dflash2"\ndraft_vocab_size = 0\nconv_kernel_size = 9', "drafter.conv_kernel_size",
     "9 taps exceed drafter.block_size 8"),
    ("drafter", "selector_top_k = 8", "drafter.selector_top_k", 'it applies to drafter.kind = "dflash2" only'),
    ("train", "selector_stop_gradient = true", "train.selector_stop_gradient", 'applies to drafter.kind = "dflash2"'),
    ("drafter", 'kind = "dflash2"\ndraft_vocab_size = 0', "eval.serve_engine", "vLLM's CPU build cannot serve a DFlash 2"),
    ("train", 'loss = "distill"', "train.feature_cache", "set train.feature_cache = false"),
    ("train", "dpace_alpha = 0.3", "train.dpace_alpha", 'it applies to train.loss = "dpace" only'),
])
def test_cross_field_rules_name_the_key(cli, tmp_path, section, lines, key, problem):
    profile = bad_profile(tmp_path, section, lines)
    result = cli("plan", "--profile", profile)
    assert result.code == 2 and f"key '{key}'" in result.err and problem in result.err


def _numeric(hint: typing.Any) -> bool:
    args = [a for a in typing.get_args(hint) if a not in (type(None), Ellipsis)]
    return hint in (int, float) or (bool(args) and all(_numeric(a) for a in args))


def _numeric_keys() -> dict[str, typing.Any]:
    keys = {}
    for section in dataclasses.fields(schema.Profile):
        cls = typing.get_type_hints(schema.Profile)[section.name]
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            keys.update({f"{section.name}.{f.name}": f for f in dataclasses.fields(cls) if _numeric(hints[f.name])})
    return keys


def test_every_numeric_key_declares_its_range_and_no_other_key_one():
    numeric = _numeric_keys()
    assert len(numeric) > 80 and set(numeric) <= set(schema.KEYS)
    missing = sorted(key for key in numeric if not isinstance(schema.KEYS[key].metadata.get("valid"), schema.Range))
    assert missing == [], "declare the key with key(default, meaning, valid=Range(...)) in launcher_core/schema.py"
    assert sorted(set(schema.RANGES) - set(numeric)) == [], "a range on a key that is not a number is never checked"
    assert schema.RANGES == {key: schema.KEYS[key].metadata["valid"] for key in numeric}


def test_every_key_says_what_it_means():
    fields = [*schema.KEYS.items(), *((f.name, f) for f in dataclasses.fields(schema.Profile))]
    assert [name for name, spec in fields if len(spec.metadata.get("meaning", "")) < 3] == []


def test_every_rule_names_real_keys_and_says_what_it_holds():
    from dflash.train.supervisor.launch_checks import LAUNCH_CHECKS

    for rule in [*schema.CROSS_FIELD_RULES, *LAUNCH_CHECKS]:
        assert rule.keys and set(rule.keys) <= set(schema.KEYS), (rule.name, rule.keys)
        assert rule.description and "\n" not in rule.description, rule.name
    assert len({rule.name for rule in schema.CROSS_FIELD_RULES}) == len(schema.CROSS_FIELD_RULES)
    assert len({check.name for check in LAUNCH_CHECKS}) == len(LAUNCH_CHECKS)


def test_every_default_is_in_its_range():
    for key, spec in _numeric_keys().items():
        default = spec.default
        for value in default if isinstance(default, tuple) else (default,):
            if value is not None:
                assert schema.RANGES[key].admits(value), (key, value)


def test_every_shipped_profile_passes_the_rules():
    from launcher_core.profile import list_profiles, load_profile

    for name in list_profiles():
        load_profile(name)


def test_no_plan_line_grows_with_the_largest_global_batch(cli, tmp_path):
    """global_batch at its bound: the plan still answers in a few lines of bounded length (it used
    to list every micro-batch: a 10 MB "2+2+..." line at 2e7, a MemoryError at 1e12)."""
    profile = bad_profile(tmp_path, "train", f"global_batch = {schema.RANGES['train.global_batch'].high:.0f}")
    result = cli("plan", "--profile", profile)
    assert result.code == 0, result.err
    assert "2 ranks x 131072 micro-batches (4 x 131,072)" in result.out
    assert max(map(len, result.out.splitlines())) < 300 and len(result.out) < 20_000
    as_json = cli("plan", "--profile", profile, "--json")
    document = json.loads(as_json.out)["plan"]
    assert document["micro_batch_sizes"] is None and len(as_json.out) < 50_000
    assert document["micro_batch_split"] == {"micro_batch": 4, "full": 131072, "last": 0}
    few = cli("plan", "--profile", bad_profile(tmp_path, "train", "global_batch = 10"))
    assert "2 ranks x 2 micro-batches (4+1)" in few.out                     # a few are still listed


def test_a_global_batch_above_the_datasets_rows_is_refused_before_torchrun(cli, tmp_path, tiny_qwen3_target):
    from tests.train.conftest import write_dataset, write_profile

    profile = write_profile(tmp_path / "p.toml", tiny_qwen3_target, write_dataset(tmp_path / "data", rows=6),
                            tmp_path / "run", global_batch=8)
    result = cli("train", "--profile", profile, "--print-command")
    assert result.code == 2, result.err
    assert f"key 'train.global_batch': 8 rows per optimizer step, but the dataset {tmp_path / 'data'} has 6" in result.err
    control = cli("train", "--profile", write_profile(tmp_path / "q.toml", tiny_qwen3_target, tmp_path / "data",
                                                      tmp_path / "run", global_batch=6), "--print-command")
    assert control.code == 0, control.err
