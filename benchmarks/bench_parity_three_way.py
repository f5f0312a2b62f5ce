"""Who departs when the parity gate sees a served step differ: the same drafter decoded step by step three
ways on the same token-id prompts, and the first step where each pair disagrees.

* in-process: `eval`'s own decoder (dflash/eval/specdec.py), with each step's drafts and margins;
* reference: z-lab's `dflash_generate` (PyPI dflash 0.1.0) in its own venv (benchmarks/reference_decode.py),
  the drafter exported `--for reference --full-vocab`, its draft logits kept to the draft vocabulary;
* served: vLLM's CPU build serving the drafter exported `--for vllm` (its per-request per-step acceptance).

`--replay RECORD` decodes a record's prompts once more in-process as the engine computes the drafter (its
deviations, dflash/eval/engine_deviations.py, probed in the engine's venv) and compares them with the record's
served steps, with no engine started: does the deviation explain every departure?

For each prompt and pair: the first step whose accepted drafts differ (the last step of a prompt is left
out: near the length limit each side verifies a different number of tokens), and whether that step came
before the in-process decoder's first near-tie (the gate's constants). Where in-process and reference agree
and the engine departs, the engine departs; where the reference departs too, the cause is ours or the
drafter's numerics.

    .venv/bin/python benchmarks/bench_parity_three_way.py --profile cpu-demo --draft RUN/train/checkpoints/step-N \\
        --prompts RUN/eval/bench/humaneval/prompts.jsonl,dflash/prompts/everyday_prompts.jsonl --num-prompts 16 \\
        --out benchmarks/results/parity-three-way_cpu-2core_DATE.json
    .venv/bin/python benchmarks/bench_parity_three_way.py --replay benchmarks/results/parity-three-way_...json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dflash.eval.parity import GateConstants, PromptAcceptance  # noqa: E402

SIDES = ("inprocess", "reference", "served")
PAIRS = (("inprocess", "reference"), ("inprocess", "served"), ("reference", "served"))


@dataclass(frozen=True)
class PromptSteps:
    """One prompt: its id, and each side's accepted drafts per step."""

    prompt_id: str
    steps: dict[str, Optional[list[int]]]


def first_step_apart(a: Optional[Sequence[int]], b: Optional[Sequence[int]]) -> Optional[int]:
    """The first step (0-based) where two per-step lists differ, the last step of the shorter left out
    (the length limit cuts it differently); None when they agree that far or a side has no list."""
    if a is None or b is None:
        return None
    upto = min(len(a), len(b)) - 1
    return next((k for k in range(upto) if a[k] != b[k]), None)


def departures(prompt: PromptSteps, ours: PromptAcceptance, constants: GateConstants) -> dict[str, Any]:
    """Per pair: the first step apart, 1-based, whether it came before the in-process first near-tie,
    and the in-process margins there."""
    tie = ours.first_near_tie(constants)
    found: dict[str, Any] = {}
    for left, right in PAIRS:
        step = first_step_apart(prompt.steps[left], prompt.steps[right])
        if step is None:
            continue
        found[f"{left}/{right}"] = {
            "step": step + 1, "before_near_tie": tie is None or step < tie,
            left: (prompt.steps[left] or [])[step], right: (prompt.steps[right] or [])[step],
            "drafter_margin": _at(ours.draft_margins, step), "target_margin": _at(ours.target_margins, step)}
    return found


def _at(values: Sequence[Optional[float]], index: int) -> Optional[float]:
    return values[index] if index < len(values) else None


def reference_steps(produced: Sequence[int]) -> list[int]:
    """The reference's tokens committed per step -> accepted drafts per step."""
    return [count - 1 for count in produced]


def run_reference(checkpoint: Path, target: Path, prompts: Sequence[Sequence[int]], block: int, max_new_tokens: int,
                  stop_ids: Sequence[int], work: Path) -> list[dict[str, Any]]:
    """z-lab's decoding of every prompt in the reference venv (built on first use)."""
    from dflash.drafter.checkpoint_files import read_weights, resolve_checkpoint_dir
    from dflash.drafter.export import export_drafter
    from tests.train.reference_venv import reference_python

    drafter = export_drafter(checkpoint, "reference", work / "reference-drafter", full_vocab=True, force=True).directory
    vocab = read_weights(resolve_checkpoint_dir(checkpoint)).get("draft_vocab")
    job = {"target": str(target), "drafter": str(drafter), "block_size": block, "max_new_tokens": max_new_tokens,
           "stop_ids": list(stop_ids), "draft_vocab": None if vocab is None else vocab.tolist(),
           "prompts": [list(ids) for ids in prompts]}
    (work / "job.json").write_text(json.dumps(job), encoding="utf-8")
    done = subprocess.run([str(reference_python()), str(REPO_ROOT / "benchmarks" / "reference_decode.py"),
                           str(work / "job.json"), str(work / "reference.json")], capture_output=True, text=True,
                          cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"the reference decoding failed:\n{done.stderr[-4000:]}")
    result: list[dict[str, Any]] = json.loads((work / "reference.json").read_text(encoding="utf-8"))
    return result


def run_served(profile: Any, checkpoint: Path, target: Path, prompts: Sequence[Sequence[int]], settings: Any,
               work: Path) -> list[Any]:
    """vLLM serving the drafter (its per-step acceptance per request)."""
    from dflash.eval.engines import check_engine_installed, run_engines
    from dflash.eval.served import export_for_engine

    version = check_engine_installed("vllm", profile)
    drafter = export_for_engine("vllm", checkpoint, target, work, version)
    runs = run_engines("vllm", profile, target, drafter, settings.block_size, prompts, settings, work / "logs",
                       methods=("dflash",))
    return list(runs["dflash"].prompts)


def compare_set(profile: Any, checkpoint: Path, prompts_path: Path, count: int, work: Path,
                serve: bool = True) -> list[dict[str, Any]]:
    """One prompt file: decoded the three ways (`serve` False: not served), each prompt's per-step lists and
    departures."""
    from dataclasses import replace

    from dflash.eval.options import EvalOptions
    from dflash.eval.served import engine_settings, inprocess_decode
    from dflash.target_model import resolve_model_path

    target = resolve_model_path(profile.model.target)
    settings = engine_settings(profile, EvalOptions())
    inprocess = inprocess_decode(profile, checkpoint, prompts_path, count, settings)
    settings = replace(settings, stop_token_ids=inprocess.stop_token_ids, block_size=inprocess.report.block_size)
    ours = inprocess.side("dflash").prompts
    k = min(profile.eval.draft_tokens or settings.block_size - 1, settings.block_size - 1)
    reference = run_reference(checkpoint, target, inprocess.prompt_ids, k + 1, settings.max_new_tokens,
                              inprocess.stop_token_ids, work)
    served = run_served(profile, checkpoint, target, inprocess.prompt_ids, settings, work) if serve else \
        [None] * len(ours)
    rows = []
    for name, mine, theirs, zlab in zip(inprocess.prompt_names, ours, served, reference):
        steps = PromptSteps(name, {"inprocess": mine.per_step, "reference": reference_steps(zlab["produced"]),
                                   "served": theirs.per_step if theirs else None})
        rows.append({"prompt": name, "prompt_tokens": len(inprocess.prompt_ids[len(rows)]), "steps": steps.steps,
                     "tokens_equal": {"reference": zlab["tokens"] == mine.tokens,
                                      "served": theirs.token_ids == mine.tokens if theirs else None},
                     "departures": departures(steps, mine, GateConstants()),
                     "first_near_tie": _one_based(mine.first_near_tie(GateConstants()))})
    return rows


def _one_based(step: Optional[int]) -> Optional[int]:
    return None if step is None else step + 1


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per pair: prompts compared, prompts apart, apart before the first near-tie."""
    lines = [f"{len(rows)} prompts"]
    for left, right in PAIRS:
        key = f"{left}/{right}"
        if any(row["steps"][right] is None for row in rows):
            continue
        apart = [row for row in rows if key in row["departures"]]
        early = [row for row in apart if row["departures"][key]["before_near_tie"]]
        lines.append(f"  {key:<20} apart on {len(apart)}, before the in-process first near-tie on {len(early)}")
        lines += [f"    {row['prompt']} ({row['prompt_tokens']} prompt tokens): step {row['departures'][key]['step']}, "
                  f"{left} {row['departures'][key][left]} vs {right} {row['departures'][key][right]}, margins drafter "
                  f"{_fmt(row['departures'][key]['drafter_margin'])} target {_fmt(row['departures'][key]['target_margin'])}"
                  for row in early]
    return lines


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def replay(record_path: Path) -> list[str]:
    """A record's prompts decoded in-process as the engine computes the drafter, against its served steps."""
    from dflash.eval.engine_deviations import engine_deviations
    from dflash.eval.options import EvalOptions
    from dflash.eval.served import engine_settings, inprocess_decode
    from launcher_core.profile import load_profile

    record = json.loads(record_path.read_text(encoding="utf-8"))
    profile = load_profile(record["profile"])
    deviations = engine_deviations("vllm", profile)
    layer = next((d.context_k_norm_layer for d in deviations), None)
    lines = [f"engine deviations: {', '.join(d.name for d in deviations) or 'none'}"]
    for name, rows in record["sets"].items():
        alike = inprocess_decode(profile, Path(record["draft"]), Path(name), len(rows),
                                 engine_settings(profile, EvalOptions()), layer).side("dflash").prompts
        served = [row["steps"]["served"] for row in rows]
        trained = sum(s == row["steps"]["inprocess"] for s, row in zip(served, rows))
        same = sum(s == ours.per_step for s, ours in zip(served, alike))
        lines.append(f"{name}: served per step equal to in-process as trained on {trained} of {len(rows)} prompts, "
                     f"as the engine computes the drafter on {same} of {len(rows)}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    from launcher_core.profile import load_profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu-demo")
    parser.add_argument("--draft", help="a checkpoint directory (step-N)")
    parser.add_argument("--prompts", default="dflash/prompts/everyday_prompts.jsonl", help="prompt files, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--port", type=int, default=0, help="where vLLM listens (default eval.engine_port)")
    parser.add_argument("--out", help="write the per-prompt records here (JSON)")
    parser.add_argument("--replay", help="a record of this benchmark: its prompts decoded as the engine computes "
                                             "the drafter, against its served steps (no engine started)")
    parser.add_argument("--smoke", action="store_true",
                        help="an untrained drafter on 1 prompt x 6 tokens, in-process and reference (nothing served)")
    args = parser.parse_args(argv)
    if args.replay:
        print(*replay(Path(args.replay)), sep="\n")
        return 0
    profile = load_profile(args.profile)
    if args.port:
        from dataclasses import replace

        profile = replace(profile, eval=replace(profile.eval, engine_port=args.port))
    if args.smoke:
        from dataclasses import replace

        from benchmarks.bench_parity_dtype import smoke_drafter

        args.draft, args.num_prompts = str(smoke_drafter(profile)), 1
        profile = replace(profile, eval=replace(profile.eval, max_new_tokens=6))
    if not args.draft:
        parser.error("--draft is needed (or --smoke)")
    records = {}
    with tempfile.TemporaryDirectory(prefix="three-way-") as scratch:
        for index, name in enumerate(args.prompts.split(",")):
            work = Path(scratch) / str(index)
            work.mkdir()
            records[name] = compare_set(profile, Path(args.draft), Path(name), args.num_prompts, work,
                                        serve=not args.smoke)
            print(f"== {name}", *summary(records[name]), sep="\n", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"draft": args.draft, "profile": args.profile, "sets": records}, indent=1),
                                  encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
