"""Launch-time checks of a profile against its target: every mistake a training rank would find
only after loading the target (exit 5, minutes and ~54 GB per rank in) is found before torchrun
starts (ConfigError, exit 2), naming the profile file and the key to change.

Reads the target's config.json and tokenizer files, never its weights. The rules that need no
target (ranges, divisibility, heads) are the schema's (launcher_core.schema: each key's `valid`
range and the `@cross_field_rule`s), checked when the profile loads; these are the ones that need
the target (or the dataset), declared once in `LAUNCH_CHECKS` (name, keys, rule: docs/profile-rules.md
is generated from it). Each is checked here only: the rank-side code that relies on it keeps at most
an internal assert.

`drafter.init_from` is also held against the drafter the profile builds (tensor shapes, tap
layers) before torchrun starts, by dflash.train.supervisor.resume (it builds the drafter on the meta device,
so it imports torch: it runs in `train` after the plan is printed, not here).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from launcher_core.errors import ConfigError, DataError
from launcher_core.fileio import json_object_or_empty
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
    from dflash.target_model import resolve_model_path, text_config_dict

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
    """Check the profile against its target (every check of `LAUNCH_CHECKS`, in order); ConfigError listing
    every problem, each as `FILE: key 'section.key': what is wrong and what to set`. `source`: the --profile
    argument (name or TOML path) the profile was loaded from, default its name."""
    where = _KeyFiles(profile, source)
    launch = _Launch(profile, read_target_facts(profile), where)
    for check in LAUNCH_CHECKS:
        check.run(launch)
    if launch.problems:
        raise ConfigError(f"profile {profile.name} does not fit its target {launch.target.path} "
                          f"({len(launch.problems)} problem(s)):\n" + "\n".join(f"  {p}" for p in launch.problems))
    return LaunchFacts(target=launch.target, layer_ids=launch.layer_ids, mask_token_id=int(launch.mask_id),
                       decay_gamma=launch.gamma)


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


@dataclass
class _Launch:
    """What the checks read (the profile, its target, where each key is set) and write: the problems
    found, and what the ranks will resolve (loss decay, tap layers, mask token id)."""

    profile: Profile
    target: TargetFacts
    where: _KeyFiles
    problems: list[str] = field(default_factory=list)
    gamma: float = 0.0
    layer_ids: list[int] = field(default_factory=list)
    mask_id: int = -1

    def problem(self, dotted: str, text: str) -> None:
        self.problems.append(self.where(dotted, text))


@dataclass(frozen=True)
class LaunchCheck:
    """One launch-time rule: `run(launch)` appends its problems (and what it resolves); `keys` it involves,
    the first the one it usually names; `description`: the rule, for docs/profile-rules.md."""

    name: str
    keys: tuple[str, ...]
    description: str
    run: Callable[[_Launch], None]


def _check_decay(launch: _Launch) -> None:
    from dflash.drafter.decay import DEFAULT_GAMMA, default_gamma, has_default_gamma

    block_size = launch.profile.drafter.block_size
    if launch.profile.train.decay_gamma > 0 or has_default_gamma(block_size):
        launch.gamma = default_gamma(block_size, launch.profile.train.decay_gamma)
        return
    launch.problem("train.decay_gamma", f"unset, and no default loss decay for block size {block_size} "
                   f"(defaults exist for {sorted(DEFAULT_GAMMA)}); set train.decay_gamma in the profile")


def _check_layer_ids(launch: _Launch) -> None:
    from dflash.drafter.taps import MIN_SPACED_TARGET_LAYERS, default_target_layer_ids

    target, count, taps = launch.target, launch.target.num_layers, launch.profile.drafter.num_layers
    if launch.profile.drafter.target_layer_ids:
        ids = list(launch.profile.drafter.target_layer_ids)
        bad = [k for k in ids if not 0 <= k < count]
        if bad:
            launch.problem("drafter.target_layer_ids", f"{bad} outside the target's layers 0..{count - 1} "
                           f"({target.path.name}: {count} layers)")
            return
        launch.layer_ids = ids
    elif taps > 1 and count < MIN_SPACED_TARGET_LAYERS:
        launch.problem("drafter.num_layers", f"a target with {count} layers is too shallow for {taps} tap "
                       f"layers; set drafter.target_layer_ids or fewer draft layers")
    else:
        launch.layer_ids = default_target_layer_ids(count, taps)


def _check_mask_token(launch: _Launch) -> None:
    from dflash.tokenizer import tokenizer_mask_token_id

    profile, target = launch.profile, launch.target
    mask_id = profile.drafter.mask_token_id
    suggestion = SUGGESTED_MASK_IDS.get(target.vocab_rows)
    hint = f" (for this {target.vocab_rows:,}-row vocabulary: {suggestion}, a row past the added tokens)" if suggestion else ""
    if mask_id is None:
        tokenizer_dir = _tokenizer_dir(profile, target)
        mask_id = tokenizer_mask_token_id(tokenizer_dir)
        if mask_id is None:
            launch.problem("drafter.mask_token_id", f"unset, and the tokenizer in {tokenizer_dir} has no mask "
                           f"token; set it to an embedding row the data never uses{hint}")
            return
    if not 0 <= mask_id < target.vocab_rows:
        launch.problem("drafter.mask_token_id", f"{mask_id} is not a row of the target's embedding "
                       f"(0..{target.vocab_rows - 1}){hint}")
    launch.mask_id = mask_id


def _check_target_init(launch: _Launch) -> None:
    from dflash.drafter.taps import source_layer_ids, unholdable_sources

    if not launch.layer_ids or launch.profile.drafter.init != "target":
        return
    sources = source_layer_ids(launch.layer_ids, launch.profile.drafter.num_layers, launch.target.num_layers)
    problem = unholdable_sources(sources, launch.target.config)
    if problem:
        launch.problem("drafter.init", f"\"target\": {problem}")


def _check_draft_vocab(launch: _Launch) -> None:
    size, rows = launch.profile.drafter.draft_vocab_size, launch.target.vocab_rows
    if not 0 <= size <= rows:
        launch.problem("drafter.draft_vocab_size", f"{size}; must be 0 (the whole vocabulary) or "
                       f"1..{rows} (the target's vocabulary)")


def _check_drafter_layers(launch: _Launch) -> None:
    from dflash.drafter.layers import profile_layer_problems

    for dotted, problem in profile_layer_problems(launch.profile.drafter):
        launch.problem(dotted, problem)


def _check_drafter_init(launch: _Launch) -> None:
    """init = "drafter" needs init_from naming a DFlash drafter directory; init_from alone does nothing."""
    from dflash.drafter.checkpoint_files import init_source_problem

    drafter = launch.profile.drafter
    if drafter.init != "drafter":
        if drafter.init_from:
            launch.problem("drafter.init_from", f"{drafter.init_from!r} is set but drafter.init is "
                           f"{drafter.init!r}; set drafter.init = \"drafter\" to start from it")
        return
    if not drafter.init_from:
        launch.problem("drafter.init_from", "unset; drafter.init = \"drafter\" needs the directory of a DFlash "
                       "drafter (a published z-lab-format one, or a checkpoint step-N/)")
        return
    problem = init_source_problem(Path(drafter.init_from))
    if problem:
        launch.problem("drafter.init_from", problem)


def _check_dflash2(launch: _Launch) -> None:
    """The convolution's channel groups tile the target's hidden size; the selector's K fits its vocabulary."""
    from dflash.target_model import text_config_dict

    drafter, target = launch.profile.drafter, launch.target
    if drafter.kind != "dflash2":
        return
    hidden = int(text_config_dict(target.config).get("hidden_size") or 0)
    if hidden and hidden % drafter.conv_group_size:
        divisors = [g for g in (8, 16, 32, 64, 128) if hidden % g == 0]
        launch.problem("drafter.conv_group_size", f"{drafter.conv_group_size} does not divide the target's "
                       f"hidden size {hidden} (channels are grouped; e.g. {divisors or [1]})")
    if drafter.selector_top_k > target.vocab_rows:
        launch.problem("drafter.selector_top_k", f"{drafter.selector_top_k} exceeds the target's vocabulary "
                       f"({target.vocab_rows}); valid: 1..{target.vocab_rows}")


def _check_dataset_rows(launch: _Launch) -> None:
    """train.global_batch rows per optimizer step: the dataset must have them (when it exists yet;
    its dflash_meta.json says how many rows it has)."""
    from launcher_core.profile import expand_path

    profile = launch.profile
    dataset = expand_path(profile, profile.paths.dataset)
    rows = dataset_rows(dataset)
    if rows is not None and rows < profile.train.global_batch:
        launch.problem("train.global_batch", f"{profile.train.global_batch} rows per optimizer step, but the "
                       f"dataset {dataset} has {rows:,}; set it to at most {rows:,} (divisible by the ranks)")


def _check_supervision(launch: _Launch) -> None:
    """A block starts at an anchor (two consecutive trained tokens) inside the row as data.max_length cuts
    it: a dataset where no row holds one trains on nothing (every step's loss weight 0). The profile's
    data.max_length is the problem when some row holds one further on (exit 2); the data, when none does
    (DataError, exit 4). The rows are read until the first that holds an anchor (the first, in a usable dataset)."""
    from launcher_core.profile import expand_path

    profile = launch.profile
    dataset = expand_path(profile, profile.paths.dataset)
    found = anchors_within(dataset, profile.data.max_length)
    if found is None or found.usable:
        return
    if found.earliest is None:
        raise DataError(f"{dataset}: none of its {found.rows:,} rows has two consecutive trained tokens (loss_mask), "
                        f"where a training block starts: every step would train on nothing. Tokenize it again "
                        f"(data.min_loss_tokens drops such rows)")
    from dflash.data.dataset_io import META_NAME

    tokenized = json_object_or_empty(dataset / META_NAME).get("max_length")
    at = f" ({tokenized:,} in its {META_NAME})" if isinstance(tokenized, int) else ""
    launch.problem("data.max_length", f"{profile.data.max_length} cuts every row of the dataset {dataset} "
                   f"({found.rows:,} rows of up to {found.longest:,} tokens) before its first two consecutive "
                   f"trained tokens (the earliest at position {found.earliest}), where a training block "
                   f"starts: every step would train on nothing; set it to the length the dataset was "
                   f"tokenized at{at}, at least {found.earliest + 2}")


# Every launch-time rule, in the order it is checked (docs/profile-rules.md, "Launch checks", is generated from it).
LAUNCH_CHECKS: tuple[LaunchCheck, ...] = (
    LaunchCheck("loss_decay", ("train.decay_gamma", "drafter.block_size"),
                "train.decay_gamma > 0 unless the block size has a default (8, 10, 16)", _check_decay),
    LaunchCheck("tap_layers", ("drafter.target_layer_ids", "drafter.num_layers"),
                "drafter.target_layer_ids inside the target's layers; unset: the default spacing fits the target",
                _check_layer_ids),
    LaunchCheck("mask_token", ("drafter.mask_token_id", "model.tokenizer"),
                "drafter.mask_token_id set, or the tokenizer has a mask token; a row of the target's embedding "
                "(the message suggests 248070 for the 248,320-row Qwen3.5/3.6 vocabulary, 151669 for Qwen3's)",
                _check_mask_token),
    LaunchCheck("target_init", ("drafter.init",),
                "drafter.init = \"target\" only where the source layers are plain softmax attention",
                _check_target_init),
    LaunchCheck("draft_vocabulary", ("drafter.draft_vocab_size",),
                "drafter.draft_vocab_size 0, or at most the target's vocabulary", _check_draft_vocab),
    LaunchCheck("drafter_layers", ("drafter.layer_types", "drafter.sliding_window", "drafter.rope_scaling",
                                   "drafter.rope_scaling_factor", "drafter.rope_original_max_position_embeddings"),
                "one layer type per layer; sliding layers need a window >= 1, a window needs a sliding layer; "
                "a scaling factor > 1 with rope_scaling; the original length only with \"yarn\"",
                _check_drafter_layers),
    LaunchCheck("drafter_init_from", ("drafter.init_from", "drafter.init"),
                "drafter.init = \"drafter\" needs drafter.init_from, a DFlash drafter directory (config.json + "
                "weights); init_from without it is an error", _check_drafter_init),
    LaunchCheck("dflash2_target", ("drafter.conv_group_size", "drafter.selector_top_k", "drafter.kind"),
                "drafter.kind = \"dflash2\": conv_group_size divides the target's hidden size, selector_top_k "
                "at most its vocabulary", _check_dflash2),
    LaunchCheck("dataset_rows", ("train.global_batch", "paths.dataset"),
                "train.global_batch at most the dataset's rows (when the dataset exists)", _check_dataset_rows),
    LaunchCheck("anchors_within_max_length", ("data.max_length", "paths.dataset"),
                "some row of the dataset, cut to data.max_length, holds two consecutive trained tokens (a block's "
                "anchor; when the dataset exists): rows are read until the first that does, and the message names the "
                "earliest such position, the length to set and the dataset's own tokenize length; no row at any "
                "length: the data's problem (DataError, exit 4)",
                _check_supervision),
)


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
    files = [str(entry["filename"]) for entry in json_object_or_empty(dataset / "state.json").get("_data_files") or []
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
    the command that writes it when it is not there, before any audit, torchrun or model load. A dataset that
    tokenize or merge wrote has its shards checked here too, sizes and sha256 against its dflash_meta.json
    (DataError, exit 4, naming the shard and the backup to restore: what `inspect` says), so a damaged shard
    stops the launch in one line; rank 0 checks them again at start (dflash.train.rank.data.verify_dataset)."""
    from dflash.data.dataset_io import META_NAME, read_meta, verify_shards
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
    if (dataset / META_NAME).is_file():
        verify_shards(dataset, read_meta(dataset), hashes=True)
    return dataset


def dataset_rows(dataset: Path) -> Optional[int]:
    """Rows of a dataset on disk: its dflash_meta.json (tokenize, merge), else the Arrow files its
    state.json names (any `datasets.save_to_disk` dataset, counted memory-mapped); None when it
    is not there (yet) or cannot be read (the ranks' loader then names the problem)."""
    from dflash.data.dataset_io import META_NAME

    rows = json_object_or_empty(dataset / META_NAME).get("rows")
    if isinstance(rows, int):
        return rows
    files = [str(entry["filename"]) for entry in json_object_or_empty(dataset / "state.json").get("_data_files") or []
             if isinstance(entry, dict) and entry.get("filename")]
    if not files:
        return None
    import pyarrow as pa

    try:
        return sum(batch.num_rows for name in files for batch in pa.ipc.open_stream(pa.memory_map(str(dataset / name))))
    except (OSError, TypeError, pa.ArrowException):
        return None


def planned_steps(profile: Profile) -> Optional[int]:
    """The steps a run of `profile` trains: train.max_steps, else train.epochs x its dataset's steps per epoch
    (training rows // train.global_batch, as the ranks count them); None when the dataset cannot be read."""
    from dflash.data.validation_split import held_out_count
    from launcher_core.profile import expand_path

    train = profile.train
    if train.max_steps:
        return train.max_steps
    rows = dataset_rows(expand_path(profile, profile.paths.dataset))
    if rows is None:
        return None
    return train.epochs * ((rows - held_out_count(rows, train.validation_share)) // train.global_batch)


def _tokenizer_dir(profile: Profile, target: TargetFacts) -> Path:
    from dflash.target_model import resolve_model_path

    return resolve_model_path(profile.model.tokenizer) if profile.model.tokenizer else target.path
