"""One rank of the start-up RSS test (tests/train/test_start_rss.py), run by torchrun: the rank's
training state built in the trainer's order (`--order sharded`: `build_state`, the drafter built on the
meta device and materialised per shard, the target loaded up to its deepest tap) or in the order before
it (`--order whole`: the whole target loaded, the whole drafter built on the host, then sharded and the
target cut: `whole_then_sharded`); each rank writes its peak RSS (MiB) to --out/rank-N.json."""
from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The target of the test and benchmark: a random Qwen3 as wide as the drafter should be (its width is the
# target's), with few layers and a small vocabulary (60 M parameters).
TARGET = {"vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 8192, "num_hidden_layers": 2,
          "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": False,
          "max_position_embeddings": 4096}


def wide_target(directory: Path) -> Path:
    """TARGET with random weights, saved to `directory`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TARGET)).save_pretrained(directory)
    return directory


def whole_then_sharded(profile) -> None:
    """The order before: the whole target, the whole drafter on the host, moved, sharded, the target cut."""
    import torch

    from dflash.train.rank.parallel import drafter_mesh, shard_drafter
    from dflash.train.rank.setup import build_drafter, load_rank_target, resolve_layer_ids

    device = torch.device("cpu")
    target = load_rank_target(profile, device)
    count = target.config.num_hidden_layers
    layer_ids = resolve_layer_ids(profile, count)
    drafter = build_drafter(profile, target, layer_ids, count).to(device)
    shard_drafter(drafter, drafter_mesh(device, "gloo"))
    target.model.layers = target.model.layers[: max(layer_ids) + 1]


def main() -> None:
    from dflash.train.rank import parallel
    from dflash.train.rank.setup import build_state
    from launcher_core.profile import load_profile

    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", required=True)
    parser.add_argument("--order", choices=("sharded", "whole"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    env = parallel.WorkerEnv.from_env()
    parallel.init_process_group("gloo")
    if args.order == "sharded":
        build_state(profile, Path(profile.paths.run_dir), env, resume=False, planned_micro_batch=1)
    else:
        whole_then_sharded(profile)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{env.rank}.json").write_text(json.dumps({"peak_rss_mib": peak_mib}), encoding="utf-8")
    parallel.close_process_group()
    from launcher_core.processes import exit_without_finalization

    exit_without_finalization(0)      # gloo's threads can abort the interpreter's teardown (SIGABRT)


if __name__ == "__main__":
    main()
