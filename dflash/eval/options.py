"""What an evaluation is asked (EvalOptions), what it returns (EvalSummary), and which prompts
it decodes: shared by the in-process decoder (dflash.eval.evaluate) and the engines
(dflash.eval.engines)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from launcher_core.errors import InputError
from launcher_core.profile import expand_path
from launcher_core.schema import Profile

if TYPE_CHECKING:
    from dflash.eval.report_schema import EvalReport, MethodFigures

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"
# Written by hand apart from the training prompts: no template or generator shared with them.
DEFAULT_EVAL_PROMPTS = PROMPTS_DIR / "everyday_prompts.jsonl"
# Held-out entries of the bank the training prompts come from (make_prompts.py).
INDIST_EVAL_PROMPTS = PROMPTS_DIR / "indist_prompts.jsonl"
SHIPPED_SETS = {DEFAULT_EVAL_PROMPTS: "out-of-template held-out", INDIST_EVAL_PROMPTS: "in-distribution held-out",
                PROMPTS_DIR / "builtin_prompts.jsonl": "training prompts"}


@dataclass(frozen=True)
class EvalOptions:
    checkpoint: Optional[str] = None        # step-N dir or checkpoints dir; None: the run's latest
    prompts_path: Optional[str] = None      # None: paths.eval_prompts, else the built-in held-out set
    num_prompts: Optional[int] = None       # None: eval.num_prompts
    max_new_tokens: Optional[int] = None    # None: eval.max_new_tokens
    temperature: Optional[float] = None     # None: eval.temperature
    seed: Optional[int] = None              # None: eval.seed
    engine: Optional[str] = None            # None: eval.engine (transformers = in-process; sglang / vllm: served)
    benchmarks: Optional[tuple[str, ...]] = None   # None: eval.benchmarks (dflash.prompts.benchmarks)
    bench_dir: Optional[str] = None         # local copies of gsm8k, math500, mbpp (None: eval.bench_dir)
    thinking: Optional[bool] = None         # --thinking on|off: the prompts' mode (None: generate.thinking)
    allow_mode_mismatch: bool = False       # render in another mode than the training data's (dflash.eval.mode)


@dataclass
class EvalSummary:
    report: EvalReport
    files: list[Path] = field(default_factory=list)


def eval_prompts_path(profile: Profile, override: Optional[str]) -> Path:
    if override:
        return Path(override)
    if profile.paths.eval_prompts:
        return expand_path(profile, profile.paths.eval_prompts)
    return DEFAULT_EVAL_PROMPTS


def drafted_figures(methods: dict[str, MethodFigures]) -> str:
    """`dflash tau 1.37 speedup 0.56x; prompt_lookup tau ...`: the drafting methods of one prompt set."""
    return "; ".join(f"{name} tau {m.mean_tau:.2f} speedup {m.speedup or 0:.2f}x"
                     for name, m in methods.items() if name != "target" and m.mean_tau is not None)


def also_prompt_paths(profile: Profile, override: Optional[str]) -> list[Path]:
    """`eval.also_prompts`, measured beside the default set; none when `--prompts` chose a set."""
    if override:
        return []
    paths = [expand_path(profile, path) for path in profile.eval.also_prompts]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise InputError(f"eval.also_prompts: no such prompts file: {', '.join(missing)} (give prompts JSONL files, "
                         f"relative to the repository root or absolute, or remove them from the list)")
    return paths


def prompt_set_label(path: Path) -> str:
    """What an eval's prompts are, for the report: `out-of-template held-out (everyday_prompts.jsonl)`,
    `in-distribution held-out (...)`, `training prompts (...)`, or `your prompts (NAME)`."""
    kind = SHIPPED_SETS.get(Path(path).resolve(), "your prompts")
    return f"{kind} ({Path(path).name})"


def benchmark_names(profile: Profile, options: EvalOptions) -> tuple[str, ...]:
    """`--bench`, else `eval.benchmarks`; each name checked (ConfigError listing the valid ones)."""
    from dflash.prompts.benchmarks import parse_bench_names

    names = options.benchmarks if options.benchmarks is not None else profile.eval.benchmarks
    return parse_bench_names(names) if names else ()


def bench_sample_count(profile: Profile, options: EvalOptions) -> int:
    """Samples per benchmark: `--num-prompts`, else `eval.bench_samples`, else `eval.num_prompts`."""
    return options.num_prompts or profile.eval.bench_samples or profile.eval.num_prompts


def bench_dir(profile: Profile, options: EvalOptions) -> Optional[Path]:
    if options.bench_dir:
        return Path(options.bench_dir)
    return expand_path(profile, profile.eval.bench_dir) if profile.eval.bench_dir else None


def benchmark_prompts_file(eval_dir: Path, name: str, prompts: list) -> Path:
    """The first turns of a benchmark's samples as a prompts JSONL file (`eval/bench/<name>/prompts.jsonl`):
    what the served check sends and what the report points to."""
    import json

    from dflash.prompts.benchmarks import first_turn_records
    from launcher_core.fileio import write_text_atomic

    path = eval_dir / "bench" / name / "prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in first_turn_records(prompts)))
