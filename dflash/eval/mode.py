"""The mode eval renders its prompts in (thinking on or off, the chat template), held against the mode
the drafter's training data was rendered in (the `rendering` block of the dataset's dflash_meta.json,
dflash.data.rendering_record). A drafter trained on thinking-off text and asked thinking on (or the reverse)
loses most of its acceptance, so a mismatch is refused (ConfigError, exit 2, both sides named) unless
`--allow-mode-mismatch` asks to measure it; the report then says "mode mismatch (on purpose)".

The training data: the record the drafter carries of it (`training_data.json` in its checkpoint or export,
written when it was trained: dflash.data.rendering_record.TrainingDataRecord), else `paths.dataset` of the profile it
was trained with (the run's `train/profile.json` beside its checkpoints), else `paths.dataset` of the eval's
profile. A dataset written before the block (or none at all) is not compared: a one-line note says so; a damaged
meta or record is an InputError (exit 2) naming the file and field.

Data of both modes (`thinking = "mixed"`) is compared per record share: eval's mode is refused only where no
record of the data was rendered in it, and otherwise accepted with its share stated.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dflash.data.rendering_record import RenderingBlock, chat_template_fingerprint, short_fingerprint, thinking_share
from launcher_core.errors import ConfigError, InputError
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dflash.eval.options import EvalOptions

ALLOW_FLAG = "--allow-mode-mismatch"
PROBE = [{"role": "user", "content": "Hi"}]


@dataclass(frozen=True)
class TrainingData:
    """The dataset the drafter was trained with, where eval found it, and its rendering block."""

    meta_path: Path
    found_by: str                       # "paths.dataset in RUN/train/profile.json (the drafter's training run)"
    block: Optional[RenderingBlock]     # None: no such file, or written before the block
    carried: Optional[Path] = None      # the drafter's own record (training_data.json) it came from

    def label(self) -> str:
        """The meta, and the drafter's record when the block came from it."""
        return f"{self.meta_path} (as {self.carried} records it)" if self.carried else str(self.meta_path)

    def note(self) -> str:
        if self.carried is not None:
            return (f"{self.carried} records no rendering of its training data ({self.meta_path} was missing or "
                    f"written before the record when it trained): the data's mode is not known and not compared")
        if not self.meta_path.is_file():
            return f"no training data to compare with: {self.meta_path} does not exist ({self.found_by})"
        return (f"{self.meta_path} predates the rendering record (re-run tokenize to write it): the data's mode "
                f"is not known and not compared")


@dataclass(frozen=True)
class RenderMode:
    """How eval renders its prompts, and the training data's mode it was held against."""

    thinking: bool
    asked_by: str                       # "--thinking" or "generate.thinking of profile NAME"
    template_fingerprint: str
    template_renders_thinking: bool     # False: the template renders a prompt alike in both modes
    data: Optional[TrainingData]
    differences: tuple[str, ...] = ()   # what differs from the data (only with --allow-mode-mismatch)

    def describe(self) -> str:
        """One line for the report: the mode, where it came from, and the data's."""
        alike = "" if self.template_renders_thinking else "; this chat template renders both modes alike"
        line = (f"thinking {'on' if self.thinking else 'off'} ({self.asked_by}{alike}), "
                f"chat template {short_fingerprint(self.template_fingerprint)}")
        if self.data is None or self.data.block is None:
            return f"{line}; {self.data.note() if self.data else 'no training data to compare with'}"
        block = self.data.block
        agrees = "differs from" if self.differences else "matches"
        return (f"{line}; {agrees} the training data's (thinking {block['thinking']}{self._share(block)}, chat "
                f"template {short_fingerprint(block['chat_template_fingerprint'])}: {self.data.label()})")

    def _share(self, block: RenderingBlock) -> str:
        """`: 10% of its records (5 of 52) were rendered thinking off, as eval renders` for mixed data."""
        share = thinking_share(block, self.thinking)
        if block["thinking"] != "mixed" or share is None:
            return ""
        mode = "on" if self.thinking else "off"
        count, total = block["records_by_thinking"].get(mode, 0), sum(block["records_by_thinking"].values())
        return f": {share:.0%} of its records ({count} of {total}) were rendered thinking {mode}, as eval renders"

    @property
    def mismatch(self) -> Optional[str]:
        """What the report marks: None when the prompts render as the training data's did."""
        if not self.differences:
            return None
        return f"mode mismatch (on purpose, {ALLOW_FLAG}): " + "; ".join(self.differences)


def resolve_render_mode(profile: Profile, checkpoint: Path, tokenizer: PreTrainedTokenizerBase,
                        thinking: Optional[bool], allow_mismatch: bool) -> RenderMode:
    """`--thinking` (else `generate.thinking`) against the training data's mode; ConfigError on a
    mismatch unless `allow_mismatch`."""
    asked_by = "--thinking" if thinking is not None else f"generate.thinking of profile {profile.name}"
    mode = RenderMode(thinking=profile.generate.thinking if thinking is None else thinking, asked_by=asked_by,
                      template_fingerprint=chat_template_fingerprint(tokenizer),
                      template_renders_thinking=renders_thinking(tokenizer),
                      data=training_data(profile, checkpoint))
    differences = mode_differences(mode, profile)
    if differences and not allow_mismatch:
        raise ConfigError("eval would render its prompts otherwise than the drafter's training data: "
                          + "; ".join(differences) + ". A drafter asked in another mode than it was trained in "
                          f"loses most of its acceptance: evaluate in the data's mode, or pass {ALLOW_FLAG} to "
                          "measure the mismatch on purpose")
    return replace(mode, differences=tuple(differences))


def render_mode_for(profile: Profile, checkpoint: Path, options: EvalOptions) -> RenderMode:
    """`resolve_render_mode` with the profile's tokenizer and the eval's `--thinking` / `--allow-mode-mismatch`."""
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for

    return resolve_render_mode(profile, checkpoint, load_tokenizer(tokenizer_dir_for(profile)), options.thinking,
                               options.allow_mode_mismatch)


def mode_differences(mode: RenderMode, profile: Profile) -> list[str]:
    """Each difference from the training data's rendering, both sides named."""
    if mode.data is None or mode.data.block is None:
        return []
    block, meta = mode.data.block, mode.data.label()
    found = []
    if not thinking_in_data(block, mode.thinking) and mode.template_renders_thinking:
        found.append(f"thinking: data {meta} rendering.thinking = \"{block['thinking']}\", eval {mode.asked_by} = "
                     f"{'on' if mode.thinking else 'off'}")
    if block["chat_template_fingerprint"] != mode.template_fingerprint:
        from dflash.tokenizer import tokenizer_dir_for

        key = "model.tokenizer" if profile.model.tokenizer else "model.target"
        found.append(f"chat template: data {meta} rendering.chat_template_fingerprint = "
                     f"{short_fingerprint(block['chat_template_fingerprint'])}, eval {key} of profile {profile.name} "
                     f"({tokenizer_dir_for(profile)}) = {short_fingerprint(mode.template_fingerprint)}")
    return found


def thinking_in_data(block: RenderingBlock, thinking: bool) -> bool:
    """Whether any record of the data was rendered with `thinking` (a share above 0; a block that counts no
    records: its mode)."""
    share = thinking_share(block, thinking)
    if share is None:
        return block["thinking"] in ("mixed", "on" if thinking else "off")
    return share > 0


def renders_thinking(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template renders a generation prompt differently with thinking on and off
    (a template that refuses the one-message probe is taken to)."""
    def render(thinking: bool) -> str:
        return str(tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=thinking))
    try:
        return render(True) != render(False)
    except Exception:    # jinja TemplateError, raise_exception(...) in a template: compare the modes as they are
        return True


def training_data(profile: Profile, checkpoint: Path) -> TrainingData:
    """The record the drafter carries of its training data, else the dataset of its training run (its
    `train/profile.json`), else the profile's. InputError naming the file and field when the record or the
    dataset's meta is damaged."""
    from dflash.data.dataset_io import META_NAME
    from dflash.data.rendering_record import read_rendering, read_training_data_record
    from dflash.drafter.checkpoint_files import TRAINING_DATA, resolve_checkpoint_dir
    from launcher_core.profile import expand_path

    carried = resolve_checkpoint_dir(Path(checkpoint)) / TRAINING_DATA
    if carried.is_file():
        record = read_training_data_record(carried)
        return TrainingData(Path(record["meta"]), f"{carried}, the record the drafter carries of its training data",
                            record["rendering"], carried)
    recorded = trained_dataset(checkpoint)
    if recorded is not None:
        path, found_by = recorded
    else:
        path, found_by = expand_path(profile, profile.paths.dataset), f"paths.dataset of profile {profile.name}"
    return TrainingData(path / META_NAME, found_by, read_rendering(path / META_NAME))


def trained_dataset(checkpoint: Path) -> Optional[tuple[Path, str]]:
    """The dataset a training run read: `paths.dataset` of the resolved profile it wrote
    (RUN/train/profile.json) expanded as the trainer expanded it, else (the run was moved) with
    `{run_dir}` as the run's directory now. None when the checkpoint is not in a run's
    train/checkpoints/, the run wrote no profile, or neither path holds a dataset."""
    from dflash.data.dataset_io import META_NAME
    from dflash.drafter.checkpoint_files import resolve_checkpoint_dir
    from launcher_core.fileio import read_json_object

    step = resolve_checkpoint_dir(Path(checkpoint))
    recorded = step.parent.parent / "profile.json"
    if step.parent.name != "checkpoints" or step.parent.parent.name != "train" or not recorded.is_file():
        return None
    try:
        document = read_json_object(recorded, "a training run's resolved profile")
    except InputError:
        return None
    paths = document.get("paths")
    paths = paths if isinstance(paths, dict) else {}
    name, template, run_dir = str(document.get("name", "")), paths.get("dataset"), paths.get("run_dir")
    if not isinstance(template, str) or not isinstance(run_dir, str):
        return None
    try:
        trained_run_dir = run_dir.format(profile=name)
    except (KeyError, ValueError, IndexError):
        return None
    candidates = [_expanded(template, name, trained_run_dir), _expanded(template, name, str(step.parents[2]))]
    found = next((path for path in candidates if path is not None and (path / META_NAME).is_file()), None)
    return None if found is None else (found, f"paths.dataset in {recorded} (the drafter's training run)")


def _expanded(template: str, name: str, run_dir: str) -> Optional[Path]:
    """A profile path as launcher_core.profile.expand_path expands it; None for a placeholder it does not know."""
    from launcher_core.paths import REPO_ROOT

    try:
        path = Path(template.format(profile=name, run_dir=run_dir)).expanduser()
    except (KeyError, ValueError, IndexError):
        return None
    return path if path.is_absolute() else REPO_ROOT / path
