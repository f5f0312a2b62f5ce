"""The eval report as records: what `eval` writes (`eval/report.json`, `eval/engine-<engine>.json`)
and what plots, `status` (through the manifest's eval entry), the pipeline and the `eval` command read.

`EvalReport.to_json` is the only place the report becomes JSON and `EvalReport.from_json` (or
`read_report`) the only place it is read back; a bad field is an InputError naming the file and the
field. Layout, version 3 (versions 1, without `report_version`, and 2 are read the same way):

    {report_version, profile, target, checkpoint, seed, prompts_file, prompt_set, max_new_tokens,
     torch_threads (in-process), served_drafter (engine evals), baseline (how target-only decoding ran),
     engine (engine evals),
     block_size, temperature, num_prompts,
     methods: {name: MethodFigures},
     prompts: [{id, prompt_tokens, methods: {name: MethodFigures}}]   (in-process),
     also_sets: [{prompt_set, prompts_file, num_prompts, report, methods, benchmark}]  (eval.also_prompts,
                 eval.benchmarks: `benchmark` names the benchmark),
     parity: {name: ParityRow}, inprocess: EvalReport without prompts  (eval --engine)}

Keys whose value is not known for a report's kind are left out (the in-process report has no
`tau_source`; an engine report no `tau_histogram`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from launcher_core.errors import InputError

TARGET = "target"
DFLASH, DFLASH_UNARY = "dflash", "dflash_unary"     # a DFlash 2 drafter: its selector's path, its unary argmax
REPORT_VERSION = 3   # 2: `report_version` written, unknown per-method keys left out instead of null; 3: the gate's
#                      paired-test fields and per-prompt rows (a version 2 report's gain-rule fields are not read)


@dataclass(frozen=True)
class MethodFigures:
    """One method's figures on one prompt set (or on one prompt, in `prompts`)."""

    mean_tau: Optional[float]              # None: the engine reported no speculative step
    tokens_per_s: float
    speedup: Optional[float]               # over target-only decoding; None: the target's rate was 0
    identical_to_target: Optional[bool]    # None: sampling, or the target itself
    new_tokens: Optional[int] = None       # None only in an `also_sets` brief
    steps: Optional[int] = None            # in-process: draft steps
    wall_s: Optional[float] = None
    tau_histogram: Optional[dict[str, int]] = None       # in-process: steps with tau = 1..B
    position_acceptance: Optional[list[float]] = None    # accepted share at block position 1..B-1
    tau_source: Optional[str] = None       # engine: who measured tau
    argv: Optional[list[str]] = None       # engine: the server's command line
    candidate_recall: Optional[list[Optional[float]]] = None     # DFlash 2: verified token among the candidates, per position
    selector_overrides: Optional[list[Optional[float]]] = None   # DFlash 2: selector's token != the unary argmax, per position

    def brief(self) -> MethodFigures:
        """What an `also_sets` entry keeps of a method."""
        return MethodFigures(self.mean_tau, self.tokens_per_s, self.speedup, self.identical_to_target,
                             position_acceptance=self.position_acceptance)

    def to_json(self) -> dict[str, object]:
        return {key: value for key, value in asdict(self).items() if key in _ALWAYS or value is not None}

    @classmethod
    def from_json(cls, data: _Fields) -> MethodFigures:
        return cls(mean_tau=data.number_or_none("mean_tau"), tokens_per_s=data.number("tokens_per_s"),
                   speedup=data.number_or_none("speedup"), identical_to_target=data.flag_or_none("identical_to_target"),
                   new_tokens=data.integer_or_none("new_tokens"), steps=data.integer_or_none("steps"),
                   wall_s=data.number_or_none("wall_s"), tau_histogram=data.counts_or_none("tau_histogram"),
                   position_acceptance=data.numbers_or_none("position_acceptance"),
                   tau_source=data.text_or_none("tau_source"), argv=data.texts_or_none("argv"),
                   candidate_recall=data.shares_or_none("candidate_recall"),
                   selector_overrides=data.shares_or_none("selector_overrides"))


_ALWAYS = ("mean_tau", "tokens_per_s", "speedup", "identical_to_target")


@dataclass(frozen=True)
class PromptFigures:
    """One prompt of an in-process report: each method's figures on it."""

    prompt_id: str
    prompt_tokens: int
    methods: dict[str, MethodFigures]

    def to_json(self) -> dict[str, object]:
        return {"id": self.prompt_id, "prompt_tokens": self.prompt_tokens, "methods": _methods_json(self.methods)}

    @classmethod
    def from_json(cls, data: _Fields) -> PromptFigures:
        return cls(data.text("id"), data.integer("prompt_tokens"), _methods(data))


@dataclass(frozen=True)
class SetBrief:
    """An extra prompt set (`eval.also_prompts`, or a benchmark of `eval.benchmarks`) as the main report
    lists it; its own report is at `report`."""

    prompt_set: Optional[str]
    prompts_file: Optional[str]
    num_prompts: int
    report: str
    methods: dict[str, MethodFigures]
    benchmark: Optional[str] = None      # gsm8k, humaneval, ... (dflash.prompts.benchmarks); None: a prompts file

    @classmethod
    def of(cls, report: EvalReport, report_path: Path, benchmark: Optional[str] = None) -> SetBrief:
        return cls(report.context.prompt_set, report.context.prompts_file, report.num_prompts, str(report_path),
                   {name: method.brief() for name, method in report.methods.items()}, benchmark)

    def to_json(self) -> dict[str, object]:
        document: dict[str, object] = {"prompt_set": self.prompt_set, "prompts_file": self.prompts_file,
                                       "num_prompts": self.num_prompts, "report": self.report,
                                       "methods": _methods_json(self.methods)}
        return {**document, "benchmark": self.benchmark} if self.benchmark else document

    @classmethod
    def from_json(cls, data: _Fields) -> SetBrief:
        return cls(data.text_or_none("prompt_set"), data.text_or_none("prompts_file"), data.integer("num_prompts"),
                   data.text("report"), _methods(data), data.text_or_none("benchmark"))

    @property
    def label(self) -> str:
        return self.prompt_set or self.prompts_file or "?"


@dataclass(frozen=True)
class Departure:
    """The step where the served drafter first accepted other drafts than in-process, before any near-tie:
    what each side did there and the margins that decided it in-process (the engine reports no logits), so a
    reader can tell the engine's kernels (a small margin) from another drafter or context (a large one)."""

    step: int                          # 1-based speculative step
    new_token: int                     # index of the step's first new token (its anchor's successor)
    served_accepted: Optional[int]     # None: the served side had no such step
    inprocess_accepted: int
    drafter_margin: Optional[float]    # in-process, the smallest lead that decided the step (specdec.draft_margin)
    target_margin: Optional[float]     # in-process, the target's smallest lead over the positions it read
    drafts: list[int]                  # the in-process drafter's proposal at that step
    target_tokens: list[int]           # the tokens the step committed in-process: the accepted drafts, then the target's

    def describe(self) -> str:
        served = "no step" if self.served_accepted is None else f"{self.served_accepted} draft(s)"
        drafted = f" of the drafts {self.drafts}" if self.drafts else ""
        return (f"step {self.step} (new token {self.new_token}): served accepted {served}, in-process "
                f"{self.inprocess_accepted}{drafted}; the target's tokens {self.target_tokens}; in-process margins "
                f"drafter {_margin(self.drafter_margin)}, target {_margin(self.target_margin)} logits")

    @classmethod
    def from_json(cls, data: _Fields) -> Departure:
        return cls(data.integer("step"), data.integer("new_token"), data.integer_or_none("served_accepted"),
                   data.integer("inprocess_accepted"), data.number_or_none("drafter_margin"),
                   data.number_or_none("target_margin"), data.integers("drafts"), data.integers("target_tokens"))


def _margin(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


@dataclass(frozen=True)
class PromptParity:
    """One prompt of a gated method, both sides: steps and accepted drafts, the in-process first near-tie
    (1-based step; None: none), how the served side departed before it (None: it did not) and, with per-step
    figures, the step where it did (`departure`)."""

    prompt_id: str
    served_steps: int
    served_accepted: int
    inprocess_steps: int
    inprocess_accepted: int
    first_near_tie: Optional[int] = None
    prefix_mismatch: Optional[str] = None
    departure: Optional[Departure] = None

    def to_json(self) -> dict[str, object]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, data: _Fields) -> PromptParity:
        departure = data.object_or_none("departure")
        return cls(data.text("prompt_id"), data.integer("served_steps"), data.integer("served_accepted"),
                   data.integer("inprocess_steps"), data.integer("inprocess_accepted"),
                   data.integer_or_none("first_near_tie"), data.text_or_none("prefix_mismatch"),
                   Departure.from_json(departure) if departure is not None else None)


@dataclass(frozen=True)
class ParityRow:
    """One method served vs decoded in-process on the same token ids (dflash/eval/parity.py fills it)."""

    served_tau: Optional[float]
    inprocess_tau: Optional[float]
    served_position_acceptance: Optional[list[float]]
    inprocess_position_acceptance: Optional[list[float]]
    served_identical_to_target: Optional[bool]
    inprocess_identical_to_target: Optional[bool]
    same_tokens_as_inprocess: bool
    first_divergence: Optional[str]
    gated: bool
    within_tolerance: Optional[bool] = None    # the gate passed; None: not gated
    served_steps: Optional[int] = None         # speculative steps counted on each side
    inprocess_steps: Optional[int] = None
    prompts_same_tokens: Optional[int] = None  # gated: prompts whose served and in-process tokens are identical
    prompts_same_acceptance: Optional[int] = None   # ... and of those, the ones accepting the same drafts every step
    steps_before_near_tie: Optional[int] = None     # gated: in-process steps the deterministic rule compared
    prompts_fewer: Optional[int] = None        # gated: prompts accepting fewer drafts per step served than in-process
    prompts_more: Optional[int] = None         # ... and more
    p_value: Optional[float] = None            # gated: the paired sign test's two-sided p
    failed_rules: Optional[list[str]] = None   # gated: the names of the rules broken (parity.RULE_*)
    failures: Optional[list[str]] = None       # gated: each rule the served drafter broke, described
    conclusive: Optional[bool] = None          # gated: the paired test can reach its significance on this many prompts
    prompts: Optional[list[PromptParity]] = None   # gated: per prompt
    verdict: Optional[str] = None              # gated: "pass", "fail" or "undecided" (parity.VERDICT_*)
    undecided: Optional[list[str]] = None      # gated: why the rules that ran cannot fail a wrong drafter here
    rules_ran: Optional[list[str]] = None      # gated: each rule applied, and on what

    def to_json(self) -> dict[str, object]:
        document = {key: value for key, value in asdict(self).items()
                    if key != "prompts" and (key in _PARITY_ALWAYS or value is not None)}
        if self.prompts is not None:
            document["prompts"] = [prompt.to_json() for prompt in self.prompts]
        return document

    @classmethod
    def from_json(cls, data: _Fields) -> ParityRow:
        prompts = [PromptParity.from_json(item) for item in data.object_list("prompts")]
        return cls(data.number_or_none("served_tau"), data.number_or_none("inprocess_tau"),
                   data.numbers_or_none("served_position_acceptance"), data.numbers_or_none("inprocess_position_acceptance"),
                   data.flag_or_none("served_identical_to_target"), data.flag_or_none("inprocess_identical_to_target"),
                   data.flag("same_tokens_as_inprocess"), data.text_or_none("first_divergence"), data.flag("gated"),
                   data.flag_or_none("within_tolerance"), served_steps=data.integer_or_none("served_steps"),
                   inprocess_steps=data.integer_or_none("inprocess_steps"),
                   prompts_same_tokens=data.integer_or_none("prompts_same_tokens"),
                   prompts_same_acceptance=data.integer_or_none("prompts_same_acceptance"),
                   steps_before_near_tie=data.integer_or_none("steps_before_near_tie"),
                   prompts_fewer=data.integer_or_none("prompts_fewer"), prompts_more=data.integer_or_none("prompts_more"),
                   p_value=data.number_or_none("p_value"), failed_rules=data.texts_or_none("failed_rules"),
                   failures=data.texts_or_none("failures"), conclusive=data.flag_or_none("conclusive"),
                   prompts=prompts or None, verdict=data.text_or_none("verdict") or _verdict_of(data),
                   undecided=data.texts_or_none("undecided"), rules_ran=data.texts_or_none("rules_ran"))


def _verdict_of(data: _Fields) -> Optional[str]:
    """A report written before the verdict field: a gated row passed or failed."""
    if not data.flag("gated"):
        return None
    return {True: "pass", False: "fail", None: None}[data.flag_or_none("within_tolerance")]


_PARITY_ALWAYS = ("served_tau", "inprocess_tau", "served_position_acceptance", "inprocess_position_acceptance",
                  "served_identical_to_target", "inprocess_identical_to_target", "same_tokens_as_inprocess",
                  "first_divergence", "gated", "within_tolerance")


@dataclass(frozen=True)
class ReportContext:
    """Where a report's figures come from; flat in the JSON, beside them. None: not known (left out)."""

    profile: Optional[str] = None
    target: Optional[str] = None
    checkpoint: Optional[str] = None
    seed: Optional[int] = None
    prompts_file: Optional[str] = None
    prompt_set: Optional[str] = None
    max_new_tokens: Optional[int] = None
    torch_threads: Optional[int] = None     # in-process: torch's thread count while decoding
    served_drafter: Optional[str] = None    # engine evals: the drafter exported for the engine
    baseline: Optional[str] = None          # how target-only decoding (the speedup's baseline) ran
    rendering: Optional[str] = None         # the prompts' mode and the training data's (dflash.eval.mode)
    mode_mismatch: Optional[str] = None     # rendered otherwise than the training data, on purpose
    engine_deviation: Optional[str] = None  # engine evals: how the engine computes the drafter otherwise than
    #                                         trained, decoded alike in-process (dflash.eval.engine_deviations)

    def to_json(self) -> dict[str, object]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, data: _Fields) -> ReportContext:
        return cls(profile=data.text_or_none("profile"), target=data.text_or_none("target"),
                   checkpoint=data.text_or_none("checkpoint"), seed=data.integer_or_none("seed"),
                   prompts_file=data.text_or_none("prompts_file"), prompt_set=data.text_or_none("prompt_set"),
                   max_new_tokens=data.integer_or_none("max_new_tokens"),
                   torch_threads=data.integer_or_none("torch_threads"), served_drafter=data.text_or_none("served_drafter"),
                   baseline=data.text_or_none("baseline"), rendering=data.text_or_none("rendering"),
                   mode_mismatch=data.text_or_none("mode_mismatch"),
                   engine_deviation=data.text_or_none("engine_deviation"))


@dataclass(frozen=True)
class EvalReport:
    """One eval of one prompt set: in-process (`engine` None, `prompts` per prompt) or served by an engine."""

    block_size: int
    temperature: float
    num_prompts: int
    methods: dict[str, MethodFigures]          # target first, then the drafting methods
    context: ReportContext = field(default_factory=ReportContext)
    engine: Optional[str] = None
    prompts: list[PromptFigures] = field(default_factory=list)
    also_sets: list[SetBrief] = field(default_factory=list)
    parity: dict[str, ParityRow] = field(default_factory=dict)
    inprocess: Optional[EvalReport] = None     # engine evals: the in-process figures of the same prompts

    def drafted(self) -> dict[str, MethodFigures]:
        """The drafting methods (all but target-only decoding)."""
        return {name: method for name, method in self.methods.items() if name != TARGET}

    def selector_lift(self) -> Optional[float]:
        """A DFlash 2 drafter's selector lift: tau of its path (`dflash`) minus tau of its unary argmax
        (`dflash_unary`); None when the report has not both."""
        path, unary = self.methods.get(DFLASH), self.methods.get(DFLASH_UNARY)
        if path is None or unary is None or path.mean_tau is None or unary.mean_tau is None:
            return None
        return path.mean_tau - unary.mean_tau

    def without_prompts(self) -> EvalReport:
        return replace(self, prompts=[])

    def to_json(self) -> dict[str, object]:
        document: dict[str, object] = {"report_version": REPORT_VERSION, **self.context.to_json(),
                                       "block_size": self.block_size, "temperature": self.temperature,
                                       "num_prompts": self.num_prompts, "methods": _methods_json(self.methods)}
        optional: dict[str, object] = {
            "engine": self.engine, "prompts": [p.to_json() for p in self.prompts] or None,
            "also_sets": [s.to_json() for s in self.also_sets] or None,
            "parity": {name: row.to_json() for name, row in self.parity.items()} or None,
            "inprocess": self.inprocess.to_json() if self.inprocess else None}
        return {**document, **{key: value for key, value in optional.items() if value is not None}}

    @classmethod
    def from_json(cls, document: object, source: str | Path) -> EvalReport:
        """The report in `document` (parsed JSON); InputError naming `source` and the field if it is not one."""
        return cls._read(_Fields(document, str(source), ""))

    @classmethod
    def _read(cls, data: _Fields) -> EvalReport:
        version = data.integer_or_none("report_version") or 1
        if version > REPORT_VERSION:
            raise data.error("report_version", f"a version up to {REPORT_VERSION} (written by a newer launcher.py)")
        inprocess = data.object_or_none("inprocess")
        return cls(block_size=data.integer("block_size"), temperature=data.number("temperature"),
                   num_prompts=data.integer("num_prompts"), methods=_methods(data),
                   context=ReportContext.from_json(data), engine=data.text_or_none("engine"),
                   prompts=[PromptFigures.from_json(item) for item in data.object_list("prompts")],
                   also_sets=[SetBrief.from_json(item) for item in data.object_list("also_sets")],
                   parity={name: ParityRow.from_json(row) for name, row in data.objects("parity").items()},
                   inprocess=cls._read(inprocess) if inprocess else None)

    def write_json(self, path: Path) -> Path:
        """Written atomically (temp file, then rename)."""
        from launcher_core.fileio import write_json_atomic

        return write_json_atomic(path, self.to_json())


def read_report(path: str | Path) -> EvalReport:
    """`eval/report.json` (or an engine report) -> EvalReport; InputError naming the file and field."""
    from launcher_core.fileio import read_json

    return EvalReport.from_json(read_json(path), path)


def _methods_json(methods: dict[str, MethodFigures]) -> dict[str, object]:
    return {name: method.to_json() for name, method in methods.items()}


def _methods(data: _Fields) -> dict[str, MethodFigures]:
    """`methods`, target-only decoding first (the file's keys are sorted: the order the tables use)."""
    entries = sorted(data.objects("methods").items(), key=lambda item: item[0] != TARGET)
    methods = {name: MethodFigures.from_json(method) for name, method in entries}
    if not methods:
        raise data.error("methods", "an object with one entry per method (target, dflash, ...)")
    return methods


_MISSING = object()


class _Fields:
    """One JSON object of a report, read field by field: a field of the wrong type (or a required one
    missing) raises InputError naming the file and the field's path (`methods.dflash.mean_tau`)."""

    def __init__(self, data: object, source: str, where: str):
        self.source, self.where = source, where
        if not isinstance(data, dict):
            raise InputError(f"{source}: {('field ' + where) if where else 'the document'}: expected a JSON object, "
                             f"got {_shown(data)}; is it an eval report (eval/report.json)?")
        self.data: dict[str, object] = data

    def error(self, key: str, wanted: str) -> InputError:
        value = self.data.get(key, _MISSING)
        got = "it is missing" if value is _MISSING else f"got {_shown(value)}"
        return InputError(f"{self.source}: field {self._path(key)}: expected {wanted}, {got}; an eval report of "
                          "this launcher.py is needed (run `launcher.py eval` again to rewrite it)")

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _optional(self, key: str) -> object:
        return self.data.get(key)

    def number_or_none(self, key: str) -> Optional[float]:
        value = self._optional(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, "a number or null")
        return float(value)

    def number(self, key: str) -> float:
        value = self.number_or_none(key)
        if value is None:
            raise self.error(key, "a number")
        return value

    def integer_or_none(self, key: str) -> Optional[int]:
        value = self._optional(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, "a whole number or null")
        return value

    def integer(self, key: str) -> int:
        value = self.integer_or_none(key)
        if value is None:
            raise self.error(key, "a whole number")
        return value

    def text_or_none(self, key: str) -> Optional[str]:
        value = self._optional(key)
        if value is not None and not isinstance(value, str):
            raise self.error(key, "a string or null")
        return value

    def text(self, key: str) -> str:
        value = self.text_or_none(key)
        if value is None:
            raise self.error(key, "a string")
        return value

    def flag_or_none(self, key: str) -> Optional[bool]:
        value = self._optional(key)
        if value is not None and not isinstance(value, bool):
            raise self.error(key, "true, false or null")
        return value

    def flag(self, key: str) -> bool:
        value = self.flag_or_none(key)
        if value is None:
            raise self.error(key, "true or false")
        return value

    def integers(self, key: str) -> list[int]:
        """A list of whole numbers (token ids); missing: none."""
        value = self._optional(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.error(key, "a list of whole numbers")
        return list(value)

    def numbers_or_none(self, key: str) -> Optional[list[float]]:
        value = self._optional(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise self.error(key, "a list of numbers or null")
        return [float(v) for v in value]

    def shares_or_none(self, key: str) -> Optional[list[Optional[float]]]:
        """A list of numbers, each possibly null (a position nothing was counted at)."""
        value = self._optional(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                                  for v in value):
            raise self.error(key, "a list of numbers (or nulls) or null")
        return [None if v is None else float(v) for v in value]

    def texts_or_none(self, key: str) -> Optional[list[str]]:
        value = self._optional(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "a list of strings or null")
        return list(value)

    def counts_or_none(self, key: str) -> Optional[dict[str, int]]:
        value = self._optional(key)
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
            raise self.error(key, "an object of whole numbers (tau -> steps) or null")
        return {str(k): int(v) for k, v in value.items()}

    def object_or_none(self, key: str) -> Optional[_Fields]:
        value = self._optional(key)
        return None if value is None else _Fields(value, self.source, self._path(key))

    def objects(self, key: str) -> dict[str, _Fields]:
        """An object of objects (`methods`, `parity`); missing: none."""
        value = self._optional(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(key, "an object")
        return {str(name): _Fields(item, self.source, f"{self._path(key)}.{name}") for name, item in value.items()}

    def object_list(self, key: str) -> list[_Fields]:
        """A list of objects (`prompts`, `also_sets`); missing: none."""
        value = self._optional(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, "a list")
        return [_Fields(item, self.source, f"{self._path(key)}[{index}]") for index, item in enumerate(value)]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
