"""What the launcher does with a run's checkpoints before torchrun starts (and before any rank
loads the target): clear what an interrupted save left, pick the checkpoint to resume, and hold
it and `drafter.init_from` against the profile's drafter.

* Partial checkpoints: a save writes `checkpoints/.step-N.<random>.tmp` and renames it into
  place (`.step-N.old-PID` while it replaces one); a run killed mid-save leaves them. The next
  run removes them (it holds the run directory's lock, so no live save owns them) and says so.
* The checkpoint to resume: the newest `step-N` that `dflash.drafter.verify.verify_checkpoint`
  finds whole and whose weights can train (`WeightsRecord`). A damaged newer one, or one whose weights
  a diverging update wrecked, is skipped with its problems printed, and `latest` is pointed at the one
  chosen (the ranks resume what `latest` names), in one line naming what it named and why that is not
  resumed (missing, skipped, or older); none left: DataError (exit 4).
* Shape: the tensors of the chosen checkpoint (from its safetensors header), its tap layers,
  block size and mask token against the drafter the profile builds on its target (built on the
  meta device: no memory, no weights): ConfigError (exit 2) listing every difference. The same for
  `drafter.init_from` (tensors and tap layers, as the rank checks them).
"""
from __future__ import annotations

import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from launcher_core.errors import ConfigError, DataError, InputError

if TYPE_CHECKING:
    from dflash.drafter.verify import Shapes
    from dflash.train.supervisor.launch_checks import LaunchFacts
    from launcher_core.schema import Profile

PARTIAL_SAVE = re.compile(r"^\.step-(?P<step>\d+)\.(?:.+\.tmp|(?P<old>old-\d+))$")
STEP = re.compile(r"^step-(\d+)$")
# A checkpoint whose trained weights' RMS is more than this many times the run's initial one cannot train
# (measured on 2 gloo ranks, docs/failures.md "A loss that cannot train"): runs that train stay within 1.1x
# (cpu-demo's 650 steps 1.01x; the tests' drafter at lr 1e-2 1.09x) and even lr 1.0 within 24x with the
# loss still falling; lr 10 goes to 93-175x with the loss above its start, lr 1e3 to 9e3x (loss 263), lr 1e5
# and up leave a dead drafter (the loss fixed at ln of the vocabulary), and one update at lr 1e30 9e30x.
WRECKED_RMS_FACTOR = 50.0


@dataclass(frozen=True)
class WeightsRecord:
    """What a checkpoint's training_state.pt says of its weights (dflash.train.rank.sharded_checkpoints.training_state):
    the trained weights' RMS, the run's initial one, and the loss of the checkpoint's step."""

    rms: float
    initial_rms: float
    loss: Optional[float]

    def wrecked(self) -> bool:
        """Not finite, or more than WRECKED_RMS_FACTOR times the run's initial RMS."""
        if not math.isfinite(self.rms):
            return True
        return self.initial_rms > 0 and self.rms > WRECKED_RMS_FACTOR * self.initial_rms

    def describe(self) -> str:
        ratio = f", {self.rms / self.initial_rms:.3g} x the run's initial {self.initial_rms:.3g}" if self.initial_rms > 0 else ""
        return (f"its weights cannot train: their RMS is {self.rms:.3g}{ratio} (more than {WRECKED_RMS_FACTOR:g} x: an "
                f"update that diverged wrecked them; a run that trains stays near 1 x)")


def weights_record(checkpoint: Path) -> Optional[WeightsRecord]:
    """The checkpoint's record of its weights; None when it has none (written before the record) or cannot be read."""
    from dflash.drafter.checkpoint_files import load_training_state

    try:
        saved = load_training_state(checkpoint)
    except InputError:
        return None
    rms, initial, loss = saved.get("weights_rms"), saved.get("initial_weights_rms"), saved.get("loss")
    if not isinstance(rms, (int, float)) or not isinstance(initial, (int, float)):
        return None
    return WeightsRecord(float(rms), float(initial), float(loss) if isinstance(loss, (int, float)) else None)


def wrecked_weights(checkpoint: Path) -> Optional[str]:
    """Why the run cannot train from this checkpoint's weights (WeightsRecord.describe); None when it can, or
    when the checkpoint records nothing to judge by."""
    record = weights_record(checkpoint)
    return record.describe() if record is not None and record.wrecked() else None


def trainable_checkpoint_hint(run_dir: Path) -> str:
    """After a loss that cannot train: the newest whole checkpoint whose weights can train, which `--resume`
    continues from (the wrecked ones after it named: it skips them), or, when every one is wrecked, to start over."""
    from dflash.drafter.checkpoint_files import complete_checkpoints

    complete = complete_checkpoints(run_dir)
    wrecked: list[str] = []
    for step in sorted(complete, reverse=True):
        why = wrecked_weights(complete[step])
        if why is None:
            skips = f" (it skips {', '.join(wrecked)})" if wrecked else ""
            return f"the last complete checkpoint the run can train from is step-{step}: continue from it with --resume{skips}"
        wrecked.append(f"step-{step}: {why}")
    if wrecked:
        return (f"no checkpoint of this run can train ({'; '.join(wrecked)}): start over with --start-over (the old "
                f"train/ is kept as train.prev-*)")
    return "no checkpoint was written yet: train again to start over"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prepare_checkpoints(profile: Profile, facts: LaunchFacts, run_dir: Path, *, resume: bool,
                        log: Callable[[str], None] = say) -> Optional[Path]:
    """Remove partial saves; check `drafter.init_from`; with `resume`, choose, verify and fit the
    checkpoint to resume (returned; None when the run has none)."""
    from dflash.drafter.checkpoint_files import checkpoints_dir

    remove_partial_saves(checkpoints_dir(run_dir), log)
    if profile.drafter.init == "drafter" and profile.drafter.init_from:
        check_init_from(profile, facts)
    if not resume:
        return None
    chosen = choose_checkpoint(checkpoints_dir(run_dir), log)
    if chosen is not None:
        check_resume_fits(profile, facts, chosen)
    return chosen


def finished_run(profile: Profile, run_dir: Path) -> Optional[str]:
    """What to say instead of resuming a finished run (None: it is not): the manifest's train stage is done and
    its last checkpoint holds every step the profile plans (train.max_steps, or train.epochs over the dataset).
    Read only; a run whose profile now plans more steps resumes as any other."""
    from dflash.drafter.checkpoint_files import checkpoints_dir
    from dflash.train.supervisor.launch_checks import planned_steps
    from launcher_core.manifest import read_manifest

    if read_manifest(run_dir)["stages"].get("train", {}).get("state") != "done":
        return None
    newest = next(iter(step_directories(checkpoints_dir(run_dir))), None)
    planned = planned_steps(profile)
    if newest is None or planned is None or int(newest.name.removeprefix("step-")) < planned:
        return None
    return (f"train: the run in {run_dir} is finished: {newest.name} holds its last step ({planned} planned by "
            f"profile {profile.name}); nothing to resume, nothing written. Evaluate it with `launcher.py eval`, "
            f"raise train.max_steps (or train.epochs) to train on from it, or start over with `train --force`")


def remove_partial_saves(directory: Path, log: Callable[[str], None] = say) -> list[Path]:
    """`.step-N.*.tmp` / `.step-N.old-PID` directories a killed save left; removed, each said. An
    `.old-PID` whose `step-N` is missing (a save killed between the two renames of its replace) is
    the previous whole step-N: it is put back instead. A `.tmp` that is whole (every rank's shards and
    DCP's metadata written, with its config and training state: an async save the run ended before
    rank 0 put it in place) becomes its step-N when there is none."""
    import os

    from dflash.drafter.verify import verify_checkpoint
    from launcher_core.diskfull import human_bytes, tree_bytes

    removed = []
    for entry in sorted(directory.glob(".step-*")) if directory.is_dir() else []:
        match = PARTIAL_SAVE.match(entry.name)
        if not match or not entry.is_dir():
            continue
        if match.group("old") and not (directory / f"step-{match.group('step')}").exists():
            os.replace(entry, directory / f"step-{match.group('step')}")
            log(f"restored {directory / ('step-' + match.group('step'))} from {entry.name}: a save replacing it was "
                f"interrupted between its two renames")
            continue
        target = directory / f"step-{match.group('step')}"
        if not match.group("old") and not target.exists() and not verify_checkpoint(entry):
            os.replace(entry, target)
            log(f"put {target} in place from {entry.name}: a whole checkpoint the run ended before renaming "
                f"(its shards were written while the ranks trained on)")
            continue
        size = tree_bytes(entry)
        shutil.rmtree(entry)
        log(f"removed {entry} ({human_bytes(size)}): a partial checkpoint an interrupted save left behind")
        removed.append(entry)
    return removed


def step_directories(directory: Path) -> list[Path]:
    """`step-N` directories, newest (highest N) first."""
    steps = [(int(m.group(1)), p) for p in directory.glob("step-*") if (m := STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def pointed_name(pointer: Path, log: Callable[[str], None] = say) -> Optional[str]:
    """What `latest` names (None: no pointer); a damaged pointer is said and replaced by the caller."""
    from dflash.drafter.checkpoint_files import PointerIsDirectory, read_pointer

    if not pointer.exists():
        return None
    try:
        return read_pointer(pointer)
    except PointerIsDirectory:
        raise
    except InputError as damaged:
        log(f"{damaged}: replaced by the newest whole checkpoint")
        return None


def repointed(pointer: Path, named: str, chosen: str, skipped: bool = False) -> str:
    """The line that says `latest` was changed, and why: what it named does not exist, was skipped (damaged, or
    its weights cannot train: said above), or is not the newest whole checkpoint."""
    there = pointer.parent / named
    why = ("which does not exist" if not there.exists() else "which was skipped (above)" if skipped
           else "which is not a checkpoint directory" if not there.is_dir() else "not the newest whole checkpoint")
    return f"{pointer} named {named}, {why}; it now names {chosen}, the newest whole checkpoint, which the run resumes"


def choose_checkpoint(directory: Path, log: Callable[[str], None] = say) -> Optional[Path]:
    """The newest whole checkpoint (module docstring); `latest` is pointed at it when it differs."""
    from dflash.drafter.checkpoint_files import LATEST
    from dflash.drafter.verify import verify_checkpoint
    from launcher_core.fileio import write_text_atomic

    candidates = step_directories(directory)
    skipped: list[str] = []
    for candidate in candidates:
        problems = verify_checkpoint(candidate)
        wrecked = None if problems else wrecked_weights(candidate)
        if not problems and wrecked is None:
            pointer = directory / LATEST
            named = pointed_name(pointer, log)
            if skipped or named != candidate.name:
                write_text_atomic(pointer, f"{candidate.name}\n")
            for line in skipped:
                log(line)
            if skipped:
                log(f"resuming from {candidate.name}, the newest whole checkpoint whose weights can train (the skipped "
                    f"ones stay where they are; a save of the same step replaces them)")
            if named is not None and named != candidate.name:
                log(repointed(pointer, named, candidate.name, skipped=f"skipped {named}: " in "\n".join(skipped)))
            return candidate
        skipped.append(f"skipped {candidate.name}: damaged:\n" + "\n".join(f"  {p}" for p in problems) if problems
                       else f"skipped {candidate.name}: {wrecked}")
    if candidates:
        raise DataError(f"no checkpoint under {directory} can be resumed:\n" + "\n".join(skipped) +
                        "\ntrain without --resume to start over (--start-over keeps the old train/ as train.prev-*)")
    return None


def profile_drafter_shapes(profile: Profile, facts: LaunchFacts, draft_vocab: int) -> Shapes:
    """Tensor name -> shape of the drafter the ranks would build (dflash.train.rank.setup.build_sharded_drafter),
    built on the meta device from the target's config.json; `draft_vocab`: its draft vocabulary's length."""
    import torch
    from transformers import AutoConfig

    from dflash.drafter.layers import profile_layer_options
    from dflash.drafter.network import DFlashDrafter, drafter_config
    from dflash.drafter.shape import profile_shape

    target = AutoConfig.from_pretrained(facts.target.path, local_files_only=True)
    text = target.get_text_config() if hasattr(target, "get_text_config") else target
    config = drafter_config(text, num_layers=profile.drafter.num_layers, block_size=profile.drafter.block_size,
                            target_layer_ids=facts.layer_ids, mask_token_id=facts.mask_token_id,
                            draft_vocab_size=draft_vocab, shape=profile_shape(profile.drafter),
                            **profile_layer_options(profile.drafter))
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    return {name: tuple(tensor.shape) for name, tensor in drafter.state_dict().items()}


def drafter_differences(profile: Profile, facts: LaunchFacts, directory: Path, *, full: bool) -> list[str]:
    """How the drafter in `directory` differs from the profile's: tensors and tap layers; with
    `full` (a checkpoint to resume) also block size and mask token."""
    from dflash.drafter.checkpoint_files import CONFIG
    from dflash.drafter.verify import checkpoint_shapes, shape_differences
    from launcher_core.fileio import read_json_object

    found = checkpoint_shapes(directory)
    vocab = found.get("draft_vocab", (0,))[0] if profile.drafter.draft_vocab_size else 0
    vocab = vocab if 0 < vocab <= profile.drafter.draft_vocab_size else profile.drafter.draft_vocab_size
    differences = shape_differences(profile_drafter_shapes(profile, facts, vocab), found)
    config: dict[str, Any] = read_json_object(directory / CONFIG, "a drafter config")
    dflash = config.get("dflash_config") or {}
    keys: list[tuple[str, object]] = [("target_layer_ids", list(facts.layer_ids))]
    if full:
        keys += [("block_size", profile.drafter.block_size), ("mask_token_id", facts.mask_token_id)]
    for key, mine in keys:
        theirs = dflash.get(key, config.get(key))
        if theirs is not None and theirs != mine:
            differences.append(f"dflash_config.{key}: {theirs} there, {mine} in the profile")
    return differences


def check_resume_fits(profile: Profile, facts: LaunchFacts, checkpoint: Path) -> None:
    differences = drafter_differences(profile, facts, checkpoint, full=True)
    if differences:
        raise ConfigError(f"--resume: {checkpoint} holds a drafter of another shape than profile {profile.name}'s "
                          f"({len(differences)} difference(s)):\n" + "\n".join(f"  {d}" for d in differences) +
                          "\nresume with the profile it was trained with, or train without --resume (--start-over keeps "
                          "the old train/ as train.prev-*)")


def check_init_from(profile: Profile, facts: LaunchFacts) -> None:
    """drafter.init_from against the profile's drafter, from its config.json and safetensors header."""
    from dflash.drafter.checkpoint_files import DCP_DIR, INDEX, WEIGHTS, resolve_checkpoint_dir, weights_in_shards_only
    from dflash.drafter.verify import dcp_problems, safetensors_problems

    directory = resolve_checkpoint_dir(Path(profile.drafter.init_from))
    if (directory / INDEX).exists() and not (directory / WEIGHTS).exists():
        return                                  # sharded: the ranks check it tensor by tensor
    shards = weights_in_shards_only(directory)
    damaged = dcp_problems(directory / DCP_DIR) if shards else safetensors_problems(directory / WEIGHTS)
    if damaged:
        raise ConfigError(f"drafter.init_from {directory}: cannot be read:\n" + "\n".join(f"  {p}" for p in damaged))
    differences = drafter_differences(profile, facts, directory, full=False)
    if differences:
        raise ConfigError(f"drafter.init_from {directory}: does not fit profile {profile.name}'s drafter "
                          f"({len(differences)} difference(s)):\n" + "\n".join(f"  {d}" for d in differences))
