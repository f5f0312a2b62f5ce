"""Launch-time checks of a profile against its target: every mistake a training rank would find
only after loading the target (exit 5, minutes and ~54 GB per rank in) is found before torchrun
starts (ConfigError, exit 2), naming the profile file and the key to change.

Reads the target's config.json and tokenizer files, never its weights. The rules that need no
target (ranges, divisibility, heads) are the schema's (launcher_core.schema RANGES and
cross_field_problems), checked when the profile loads; these are the ones that need the target.
Each is checked here only: the rank-side code that relies on it keeps at most an internal assert.

| key | rule | relied on by |
|---|---|---|
| train.decay_gamma | > 0 unless the block size has a default (8, 10, 16) | decay.default_gamma |
| drafter.target_layer_ids | inside the target's layers; or the default spacing fits the target | resolve_layer_ids |
| drafter.mask_token_id | set, or the tokenizer has a mask token; a row of the target's embedding | resolve_mask_token_id |
| drafter.init | "target": the source layers are plain softmax attention | init_from_target |
| drafter.draft_vocab_size | 0, or 1 .. the target's vocabulary | draft vocabulary |
| drafter.layer_types, sliding_window, rope_scaling* | one known type per layer; a window >= 1 for sliding layers; a scaling factor > 1 | drafter config |
| drafter.init_from | init = "drafter": a DFlash drafter directory (config.json + weights) | init_from_drafter |
| drafter.conv_group_size, selector_top_k | kind = "dflash2": groups divide the target's hidden size; top K within its vocabulary | DFlash2Drafter |
| train.global_batch | at most the dataset's rows (when the dataset exists) | TrainData |
| data.max_length | some row of the dataset, cut to it, holds an anchor (when the dataset exists) | dflash.train.loss_check |
| paths.dataset | a dataset directory is there (`train`: `require_dataset`, before the audit) | TrainData |

`drafter.init_from` is also held against the drafter the profile builds (tensor shapes, tap
layers) before torchrun starts, by dflash.train.resume (it builds the drafter on the meta device,
so it imports torch: it runs in `train` after the plan is printed, not here).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher_core.errors import ConfigError, DataError
from launcher_core.schema import Profile

# A padding row past the added tokens, by embedding size (mask token ids the data never uses).
SUGGESTED_MASK_IDS = {151936: 151669, 248320: 248070}


@dataclass(frozen=True)
class TargetFacts:
    """What the checks need from a target directory's config.json."""

    path: Path
    vocab_rows: int
    num_layers: int
    config: dict[str, object]       # config.json, parsed


@dataclass(frozen=True)
class LaunchFacts:
    """What the ranks will resolve: tap layers, mask token, loss decay (for the launch log)."""

    target: TargetFacts
    layer_ids: list[int]
    mask_token_id: int
    decay_gamma: float


def read_target_facts(profile: Profile) -> TargetFacts:
    """model.target's config.json (a builtin target is built or converted first, as the ranks would)."""
    from dflash.models import resolve_model_path, text_config_dict

    path = resolve_model_path(profile.model.target)
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{config_path}: cannot read the target's config ({error}); "
                          f"model.target must be a model directory with a config.json") from None
    text = text_config_dict(config)
    if "vocab_size" not in text or "num_hidden_layers" not in text:
        raise ConfigError(f"{config_path}: no vocab_size / num_hidden_layers; not a causal LM config")
    return TargetFacts(path=path, vocab_rows=int(text["vocab_size"]), num_layers=int(text["num_hidden_layers"]),
                       config=config)


def validate_profile_for_launch(profile: Profile, source: Optional[str] = None) -> LaunchFacts:
    """Check the profile against its target; ConfigError listing every problem, each as
    `FILE: key 'section.key': what is wrong and what to set`. `source`: the --profile argument
    (name or TOML path) the profile was loaded from, default its name."""
    where = _KeyFiles(profile, source)
    target = read_target_facts(profile)
    problems: list[str] = []
    gamma = _check_sizes(profile, where, problems)
    layer_ids = _check_layer_ids(profile, target, where, problems)
    mask_id = _check_mask_token(profile, target, where, problems)
    if layer_ids and profile.drafter.init == "target":
        _check_target_init(profile, target, layer_ids, where, problems)
    _check_draft_vocab(profile, target, where, problems)
    _check_drafter_layers(profile, where, problems)
    _check_drafter_init(profile, where, problems)
    _check_dflash2(profile, target, where, problems)
    _check_dataset_rows(profile, where, problems)
    _check_supervision(profile, where, problems)
    if problems:
        raise ConfigError(f"profile {profile.name} does not fit its target {target.path} "
                          f"({len(problems)} problem(s)):\n" + "\n".join(f"  {p}" for p in problems))
    return LaunchFacts(target=target, layer_ids=layer_ids, mask_token_id=int(mask_id), decay_gamma=gamma)


class _KeyFiles:
    """Which file to name for a key: the one along the `extends` chain that sets it, else the
    profile's own file (where the missing setting belongs)."""

    def __init__(self, profile: Profile, source: Optional[str]):
        from launcher_core.profile import key_origins

        try:
            self.own, self.origin = key_origins(source or profile.name)
        except ConfigError:
            self.own, self.origin = Path(f"profile {profile.name}"), {}

    def __call__(self, dotted: str, problem: str) -> str:
        return f"{self.origin.get(dotted, self.own)}: key '{dotted}': {problem}"


def _check_sizes(profile: Profile, where: _KeyFiles, problems: list[str]) -> float:
    from dflash.drafter.decay import DEFAULT_GAMMA, default_gamma, has_default_gamma

    block_size = profile.drafter.block_size
    if profile.train.decay_gamma > 0 or has_default_gamma(block_size):
        return default_gamma(block_size, profile.train.decay_gamma)
    problems.append(where("train.decay_gamma", f"unset, and no default loss decay for block size {block_size} "
                          f"(defaults exist for {sorted(DEFAULT_GAMMA)}); set train.decay_gamma in the profile"))
    return 0.0


def _check_layer_ids(profile: Profile, target: TargetFacts, where: _KeyFiles, problems: list[str]) -> list[int]:
    from dflash.drafter.taps import MIN_SPACED_TARGET_LAYERS, default_target_layer_ids

    count, taps = target.num_layers, profile.drafter.num_layers
    if profile.drafter.target_layer_ids:
        ids = list(profile.drafter.target_layer_ids)
        bad = [k for k in ids if not 0 <= k < count]
        if bad:
            problems.append(where("drafter.target_layer_ids", f"{bad} outside the target's layers 0..{count - 1} "
                                  f"({target.path.name}: {count} layers)"))
            return []
        return ids
    if taps > 1 and count < MIN_SPACED_TARGET_LAYERS:
        problems.append(where("drafter.num_layers", f"a target with {count} layers is too shallow for {taps} tap "
                              f"layers; set drafter.target_layer_ids or fewer draft layers"))
        return []
    return default_target_layer_ids(count, taps)


def _check_mask_token(profile: Profile, target: TargetFacts, where: _KeyFiles, problems: list[str]) -> int:
    mask_id = profile.drafter.mask_token_id
    suggestion = SUGGESTED_MASK_IDS.get(target.vocab_rows)
    hint = f" (for this {target.vocab_rows:,}-row vocabulary: {suggestion}, a row past the added tokens)" if suggestion else ""
    if mask_id is None:
        tokenizer_dir = _tokenizer_dir(profile, target)
        mask_id = tokenizer_mask_token_id(tokenizer_dir)
        if mask_id is None:
            problems.append(where("drafter.mask_token_id", f"unset, and the tokenizer in {tokenizer_dir} has no mask "
                                  f"token; set it to an embedding row the data never uses{hint}"))
            return -1
    if not 0 <= mask_id < target.vocab_rows:
        problems.append(where("drafter.mask_token_id", f"{mask_id} is not a row of the target's embedding "
                              f"(0..{target.vocab_rows - 1}){hint}"))
    return mask_id


def _check_target_init(profile: Profile, target: TargetFacts, layer_ids: list[int], where: _KeyFiles,
                       problems: list[str]) -> None:
    from dflash.drafter.taps import source_layer_ids, unholdable_sources

    sources = source_layer_ids(layer_ids, profile.drafter.num_layers, target.num_layers)
    problem = unholdable_sources(sources, target.config)
    if problem:
        problems.append(where("drafter.init", f"\"target\": {problem}"))


def _check_draft_vocab(profile: Profile, target: TargetFacts, where: _KeyFiles, problems: list[str]) -> None:
    size = profile.drafter.draft_vocab_size
    if not 0 <= size <= target.vocab_rows:
        problems.append(where("drafter.draft_vocab_size", f"{size}; must be 0 (the whole vocabulary) or "
                              f"1..{target.vocab_rows} (the target's vocabulary)"))


def _check_drafter_layers(profile: Profile, where: _KeyFiles, problems: list[str]) -> None:
    from dflash.drafter.layers import profile_layer_problems

    problems.extend(where(key, problem) for key, problem in profile_layer_problems(profile.drafter))


def _check_drafter_init(profile: Profile, where: _KeyFiles, problems: list[str]) -> None:
    """init = "drafter" needs init_from naming a DFlash drafter directory; init_from alone does nothing."""
    from dflash.drafter.checkpoint import init_source_problem

    drafter = profile.drafter
    if drafter.init != "drafter":
        if drafter.init_from:
            problems.append(where("drafter.init_from", f"{drafter.init_from!r} is set but drafter.init is "
                                  f"{drafter.init!r}; set drafter.init = \"drafter\" to start from it"))
        return
    if not drafter.init_from:
        problems.append(where("drafter.init_from", "unset; drafter.init = \"drafter\" needs the directory of a DFlash "
                              "drafter (a published z-lab-format one, or a checkpoint step-N/)"))
        return
    problem = init_source_problem(Path(drafter.init_from))
    if problem:
        problems.append(where("drafter.init_from", problem))


def _check_dflash2(profile: Profile, target: TargetFacts, where: _KeyFiles, problems: list[str]) -> None:
    """The convolution's channel groups tile the target's hidden size; the selector's K fits its vocabulary."""
    from dflash.models import text_config_dict

    drafter = profile.drafter
    if drafter.kind != "dflash2":
        return
    hidden = int(text_config_dict(target.config).get("hidden_size") or 0)
    if hidden and hidden % drafter.conv_group_size:
        divisors = [g for g in (8, 16, 32, 64, 128) if hidden % g == 0]
        problems.append(where("drafter.conv_group_size", f"{drafter.conv_group_size} does not divide the target's "
                              f"hidden size {hidden} (channels are grouped; e.g. {divisors or [1]})"))
    if drafter.selector_top_k > target.vocab_rows:
        problems.append(where("drafter.selector_top_k", f"{drafter.selector_top_k} exceeds the target's vocabulary "
                              f"({target.vocab_rows}); valid: 1..{target.vocab_rows}"))


def _check_dataset_rows(profile: Profile, where: _KeyFiles, problems: list[str]) -> None:
    """train.global_batch rows per optimizer step: the dataset must have them (when it exists yet;
    its dflash_meta.json says how many rows it has)."""
    from launcher_core.profile import expand_path

    dataset = expand_path(profile, profile.paths.dataset)
    rows = dataset_rows(dataset)
    if rows is not None and rows < profile.train.global_batch:
        problems.append(where("train.global_batch", f"{profile.train.global_batch} rows per optimizer step, but the "
                              f"dataset {dataset} has {rows:,}; set it to at most {rows:,} (divisible by the ranks)"))


def _check_supervision(profile: Profile, where: _KeyFiles, problems: list[str]) -> None:
    """A block starts at an anchor (two consecutive trained tokens) inside the row as data.max_length cuts
    it: a dataset where no row holds one trains on nothing (every step's loss weight 0). The profile's
    data.max_length is the problem when some row holds one further on (exit 2); the data, when none does
    (DataError, exit 4). The rows are read until the first that holds an anchor (the first, in a usable dataset)."""
    from launcher_core.profile import expand_path

    dataset = expand_path(profile, profile.paths.dataset)
    found = anchors_within(dataset, profile.data.max_length)
    if found is None or found.usable:
        return
    if found.earliest is None:
        raise DataError(f"{dataset}: none of its {found.rows:,} rows has two consecutive trained tokens (loss_mask), "
                        f"where a training block starts: every step would train on nothing. Tokenize it again "
                        f"(data.min_loss_tokens drops such rows)")
    from dflash.data.dataset_io import META_NAME

    tokenized = _read_json(dataset / META_NAME).get("max_length")
    at = f" ({tokenized:,} in its {META_NAME})" if isinstance(tokenized, int) else ""
    problems.append(where("data.max_length", f"{profile.data.max_length} cuts every row of the dataset {dataset} "
                          f"({found.rows:,} rows of up to {found.longest:,} tokens) before its first two consecutive "
                          f"trained tokens (the earliest at position {found.earliest}), where a training block "
                          f"starts: every step would train on nothing; set it to the length the dataset was "
                          f"tokenized at{at}, at least {found.earliest + 2}"))


SCAN_ROWS = 256      # rows scanned at once: a bounded slice of a record batch, whatever its size


@dataclass(frozen=True)
class AnchorScan:
    """What the rows of a dataset hold at a given max_length: whether one row has an anchor inside it
    (`usable`; the scan stops there), else the rows read, the longest, and the earliest anchor past it."""

    usable: bool
    rows: int = 0
    longest: int = 0
    earliest: Optional[int] = None


def anchors_within(dataset: Path, max_length: int) -> Optional[AnchorScan]:
    """Scan the loss masks of the dataset's Arrow files (memory-mapped) batch by batch; None when the
    dataset is not there (yet) or cannot be read (the ranks' loader then names the problem)."""
    files = [str(entry["filename"]) for entry in _read_json(dataset / "state.json").get("_data_files") or []
             if isinstance(entry, dict) and entry.get("filename")]
    if not files:
        return None
    import pyarrow as pa

    scan = AnchorScan(usable=False)
    try:
        for name in files:
            for batch in pa.ipc.open_stream(pa.memory_map(str(dataset / name))):
                if "loss_mask" not in batch.schema.names:
                    return None
                masks = batch.column("loss_mask")
                for start in range(0, len(masks), SCAN_ROWS):
                    scan = _scan_rows(masks.slice(start, SCAN_ROWS), max_length, scan)
                    if scan.usable:
                        return scan
    except (OSError, TypeError, pa.ArrowException):
        return None
    return scan


def _scan_rows(masks: Any, max_length: int, before: AnchorScan) -> AnchorScan:
    """Rows of list<uint8> loss masks (a slice of a record batch), vectorised: per row, the anchors
    (mask[i] and mask[i + 1]) inside its first `max_length` tokens, and its first anchor anywhere."""
    import numpy as np

    offsets = np.asarray(masks.offsets.to_numpy(), dtype=np.int64)
    offsets -= offsets[0]                            # a slice's offsets point into the whole batch's values
    values = np.asarray(masks.flatten().to_numpy(zero_copy_only=False), dtype=bool)
    pair = np.zeros(len(values), dtype=bool)         # an anchor at i: mask[i] and mask[i + 1]
    pair[:-1] = values[:-1] & values[1:]
    pairs = np.concatenate([[0], np.cumsum(pair)])   # anchors before each position
    starts, ends = offsets[:-1], offsets[1:]
    cut = np.maximum(np.minimum(ends, starts + max_length) - 1, starts)
    if np.any(pairs[cut] > pairs[starts]):
        return AnchorScan(usable=True)
    whole = np.maximum(ends - 1, starts)
    held = np.flatnonzero(pairs[whole] > pairs[starts])
    firsts = [int(np.searchsorted(pairs, pairs[starts[r]] + 1) - 1 - starts[r]) for r in held[:1000]]
    earliest = min([*firsts, *([before.earliest] if before.earliest is not None else [])], default=None)
    longest = max(before.longest, int((ends - starts).max(initial=0)))
    return AnchorScan(usable=False, rows=before.rows + len(starts), longest=longest, earliest=earliest)


def require_dataset(profile: Profile, source: Optional[str] = None) -> Path:
    """The training dataset (paths.dataset) as the ranks will open it; InputError (exit 2) naming the path and
    the command that writes it when it is not there, before any audit, torchrun or model load. A directory
    that is there but damaged is the ranks' to name (dflash.train.data.verify_dataset)."""
    from dflash.data.dataset_io import META_NAME
    from launcher_core.errors import InputError
    from launcher_core.profile import expand_path

    dataset = expand_path(profile, profile.paths.dataset)
    tokenize = f"`launcher.py tokenize --profile {source or profile.name}`"
    if not dataset.exists():
        raise InputError(f"{dataset}: no training dataset there (paths.dataset of profile {profile.name}); run "
                         f"{tokenize} first, or `launcher.py pipeline --profile {source or profile.name}`, which "
                         "generates and tokenizes before it trains")
    if not dataset.is_dir() or not ((dataset / META_NAME).is_file() or (dataset / "state.json").is_file()):
        raise InputError(f"{dataset}: not a dataset (paths.dataset of profile {profile.name}: a directory with "
                         f"{META_NAME} or state.json, as tokenize and merge write it); run {tokenize}, or set "
                         "paths.dataset to the dataset's directory")
    return dataset


def dataset_rows(dataset: Path) -> Optional[int]:
    """Rows of a dataset on disk: its dflash_meta.json (tokenize, merge), else the Arrow files its
    state.json names (any `datasets.save_to_disk` dataset, counted memory-mapped); None when it
    is not there (yet) or cannot be read (the ranks' loader then names the problem)."""
    from dflash.data.dataset_io import META_NAME

    rows = _read_json(dataset / META_NAME).get("rows")
    if isinstance(rows, int):
        return rows
    files = [str(entry["filename"]) for entry in _read_json(dataset / "state.json").get("_data_files") or []
             if isinstance(entry, dict) and entry.get("filename")]
    if not files:
        return None
    import pyarrow as pa

    try:
        return sum(batch.num_rows for name in files for batch in pa.ipc.open_stream(pa.memory_map(str(dataset / name))))
    except (OSError, TypeError, pa.ArrowException):
        return None


def _tokenizer_dir(profile: Profile, target: TargetFacts) -> Path:
    from dflash.models import resolve_model_path

    return resolve_model_path(profile.model.tokenizer) if profile.model.tokenizer else target.path


def tokenizer_mask_token_id(directory: Path) -> Optional[int]:
    """The tokenizer's mask token id from its files (tokenizer_config.json / special_tokens_map.json
    name it; tokenizer.json or added_tokens_decoder give its id); None when it has none."""
    config = _read_json(directory / "tokenizer_config.json")
    content = _token_content(config.get("mask_token")) or _token_content(
        _read_json(directory / "special_tokens_map.json").get("mask_token"))
    if not content:
        return None
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        if _token_content(entry) == content:
            return int(token_id)
    tokenizer = _read_json(directory / "tokenizer.json")
    for entry in tokenizer.get("added_tokens") or []:
        if entry.get("content") == content:
            return int(entry["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return int(vocab[content]) if isinstance(vocab, dict) and content in vocab else None


def _token_content(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content") or "")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}
