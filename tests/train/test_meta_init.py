"""The ranks build their drafter on the meta device, shard it and materialise only their shards
(dflash.train.rank.materialize), and it is the drafter the whole build on the host gives: on 1, 2 and 3
real gloo ranks (torchrun; 3 shard unevenly, and DFlash 2's 2-row kernels leave rank 2 an empty
shard), every gathered parameter and buffer (the rotary inv_freq, recomputed, and the draft
vocabulary included) equals `build_drafter`'s for the same seed, for the random start with
a draft vocabulary, drafter.init = "target", DFlash 2, and drafter.init = "drafter" (a DFlash 2 start
from a saved checkpoint). Negative control: another seed's whole build differs, so the comparison
can fail."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher_core.profile import load_profile
from tests.train.conftest import write_profile

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
DFLASH2 = {"kind": "dflash2", "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
VARIANTS = {
    "random-vocab": {"num_layers": 2, "target_layer_ids": [0, 2], "draft_vocab_size": 40, "norm_init": 0.5},
    "target": {"init": "target", "num_layers": 2, "target_layer_ids": [1]},
    "dflash2": {**DFLASH2, "num_layers": 2, "target_layer_ids": [1, 2]},
}


def whole_build(profile) -> dict[str, torch.Tensor]:
    """The drafter built whole on the host (`build_drafter`), from the whole target."""
    from dflash.target_model import load_target, resolve_model_path
    from dflash.train.rank.data import TrainData
    from dflash.train.rank.parallel import WorkerEnv
    from dflash.train.rank.setup import build_drafter, choose_draft_vocab, dataset_path, resolve_layer_ids

    target = load_target(resolve_model_path(profile.model.target))
    count = target.config.num_hidden_layers
    env = WorkerEnv(0, 1, 0)
    vocab = choose_draft_vocab(profile, TrainData(dataset_path(profile), profile, env), env) if profile.drafter.draft_vocab_size else None
    drafter = build_drafter(profile, target, resolve_layer_ids(profile, count), count, vocab)
    return {name: t.detach().clone() for name, t in [*drafter.named_parameters(), *drafter.named_buffers()]}


def start_ranks(tmp_path: Path, ranks: int, profiles: list[Path], backend: str = "gloo") -> tuple[subprocess.Popen, Path]:
    """torchrun of `ranks` ranks of the worker, started (the three world sizes run side by side, beside the
    whole builds here); the process and the folder its ranks write to."""
    out = tmp_path / f"out-{ranks}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(HERE.parents[1])}
    with (tmp_path / f"torchrun-{ranks}.out").open("w") as log:
        process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                                    "--log-dir", str(tmp_path / f"torchrun-logs-{ranks}"),
                                    str(HERE / "meta_init_worker.py"), "--out", str(out), "--backend", backend,
                                    *map(str, profiles)], env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, out


def finished(tmp_path: Path, ranks: int, process: subprocess.Popen, out: Path) -> Path:
    try:
        code = process.wait(timeout=300)
    finally:
        process.kill()
    assert code == 0, (tmp_path / f"torchrun-{ranks}.out").read_text()[-6000:]
    return out


def equal(found: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    return found.keys() == reference.keys() and all(torch.equal(found[n], reference[n]) for n in reference)


def test_the_sharded_meta_build_is_the_whole_build_on_1_2_and_3_ranks(tmp_path, tiny_qwen3_target, tiny_dataset):
    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.target_model import load_target
    from dflash.train.rank.setup import build_drafter

    profiles = {name: write_profile(tmp_path / f"{name}.toml", tiny_qwen3_target, tiny_dataset, tmp_path / name,
                                    drafter=drafter, global_batch=12) for name, drafter in VARIANTS.items()}
    source_profile = load_profile(str(profiles["dflash2"]))
    source = build_drafter(source_profile, load_target(tiny_qwen3_target), [1, 2], 4)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.01)        # off its fresh start, so a fresh start would not pass for the loaded one
    saved = save_checkpoint(tmp_path / "source", source, 1, {})
    profiles["drafter"] = write_profile(tmp_path / "drafter.toml", tiny_qwen3_target, tiny_dataset, tmp_path / "drafter",
                                        drafter={**VARIANTS["dflash2"], "init": "drafter", "init_from": str(saved)},
                                        global_batch=12)
    started = {ranks: start_ranks(tmp_path, ranks, list(profiles.values())) for ranks in (1, 2, 3)}
    references = {name: whole_build(load_profile(str(path))) for name, path in profiles.items()}
    outputs = {ranks: finished(tmp_path, ranks, *run) for ranks, run in started.items()}
    for name, path in profiles.items():
        profile, reference = load_profile(str(path)), references[name]
        for ranks, out in outputs.items():
            found = torch.load(out / f"{name}.pt")
            assert equal(found["tensors"], reference), (name, ranks)
            assert found["target_layers"] == max(profile.drafter.target_layer_ids) + 1     # truncated after the init
    assert torch.equal(torch.load(outputs[2] / "drafter.pt")["tensors"]["fc.weight"], source.fc.weight)
    assert torch.load(outputs[2] / "random-vocab.pt")["tensors"]["draft_vocab"].numel() > 0
    base = load_profile(str(profiles["random-vocab"]))
    other = dataclasses.replace(base, train=dataclasses.replace(base.train, seed=base.train.seed + 1))
    assert not equal(whole_build(other), whole_build(base))
