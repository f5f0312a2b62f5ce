"""The mode eval renders its prompts in (thinking on or off, the chat template), held against the mode
the drafter's training data was rendered in (the `rendering` block of the dataset's dflash_meta.json,
dflash.data.rendering). A drafter trained on thinking-off text and asked thinking on (or the reverse)
loses most of its acceptance, so a mismatch is refused (ConfigError, exit 2, both sides named) unless
`--allow-mode-mismatch` asks to measure it; the report then says "mode mismatch (on purpose)".

The training data: `paths.dataset` of the profile the drafter was trained with (the run's
`train/profile.json` beside its checkpoints), else `paths.dataset` of the eval's profile. A dataset
written before the block (or none at all) is not compared: a one-line note says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from dflash.data.rendering import RenderingBlock, chat_template_fingerprint, short_fingerprint
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

    def note(self) -> str:
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
        return (f"{line}; {agrees} the training data's (thinking {block['thinking']}, chat template "
                f"{short_fingerprint(block['chat_template_fingerprint'])}: {self.data.meta_path})")

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
    block, meta = mode.data.block, mode.data.meta_path
    found = []
    if block["thinking"] != "mixed" and (block["thinking"] == "on") != mode.thinking and mode.template_renders_thinking:
        found.append(f"thinking: data {meta} rendering.thinking = \"{block['thinking']}\", eval {mode.asked_by} = "
                     f"{'on' if mode.thinking else 'off'}")
    if block["chat_template_fingerprint"] != mode.template_fingerprint:
        from dflash.tokenizer import tokenizer_dir_for

        key = "model.tokenizer" if profile.model.tokenizer else "model.target"
        found.append(f"chat template: data {meta} rendering.chat_template_fingerprint = "
                     f"{short_fingerprint(block['chat_template_fingerprint'])}, eval {key} of profile {profile.name} "
                     f"({tokenizer_dir_for(profile)}) = {short_fingerprint(mode.template_fingerprint)}")
    return found


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
    """The dataset of the drafter's training run (its `train/profile.json`), else the profile's."""
    from dflash.data.dataset_io import META_NAME
    from launcher_core.profile import expand_path

    recorded = trained_dataset(checkpoint)
    if recorded is not None:
        path, found_by = recorded
    else:
        path, found_by = expand_path(profile, profile.paths.dataset), f"paths.dataset of profile {profile.name}"
    return TrainingData(path / META_NAME, found_by, rendering_block(path / META_NAME))


def trained_dataset(checkpoint: Path) -> Optional[tuple[Path, str]]:
    """The dataset a training run read: `paths.dataset` of the resolved profile it wrote
    (RUN/train/profile.json) expanded as the trainer expanded it, else (the run was moved) with
    `{run_dir}` as the run's directory now. None when the checkpoint is not in a run's
    train/checkpoints/, the run wrote no profile, or neither path holds a dataset."""
    from dflash.data.dataset_io import META_NAME
    from dflash.drafter.checkpoint import resolve_checkpoint_dir
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


def rendering_block(meta_path: Path) -> Optional[RenderingBlock]:
    """The meta's `rendering` block when it has the keys eval compares; None otherwise (older datasets)."""
    from typing import cast

    from launcher_core.fileio import read_json_object

    if not meta_path.is_file():
        return None
    try:
        block = read_json_object(meta_path, "a dataset's meta").get("rendering")
    except InputError:
        return None
    if not isinstance(block, dict) or block.get("thinking") not in ("on", "off", "mixed") \
            or not isinstance(block.get("chat_template_fingerprint"), str):
        return None
    return cast(RenderingBlock, block)
