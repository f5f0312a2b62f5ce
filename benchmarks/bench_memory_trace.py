"""Traced vs modelled memory of one training step at the GPU profiles' worst case (issues 18, 22).

    .venv/bin/python benchmarks/bench_memory_trace.py [--profiles rtx6000-x8 b200-x8 h200-x1] [--micro-batches 1 2]
        [--train KEY=VALUE ...] [--drafter KEY=VALUE ...]     (e.g. --drafter kind=dflash2: DFlash 2)

Each step is the trainer's own (dflash.measure.trace: `state_from_target` + `plain_step`) on fake
tensors under torch's fake process group at the profile's world size, counted by FSDPMemTracker: the
Qwen3.6-27B-shaped target's tap forward, two micro-batches' forward/backward with the chunked loss
(the drafter sharded by FSDP2: all-gathers, reduce-scatters inside the backward), clipping and AdamW
over the shards. Prints
per profile and micro-batch each component, model vs trace, and the largest differences (targets:
3 % at the peak, 5 % per component).

    .venv/bin/python benchmarks/bench_memory_trace.py --smoke    (rtx6000-x8's step at micro-batch 1 on a tiny
                                                                  Qwen3.5-shaped target: 8 layers, hidden 64)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# --smoke: Qwen3.6-27B's layout at a tiny width (a target config and the drafter's own attention
# shape), on a 64-token sequence with 4 anchors and two draft layers.
SMOKE_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=6,
                    num_key_value_heads=1, head_dim=32, vocab_size=4096, linear_num_key_heads=4,
                    linear_num_value_heads=12, linear_key_head_dim=16, linear_value_head_dim=16)
SMOKE_DRAFTER = dict(num_layers=2, target_layer_ids=(1, 5), num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                     mask_token_id=4000, layer_types=("sliding_attention", "full_attention"), sliding_window=16)


def smoke_case(profile):
    """The profile at the smoke size, and its tiny target config."""
    from dflash.measure import fake

    small = dataclasses.replace(profile, data=dataclasses.replace(profile.data, max_length=64),
                                train=dataclasses.replace(profile.train, num_anchors=4),
                                drafter=dataclasses.replace(profile.drafter, **SMOKE_DRAFTER))
    return small, fake.qwen36_27b_config(**SMOKE_TARGET)


def parsed_values(assignments: list[str]) -> dict[str, object]:
    """`key=value` assignments: ints, true/false, else the string as it is."""
    values: dict[str, object] = {}
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        values[key] = int(value) if value.isdigit() else (value == "true" if value in ("true", "false") else value)
    return values


def with_train_values(profile, assignments: list[str]):
    """The profile with `key=value` [train] values (ints, or strings as they are)."""
    values = parsed_values(assignments)
    return dataclasses.replace(profile, train=dataclasses.replace(profile.train, **values)) if values else profile


def with_drafter_values(profile, assignments: list[str]):
    """The profile with `key=value` [drafter] values, e.g. kind=dflash2 selector_rank=128."""
    values = parsed_values(assignments)
    return dataclasses.replace(profile, drafter=dataclasses.replace(profile.drafter, **values)) if values else profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=["rtx6000-x8", "b200-x8", "h200-x1"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default=None,
                        help="train.compute_dtype for every profile (default: each profile's own)")
    parser.add_argument("--train", nargs="*", default=[], metavar="KEY=VALUE",
                        help="[train] values for every profile, e.g. num_anchors=512 activation_checkpointing=none")
    parser.add_argument("--drafter", nargs="*", default=[], metavar="KEY=VALUE",
                        help="[drafter] values for every profile, e.g. kind=dflash2 (DFlash 2 at its published defaults)")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: rtx6000-x8, micro-batch 1, a tiny target")
    args = parser.parse_args()
    if args.smoke:
        args.profiles, args.micro_batches = ["rtx6000-x8"], [1]
    from dflash.measure import fake, trace
    from launcher_core.profile import load_profile

    worst_total, worst_part, done = 0.0, 0.0, {}
    for name in args.profiles:
        profile = load_profile(name)
        if args.compute_dtype:
            profile = dataclasses.replace(profile, train=dataclasses.replace(profile.train,
                                                                             compute_dtype=args.compute_dtype))
        profile = with_drafter_values(with_train_values(profile, args.train), args.drafter)
        profile, config = smoke_case(profile) if args.smoke else (profile, fake.target_config(profile))
        workload = fake.workload_for_config(profile, config)
        for micro_batch in args.micro_batches:
            same = (workload, micro_batch, profile.train.autocast)
            if same in done:            # b200-x8 is rtx6000-x8's workload and world size: the same step
                print(f"{name}, micro-batch {micro_batch}: the same step as {done[same][0]} (same workload, "
                      f"world size and batch split); its figures hold", flush=True)
                continue
            traced = trace.trace_step(profile, micro_batch, config=config)
            figures = fake.compare(traced, workload)
            done[same] = (name, traced)
            print("\n".join(fake.format_comparison(name, traced, figures)), flush=True)
            worst_total = max(worst_total, abs(figures[-1].error))
            worst_part = max([worst_part] + [abs(f.error) for f in figures[:-1] if f.traced >= 1])
            print(f"  supervised slots per target forward: {workload.supervised_slots * micro_batch:,}; "
                  f"gradient reduction's peak {traced.reduction_peak:,.0f} MiB", flush=True)
    print(f"largest model-vs-trace difference: peak {100 * worst_total:.1f}% (target 3%), "
          f"component {100 * worst_part:.1f}% (target 5%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
