"""The parity gate's error rates on the real engine: how often it fails a drafter served as trained (its
false-failure rate) and how often it fails each negative control (its detection rate), measured on vLLM's
CPU build over many resampled prompt sets; the gate's constants (dflash/eval/parity.py) are chosen from
these figures.

`collect` decodes every prompt once in-process and once served, per drafter and per served variant, and
writes the per-prompt records (tokens, each step's accepted drafts, each in-process step's drafter and
target margins) to one gzipped JSON file:

* in-process: the target alone, the run's final drafter (the pipeline's choice: the best by held-out
  tau), an early checkpoint of the same run (`--early-step`), a sliding-window drafter (`--sliding`), a
  weak drafter (`--weak`: a few steps of training);
* served (vLLM, one request in flight, the pipeline's flags): the target alone; each drafter as trained
  (the weak one too);
  and the negative controls (dflash/eval/controls.py): the final drafter with random weights and with its
  taps shifted by one layer, the early checkpoint served in place of the final one, the sliding drafter
  with its sliding rule flipped, and a dead drafter (every draft the mask token) in place of the weak
  drafter (`--weak`, default the early checkpoint).

`analyse` draws `--sets` prompt sets of `--size` distinct prompts from the records, applies the gate to
each pair (served variant, in-process drafter) on each set, and prints the false-failure rate of each
drafter served as trained, the detection rate of each control, which rule caught what, the margins at
which the served decoding first departed from the in-process one on the true drafters, a sweep of the
constants, and the constants this procedure chooses (`choose_constants`). The gate's own `method_parity`
judges every set at the chosen and at the current constants; the sweep uses the same rules per prompt.
The rule before this gate (a prompt with identical tokens might differ by one step per drafter near-tie
at 0.25 logits, plus the gain rules) is measured beside it.

    .venv/bin/python benchmarks/bench_parity_gate.py collect --run-dir RUN [--sliding CKPT] [--early-step 50]
        [--prompts FILE,FILE] [--out benchmarks/results/parity-gate_cpu-demo_vllm-cpu_DATE.json.gz]
    .venv/bin/python benchmarks/bench_parity_gate.py analyse RECORDS.json.gz [--sets 1000] [--size 16]
    .venv/bin/python benchmarks/bench_parity_gate.py --smoke    (in-process records of 1 prompt x 4 tokens with an
        untrained drafter; then `analyse` of the committed records on 50 sets)
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dflash.eval.parity import (  # noqa: E402
    GateConstants,
    PromptAcceptance,
    SideFigures,
    method_parity,
    prefix_mismatch,
    sign_test,
)

RECORDS = REPO_ROOT / "benchmarks" / "results" / "parity-gate_cpu-demo_vllm-cpu_2026-12-06.json.gz"
PROMPT_FILES = ("dflash/prompts/everyday_prompts.jsonl", "dflash/prompts/indist_prompts.jsonl")
# (served variant, in-process drafter): served as trained, then the negative controls.
TRUE_PAIRS = (("final", "final"), ("early", "early"), ("sliding", "sliding"), ("weak", "weak"))
CONTROL_PAIRS = (("random-weights", "final"), ("taps-shifted", "final"), ("early", "final"),
                 ("sliding-rule-flipped", "sliding"), ("dead", "weak"))
FALSE_FAILURE_TARGET = 0.01
DETECTION_TARGET = 0.99
DRAFT_GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0)
TARGET_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)
PREFIX_PROMPTS_GRID = (1, 2, 3, 4)
SIGNIFICANCE_GRID = (0.001, 0.002, 0.005, 0.01, 0.02)
CONFIDENCE = 0.95     # the per-prompt false-departure rate's upper bound is taken at this confidence


# --- collect -----------------------------------------------------------------------------------------------

def collect(args: argparse.Namespace) -> Path:
    """Every piece into `work` (kept between runs: a rerun decodes only what is missing), then the bundle."""
    from dflash.stages import eval_checkpoint, with_run_dir
    from launcher_core.profile import load_profile

    run_dir = Path(args.run_dir).resolve()
    profile = with_run_dir(load_profile(args.profile), run_dir)
    final = Path(args.final or eval_checkpoint(run_dir)[0] or run_dir / "train" / "checkpoints" / "latest")
    drafters = {"final": final.resolve(), "early": run_dir / "train" / "checkpoints" / f"step-{args.early_step}"}
    if args.sliding:
        drafters["sliding"] = Path(args.sliding).resolve()
    drafters["weak"] = Path(args.weak).resolve() if args.weak else drafters["early"]
    work = Path(args.work or run_dir / "parity-gate")
    work.mkdir(parents=True, exist_ok=True)
    prompts = encoded(profile, args.prompts.split(","), args.num_prompts)
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens; drafters: "
          + ", ".join(f"{name} {path}" for name, path in drafters.items()), flush=True)
    inprocess = {name: cached(work / f"inprocess-{name}.json", lambda path=path, first=name == "final": decode_inprocess(
        profile, path, prompts, args.max_new_tokens, with_target=first)) for name, path in drafters.items()}
    records: dict[str, Any] = {"meta": meta(args, profile, drafters, prompts), "prompt_ids": [p.prompt_id for p in prompts],
                               "inprocess": {name: runs["drafter"] for name, runs in inprocess.items()},
                               "inprocess_target": inprocess["final"]["target"]}
    if not args.inprocess_only:
        records["served"] = serve_all(profile, drafters, prompts, args.max_new_tokens, work, inprocess["final"]["stops"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", encoding="utf-8") as stream:
        json.dump(records, stream)
    print(f"records: {out}")
    return out


def cached(path: Path, make: Callable[[], Any]) -> Any:
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    value = make()
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value), encoding="utf-8")
    temporary.replace(path)
    return value


def encoded(profile: Any, files: Sequence[str], count: int) -> list[Any]:
    from dflash.eval.evaluate import encode_prompts
    from dflash.tokenizer import load_tokenizer, tokenizer_dir_for

    tokenizer = load_tokenizer(tokenizer_dir_for(profile))
    prompts = [p for file in files for p in encode_prompts(tokenizer, REPO_ROOT / file, 10**6, profile.generate.thinking)]
    return prompts[:count] if count else prompts


def meta(args: argparse.Namespace, profile: Any, drafters: dict[str, Path], prompts: Sequence[Any]) -> dict[str, Any]:
    import os
    import platform

    import torch

    return {"profile": profile.name, "max_new_tokens": args.max_new_tokens, "draft_tokens": profile.eval.draft_tokens,
            "prompt_files": args.prompts, "prompts": len(prompts), "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "drafters": {name: path.name for name, path in drafters.items()}}


def decode_inprocess(profile: Any, checkpoint: Path, prompts: Sequence[Any], max_new_tokens: int,
                     with_target: bool = True) -> dict[str, Any]:
    """The drafter (and `with_target`, the target alone), every prompt, as `eval` decodes them (greedy)."""
    import torch
    from tqdm import tqdm

    from dflash.eval.dflash2_drafter import load_draft
    from dflash.eval.evaluate import cpu_threads, load_target, prepare_cpu_decoding, stop_token_ids
    from dflash.eval.specdec import DecodeSettings, NoDrafter, TargetVerifier, speculative_decode

    model, tokenizer, _ = load_target(profile)
    draft = load_draft(str(checkpoint), model, profile.eval.draft_tokens)
    prepare_cpu_decoding(profile, model, draft)
    settings = DecodeSettings(block_size=draft.block_size, max_new_tokens=max_new_tokens,
                              eos_ids=stop_token_ids(tokenizer, model))
    verifier = TargetVerifier(model, draft.layer_ids)
    runs: dict[str, Any] = {}
    with cpu_threads(model, profile.eval.cpu_threads), torch.inference_mode():
        for name, method in ((("target", NoDrafter()),) if with_target else ()) + (("drafter", draft),):
            results = [speculative_decode(verifier, method, p.token_ids, settings)
                       for p in tqdm(prompts, desc=f"in-process {checkpoint.name} {name}", unit="prompt")]
            runs[name] = [{"tokens": r.tokens, "taus": r.taus, "draft_margins": r.draft_margins,
                           "target_margins": r.target_margins} for r in results]
    runs["target"] = [run["tokens"] for run in runs.get("target", [])]
    runs["stops"] = list(settings.eos_ids)
    return runs


def serve_all(profile: Any, drafters: dict[str, Path], prompts: Sequence[Any], max_new_tokens: int,
              work: Path, stops: Sequence[int]) -> dict[str, Any]:
    """The target alone, each drafter as trained and each control, each on a fresh vLLM server."""
    from dflash.eval.controls import changed_export
    from dflash.eval.served import export_for_engine
    from dflash.target_model import resolve_model_path

    target = resolve_model_path(profile.model.target)
    exports = {name: export_for_engine("vllm", path, target, work / f"export-{name}", None)
               for name, path in drafters.items()}
    variants = {name: exports[name] for name in ("final", "early", "sliding", "weak") if name in exports}
    variants["random-weights"] = changed(exports["final"], "random-weights", work, changed_export)
    variants["taps-shifted"] = changed(exports["final"], "taps-shifted", work, changed_export)
    if "sliding" in exports:
        variants["sliding-rule-flipped"] = changed(exports["sliding"], "sliding-rule-flipped", work, changed_export)
    variants["dead"] = changed(exports["weak"], "dead", work, changed_export)
    served = {"target": cached(work / "served-target.json", lambda: serve(profile, exports["final"], prompts,
                                                                          max_new_tokens, work, "target", stops))}
    for name, directory in variants.items():
        served[name] = cached(work / f"served-{name}.json", lambda d=directory: serve(
            profile, d, prompts, max_new_tokens, work, "dflash", stops))
    return served


def changed(exported: Path, change: str, work: Path, make: Callable[..., Path]) -> Path:
    import shutil

    out = work / f"export-{change}"
    shutil.rmtree(out, ignore_errors=True)
    return make(exported, change, out)


def serve(profile: Any, drafter: Path, prompts: Sequence[Any], max_new_tokens: int, work: Path, method: str,
          stops: Sequence[int]) -> list[dict[str, Any]]:
    """One method served on every prompt, with the settings `eval --engine` sends."""
    import dataclasses

    from dflash.eval.engines import run_engines
    from dflash.eval.options import EvalOptions
    from dflash.eval.served import engine_settings
    from dflash.target_model import resolve_model_path

    target = resolve_model_path(profile.model.target)
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    settings = dataclasses.replace(engine_settings(profile, EvalOptions(max_new_tokens=max_new_tokens, temperature=0.0)),
                                   stop_token_ids=tuple(stops), block_size=block)
    print(f"serving {method} with {drafter.name} on {len(prompts)} prompts", flush=True)
    run = run_engines("vllm", profile, target, drafter, block, [p.token_ids for p in prompts], settings,
                      work / "logs", methods=(method,))[method]
    return [{"tokens": p.token_ids, "steps": p.steps, "accepted": p.accepted, "per_step": p.per_step}
            for p in run.prompts]


# --- analyse -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pair:
    """One served variant held against one in-process drafter, per prompt."""

    served: str
    inprocess: str
    served_prompts: list[PromptAcceptance]
    inprocess_prompts: list[PromptAcceptance]
    served_lossless: list[bool]
    inprocess_lossless: list[bool]

    @property
    def name(self) -> str:
        return self.served if self.served == self.inprocess else f"{self.served} for {self.inprocess}"


def load_pairs(records: dict[str, Any], pairs: Sequence[tuple[str, str]]) -> list[Pair]:
    served_target, inprocess_target = records["served"]["target"], records["inprocess_target"]
    loaded = []
    for served_name, inprocess_name in pairs:
        if served_name not in records["served"] or inprocess_name not in records["inprocess"]:
            continue
        served = [PromptAcceptance(r["tokens"], r["steps"], r["accepted"], r["per_step"])
                  for r in records["served"][served_name]]
        ours = [PromptAcceptance(r["tokens"], len(r["taus"]), sum(r["taus"]) - len(r["taus"]), [t - 1 for t in r["taus"]],
                                 r["draft_margins"], r["target_margins"]) for r in records["inprocess"][inprocess_name]]
        loaded.append(Pair(served_name, inprocess_name, served, ours,
                           [p.tokens == t["tokens"] for p, t in zip(served, served_target)],
                           [p.tokens == t for p, t in zip(ours, inprocess_target)]))
    return loaded


def prompt_sets(count: int, size: int, sets: int, seed: int) -> list[list[int]]:
    chooser = random.Random(seed)
    return [sorted(chooser.sample(range(count), size)) for _ in range(sets)]


@dataclass
class Outcome:
    """How often a pair failed the gate over the sets, and by which rule."""

    sets: int = 0
    failed: int = 0
    by_rule: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.failed / self.sets if self.sets else 0.0


def gate_on_sets(pair: Pair, sets: Sequence[Sequence[int]], constants: GateConstants) -> Outcome:
    """The production gate (parity.method_parity) on each set."""
    outcome = Outcome()
    for chosen in sets:
        served = SideFigures([pair.served_prompts[i] for i in chosen],
                             lossless=all(pair.served_lossless[i] for i in chosen))
        ours = SideFigures([pair.inprocess_prompts[i] for i in chosen],
                           lossless=all(pair.inprocess_lossless[i] for i in chosen))
        row = method_parity("dflash", served, ours, [str(i) for i in chosen], None, constants)
        outcome.sets += 1
        if row.within_tolerance is False:
            outcome.failed += 1
            for rule in row.failed_rules or []:
                outcome.by_rule[rule] = outcome.by_rule.get(rule, 0) + 1
    return outcome


@dataclass(frozen=True)
class PerPrompt:
    """The gate's per-prompt findings for one pair at one pair of margins (what the sweep combines)."""

    mismatch: list[bool]
    sign: list[int]            # served accepted per step minus in-process: -1, 0, +1
    lossless: list[bool]
    drafted: list[bool]        # the served side drafted on this prompt


def per_prompt(pair: Pair, constants: GateConstants) -> PerPrompt:
    signs = []
    for theirs, ours in zip(pair.served_prompts, pair.inprocess_prompts):
        difference = 0.0 if theirs.rate is None or ours.rate is None else theirs.rate - ours.rate
        signs.append((difference > 0) - (difference < 0))
    return PerPrompt([prefix_mismatch(s, o, constants) is not None for s, o in zip(pair.served_prompts,
                                                                                   pair.inprocess_prompts)],
                     signs, pair.served_lossless, [s.steps > 0 for s in pair.served_prompts])


def sweep_rate(found: PerPrompt, sets: Any, prefix_prompts: int, significance: float) -> float:
    """The share of sets the gate fails, combining the per-prompt findings as Verdict does (`sets`: an array of
    prompt indices, a row a set)."""
    import numpy as np

    mismatch, sign = np.asarray(found.mismatch)[sets], np.asarray(found.sign)[sets]
    fewer, more = (sign < 0).sum(axis=1), (sign > 0).sum(axis=1)
    p_values = _sign_table(sets.shape[1])[fewer, more]
    failed = ((mismatch.sum(axis=1) >= prefix_prompts) | ~np.asarray(found.lossless)[sets].all(axis=1)
              | ~np.asarray(found.drafted)[sets].any(axis=1) | (p_values < significance))
    return float(failed.mean())


def _sign_table(size: int) -> Any:
    import numpy as np

    return np.array([[sign_test(f, m) if f + m <= size else 1.0 for m in range(size + 1)] for f in range(size + 1)])


@dataclass(frozen=True)
class Departure:
    """Where a drafter served as trained first departed from its in-process decoding, and the margins there."""

    pair: str
    prompt: str
    step: int
    draft_margin: Optional[float]
    target_margin: Optional[float]
    tokens_differ: bool


def departures(pair: Pair, ids: Sequence[str]) -> list[Departure]:
    found = []
    for prompt_id, theirs, ours in zip(ids, pair.served_prompts, pair.inprocess_prompts):
        assert theirs.per_step is not None and ours.per_step is not None
        step = next((k for k, (a, b) in enumerate(zip(theirs.per_step, ours.per_step)) if a != b), None)
        if step is None and len(theirs.per_step) != len(ours.per_step):
            step = min(len(theirs.per_step), len(ours.per_step))
        committed = 1 + sum(a + 1 for a in ours.per_step[: (step or len(ours.per_step)) + 1])
        token_step = None
        if theirs.tokens[:committed] != ours.tokens[:committed]:
            position = next((k for k, (a, b) in enumerate(zip(theirs.tokens, ours.tokens)) if a != b),
                            min(len(theirs.tokens), len(ours.tokens)))
            token_step = step_of_token(ours.per_step, position)
        first = min(s for s in (step, token_step) if s is not None) if (step, token_step) != (None, None) else None
        if first is None or first >= len(ours.per_step):
            continue
        found.append(Departure(pair.name, prompt_id, first, _at(ours.draft_margins, first), _at(ours.target_margins, first),
                               token_step is not None and token_step <= first))
    return found


def step_of_token(per_step: Sequence[int], position: int) -> int:
    """The step that committed new token `position` (token 0 is the prefill's)."""
    committed = 1
    for step, accepted in enumerate(per_step):
        committed += accepted + 1
        if position < committed:
            return step
    return len(per_step)


def _at(values: Sequence[Optional[float]], index: int) -> Optional[float]:
    return values[index] if index < len(values) else None


@dataclass(frozen=True)
class Candidate:
    """One setting of the constants and what it measured."""

    constants: GateConstants
    false_failure: float          # the worst true drafter's share of sets failed
    detection: float              # the worst control's share of sets failed
    departures: int               # prompts of the true drafters that departed before their first near-tie ...
    prompts: int                  # ... of these many
    bound: float                  # P(at least prefix_prompts such prompts in a set) at the rate's upper bound

    @property
    def eligible(self) -> bool:
        return self.false_failure <= FALSE_FAILURE_TARGET / 2 and self.bound <= FALSE_FAILURE_TARGET / 2


def upper_rate(events: int, trials: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided upper confidence bound of a binomial rate (Clopper-Pearson), by bisection."""
    low, high = events / trials, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if binomial_at_most(events, trials, middle) > 1 - confidence:
            low = middle
        else:
            high = middle
    return high


def binomial_at_most(k: int, n: int, rate: float) -> float:
    return sum(math.comb(n, i) * rate ** i * (1 - rate) ** (n - i) for i in range(k + 1))


def choose_constants(candidates: Sequence[Candidate]) -> Candidate:
    """Among the eligible settings (the worst true drafter's measured false-failure rate at most half the
    target, and at most half the target for `prefix_prompts` false departures in a set at the per-prompt
    rate's upper bound: the measured rate is in-sample, so a departure the records missed must not sink it)
    that reach the detection target on every control, the one with the smallest such bound (the widest
    margin for false failures), then the higher detection, then the smaller significance. Where none reaches
    the detection target: the eligible one with the highest detection."""
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        raise SystemExit("no setting of the constants meets the false-failure target on these records")
    detecting = [c for c in eligible if c.detection >= DETECTION_TARGET]
    if detecting:
        return min(detecting, key=lambda c: (c.bound, -c.detection, c.constants.significance))
    return max(eligible, key=lambda c: (c.detection, -c.bound, -c.constants.significance))


def old_rule_fails(pair: Pair, chosen: Sequence[int], block_size: int) -> bool:
    """The gate before this one, on one set: gain within max(0.10 x gain, 3 SE), served gain >= 0.9 x in-process
    gain, lossless, and a prompt with identical tokens equal in steps and accepted drafts except one step and
    B - 1 drafts per drafter near-tie step (drafter margin < 0.25)."""
    served = [pair.served_prompts[i] for i in chosen]
    ours = [pair.inprocess_prompts[i] for i in chosen]
    if not all(pair.served_lossless[i] for i in chosen):
        return True
    for theirs, mine in zip(served, ours):
        ties = sum(1 for m in mine.draft_margins if m is not None and m < 0.25)
        if theirs.tokens == mine.tokens and (theirs.steps, theirs.accepted) != (mine.steps, mine.accepted):
            if not (ties and abs(theirs.steps - mine.steps) <= ties
                    and abs(theirs.accepted - mine.accepted) <= ties * (block_size - 1)):
                return True
    tau = lambda prompts: 1 + sum(p.accepted for p in prompts) / max(1, sum(p.steps for p in prompts))  # noqa: E731
    errors = [_standard_error([a for p in side for a in (p.per_step or [])]) for side in (served, ours)]
    tolerance = max(0.10 * (tau(ours) - 1), 3 * math.sqrt(sum(e * e for e in errors)))
    return abs(tau(served) - tau(ours)) > tolerance or tau(served) - 1 < 0.9 * (tau(ours) - 1)


def _standard_error(values: Sequence[int]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def analyse(path: Path, sets_count: int, size: int, seed: int) -> int:
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        records = json.load(stream)
    ids = records["prompt_ids"]
    sets = prompt_sets(len(ids), size, sets_count, seed)
    true_pairs, controls = load_pairs(records, TRUE_PAIRS), load_pairs(records, CONTROL_PAIRS)
    print(f"records: {path.name}: {len(ids)} prompts x {records['meta']['max_new_tokens']} new tokens, "
          f"{sets_count} sets of {size} distinct prompts (seed {seed})")
    taus(true_pairs + controls)
    found = [d for pair in true_pairs for d in departures(pair, ids)]
    print_departures(found)

    import numpy as np

    candidates = sweep(true_pairs, controls, np.asarray(sets), size)
    print_sweep(candidates)
    chosen = choose_constants(candidates)
    constants = chosen.constants
    print(f"\nchosen: near-tie margins {constants.draft_logits:g} (drafter) / {constants.target_logits:g} (target) "
          f"logits, {constants.prefix_prompts} prompt(s) departing before their first near-tie, significance "
          f"{constants.significance:g}: {chosen.departures} of {chosen.prompts} true-drafter prompts departed before "
          f"their first near-tie (upper bound {upper_rate(chosen.departures, chosen.prompts):.2%}; "
          f"P(>= {constants.prefix_prompts} in {size}) <= {chosen.bound:.2%})")
    met = print_gate(true_pairs, controls, sets, constants, "the chosen constants")
    current = GateConstants()
    if current != constants:
        print(f"\nthe gate's constants in dflash/eval/parity.py ({current}) differ from the chosen ones")
        met = print_gate(true_pairs, controls, sets, current, "dflash/eval/parity.py's constants") and False
    held_out(true_pairs, controls, size, sets_count, seed)
    from launcher_core.profile import load_profile

    print_old_rule(true_pairs, controls, sets, load_profile(records["meta"]["profile"]).drafter.block_size)
    return 0 if met else 1


def restricted(pair: Pair, indices: Sequence[int]) -> Pair:
    pick = lambda values: [values[i] for i in indices]  # noqa: E731
    return Pair(pair.served, pair.inprocess, pick(pair.served_prompts), pick(pair.inprocess_prompts),
                pick(pair.served_lossless), pick(pair.inprocess_lossless))


def held_out(true_pairs: Sequence[Pair], controls: Sequence[Pair], size: int, sets_count: int, seed: int) -> None:
    """The choice checked out of sample: constants chosen on half the prompts (even / odd places), measured on
    the other half."""
    import numpy as np

    count = len(true_pairs[0].served_prompts)
    halves = (list(range(0, count, 2)), list(range(1, count, 2)))
    print("\nheld out: constants chosen on one half of the prompts, measured on the other half's sets")
    for chosen_on, measured_on in (halves, halves[::-1]):
        sets = np.asarray(prompt_sets(len(chosen_on), size, sets_count, seed))
        left = sweep([restricted(p, chosen_on) for p in true_pairs], [restricted(p, chosen_on) for p in controls],
                     sets, size)
        picked = choose_constants(left).constants
        truths = [per_prompt(restricted(p, measured_on), picked) for p in true_pairs]
        hits = [per_prompt(restricted(p, measured_on), picked) for p in controls]
        falses = [sweep_rate(f, sets, picked.prefix_prompts, picked.significance) for f in truths]
        detected = [sweep_rate(f, sets, picked.prefix_prompts, picked.significance) for f in hits]
        print(f"  chosen on {len(chosen_on)} prompts ({picked.draft_logits:g} / {picked.target_logits:g} logits, "
              f"{picked.prefix_prompts} prompts, p < {picked.significance:g}), measured on the other "
              f"{len(measured_on)}: false failures " + ", ".join(f"{p.name} {r:.2%}" for p, r in zip(true_pairs, falses))
              + "; detection " + ", ".join(f"{p.name} {r:.2%}" for p, r in zip(controls, detected)))


def taus(pairs: Sequence[Pair]) -> None:
    print("\npair                               in-process tau  served tau  prompts with equal acceptance")
    for pair in pairs:
        tau = lambda prompts: 1 + sum(p.accepted for p in prompts) / max(1, sum(p.steps for p in prompts))  # noqa: E731
        equal = sum(s.per_step == o.per_step for s, o in zip(pair.served_prompts, pair.inprocess_prompts))
        print(f"  {pair.name:<32} {tau(pair.inprocess_prompts):14.3f} {tau(pair.served_prompts):11.3f}  "
              f"{equal} of {len(pair.served_prompts)}")


def print_departures(found: Sequence[Departure]) -> None:
    print(f"\ntrue drafters: {len(found)} prompts whose served decoding departed from the in-process one; "
          "at the first departing step (margins in logits; 'target' where the tokens differ there):")
    for d in sorted(found, key=lambda d: (d.pair, d.step)):
        print(f"  {d.pair:<8} {d.prompt:<36} step {d.step + 1:>3}  drafter {_num(d.draft_margin)}  target "
              f"{_num(d.target_margin)}  {'target' if d.tokens_differ else ''}")


def _num(value: Optional[float]) -> str:
    return "    -" if value is None else f"{value:7.4f}"


def sweep(true_pairs: Sequence[Pair], controls: Sequence[Pair], sets: Any, size: int) -> list[Candidate]:
    """Every setting of the grids: the per-prompt findings once per pair of margins, combined per set."""
    candidates = []
    for draft in DRAFT_GRID:
        for target in TARGET_GRID:
            margins = GateConstants(draft, target)
            truths = [per_prompt(pair, margins) for pair in true_pairs]
            hits = [per_prompt(pair, margins) for pair in controls]
            departures, prompts = sum(sum(f.mismatch) for f in truths), sum(len(f.mismatch) for f in truths)
            rate = upper_rate(departures, prompts)
            for prefix_prompts in PREFIX_PROMPTS_GRID:
                bound = 1 - binomial_at_most(prefix_prompts - 1, size, rate)
                for significance in SIGNIFICANCE_GRID:
                    constants = GateConstants(draft, target, prefix_prompts, significance)
                    falses = [sweep_rate(f, sets, prefix_prompts, significance) for f in truths]
                    detected = [sweep_rate(f, sets, prefix_prompts, significance) for f in hits]
                    candidates.append(Candidate(constants, max(falses, default=0.0), min(detected, default=1.0),
                                                departures, prompts, bound))
    return candidates


def print_sweep(candidates: Sequence[Candidate]) -> None:
    print("\nsweep: worst false-failure rate over the true drafters / worst detection rate over the controls "
          "('*': eligible; departures: true-drafter prompts that departed before their first near-tie)")
    for prefix_prompts in PREFIX_PROMPTS_GRID:
        print(f"  failing from {prefix_prompts} departed prompt(s) in a set")
        print("    drafter  target  departures  " + "  ".join(f"p<{s:<10g}" for s in SIGNIFICANCE_GRID))
        rows: dict[tuple[float, float], list[Candidate]] = {}
        for c in candidates:
            if c.constants.prefix_prompts == prefix_prompts:
                rows.setdefault((c.constants.draft_logits, c.constants.target_logits), []).append(c)
        for (draft, target), row in rows.items():
            cells = "  ".join(f"{c.false_failure:5.3f}/{c.detection:5.3f}{'*' if c.eligible else ' '}" for c in row)
            print(f"    {draft:7g}  {target:6g}  {row[0].departures:>4} of {row[0].prompts:<4}  {cells}")


def print_gate(true_pairs: Sequence[Pair], controls: Sequence[Pair], sets: Sequence[Sequence[int]],
               constants: GateConstants, label: str) -> bool:
    """The production gate on every set; whether each target is met."""
    print(f"\nthe gate (dflash.eval.parity.method_parity) at {label}, {len(sets)} sets:")
    met = True
    for pair in true_pairs:
        outcome = gate_on_sets(pair, sets, constants)
        ok = outcome.rate <= FALSE_FAILURE_TARGET
        met &= ok
        print(f"  served as trained  {pair.name:<24} false failures {outcome.failed:>4} of {outcome.sets} = "
              f"{outcome.rate:6.2%}  (target <= {FALSE_FAILURE_TARGET:.0%}) {'ok' if ok else 'MISSED'}  {outcome.by_rule}")
    for pair in controls:
        outcome = gate_on_sets(pair, sets, constants)
        ok = outcome.rate >= DETECTION_TARGET
        met &= ok
        print(f"  negative control   {pair.name:<24} detected {outcome.failed:>4} of {outcome.sets} = "
              f"{outcome.rate:6.2%}  (target >= {DETECTION_TARGET:.0%}) {'ok' if ok else 'MISSED'}  {outcome.by_rule}")
    return met


def print_old_rule(true_pairs: Sequence[Pair], controls: Sequence[Pair], sets: Sequence[Sequence[int]],
                   block_size: int) -> None:
    print("\nthe rule before this gate on the same sets (share of sets failed):")
    for pair in [*true_pairs, *controls]:
        share = sum(old_rule_fails(pair, chosen, block_size) for chosen in sets) / len(sets)
        print(f"  {pair.name:<32} {share:6.2%}")


# --- smoke -------------------------------------------------------------------------------------------------

def smoke() -> int:
    """In-process records of one prompt with an untrained drafter of cpu-demo's shape, then `analyse` of the
    committed records on 50 sets (figures printed, not judged)."""
    from dflash.drafter.checkpoint_files import save_checkpoint
    from dflash.eval.evaluate import load_target
    from dflash.train.rank.setup import build_drafter, resolve_layer_ids
    from launcher_core.profile import load_profile

    profile = load_profile("cpu-demo")
    with tempfile.TemporaryDirectory() as scratch:
        target, _, _ = load_target(profile)
        count = target.config.num_hidden_layers
        vocab = list(range(profile.drafter.draft_vocab_size)) or None
        drafter = build_drafter(profile, target, resolve_layer_ids(profile, count), count, vocab)
        checkpoint = save_checkpoint(Path(scratch), drafter, 0, {})
        prompts = encoded(profile, PROMPT_FILES[:1], 1)
        runs = decode_inprocess(profile, checkpoint, prompts, 4)
        record = runs["drafter"][0]
        assert len(record["taus"]) == len(record["draft_margins"]) == len(record["target_margins"]), record
        print(f"in-process: {len(record['taus'])} steps, margins {record['draft_margins']} / {record['target_margins']}")
    analyse(RECORDS, 50, 16, 0)
    return 0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the smallest setting (see the module doc)")
    commands = parser.add_subparsers(dest="command")
    gather = commands.add_parser("collect", help="decode in-process and served; write the per-prompt records")
    gather.add_argument("--run-dir", required=True, help="a finished pipeline run of the profile")
    gather.add_argument("--profile", default="cpu-demo")
    gather.add_argument("--final", default="", help="the final drafter (default: the pipeline's choice)")
    gather.add_argument("--early-step", type=int, default=50,
                        help="the early checkpoint's step (kept only by a run with train.keep_checkpoints = 0: "
                             "retention keeps the newest 3 and the best by default)")
    gather.add_argument("--sliding", default="", help="a sliding-window drafter's checkpoint")
    gather.add_argument("--weak", default="", help="the weak drafter the dead one replaces (default: the early one)")
    gather.add_argument("--prompts", default=",".join(PROMPT_FILES), help="prompt files, comma-separated")
    gather.add_argument("--num-prompts", type=int, default=0, help="0: every prompt of the files")
    gather.add_argument("--max-new-tokens", type=int, default=48)
    gather.add_argument("--work", default="", help="where the pieces go (default RUN/parity-gate)")
    gather.add_argument("--out", default=str(RECORDS))
    gather.add_argument("--inprocess-only", action="store_true")
    study = commands.add_parser("analyse", help="the gate's error rates over resampled prompt sets")
    study.add_argument("records", nargs="?", default=str(RECORDS))
    study.add_argument("--sets", type=int, default=1000)
    study.add_argument("--size", type=int, default=16)
    study.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.smoke and args.command is None:
        parser.error("collect, analyse or --smoke")
    return args


def main() -> int:
    args = parse_args()
    if args.smoke:
        return smoke()
    if args.command == "collect":
        collect(args)
        return 0
    return analyse(Path(args.records), args.sets, args.size, args.seed)


if __name__ == "__main__":
    sys.exit(main())
