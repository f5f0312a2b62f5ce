"""`launcher.py export CKPT --for sglang|vllm|reference [-o DIR] [--target DIR] [--full-vocab] [--sglang-version V]`.

Writes a drafter directory (config.json + model.safetensors, and training_data.json: the record of the data it
was trained on, which eval's mode check reads) in the format the engine reads:
plain RoPE keys at the top level, dflash_config / block_size / num_target_layers / architectures,
and the draft vocabulary converted where the engine can hold it, refused where it cannot
(`--full-vocab` drops it, with the consequence printed). See docs/checkpoints.md, "Exporting".
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from dflash.data.rendering_record import TrainingDataRecord


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="step-N/ checkpoint (or a checkpoints/ dir: its latest)")
    parser.add_argument("--for", dest="engine", required=True, choices=("sglang", "vllm", "reference"),
                        help="the engine that will load the drafter")
    parser.add_argument("-o", "--output", metavar="DIR", help="output directory (default: CKPT-<engine>)")
    parser.add_argument("--target", metavar="DIR", help="the target model directory (vLLM export of a draft vocabulary)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="drop a draft vocabulary the engine cannot hold (the drafter then proposes from the "
                             "whole vocabulary)")
    parser.add_argument("--sglang-version", metavar="VERSION",
                        help="--for sglang: the SGLang release that will serve the drafter (default: the one installed "
                             "here, if any); a drafter whose layers it would run with other attention than trained "
                             "(sliding windows before 0.5.14, is_causal before 0.5.18) is refused, naming it")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing export at the output path (never a checkpoint or another folder)")


def run(args: argparse.Namespace) -> int:
    from dflash.drafter.checkpoint_files import resolve_checkpoint_dir
    from dflash.drafter.export import export_drafter
    from launcher_core.runlock import run_locks_for

    checkpoint = resolve_checkpoint_dir(Path(args.checkpoint))
    output = Path(args.output) if args.output else checkpoint.with_name(f"{checkpoint.name}-{args.engine}")
    version = (args.sglang_version or installed_version("sglang")) if args.engine == "sglang" else None
    with run_locks_for([output], "export"):        # not into a live run
        result = export_drafter(Path(args.checkpoint), args.engine, output, full_vocab=args.full_vocab,   # refusals: there
                                target=Path(args.target) if args.target else None, force=args.force, flag="-o",
                                sglang_version=version, training_data=run_training_data(checkpoint))
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {result.directory} (for {args.engine})")
    return 0


def run_training_data(checkpoint: Path) -> Optional[TrainingDataRecord]:
    """For a checkpoint that carries no record of its training data (written before it): the record of the dataset
    its run's train/profile.json names (dflash.eval.mode.trained_dataset); None when it names none."""
    from dflash.data.dataset_io import META_NAME
    from dflash.data.rendering_record import training_data_record
    from dflash.drafter.checkpoint_files import TRAINING_DATA
    from dflash.eval.mode import trained_dataset

    found = None if (checkpoint / TRAINING_DATA).is_file() else trained_dataset(checkpoint)
    return None if found is None else training_data_record(found[0] / META_NAME)


def installed_version(distribution: str) -> Optional[str]:
    """The version of `distribution` installed in this environment, None when absent."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
