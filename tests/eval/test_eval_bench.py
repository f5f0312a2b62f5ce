"""`eval --bench`: the benchmarks' prompts built and their samples chosen as z-lab's `dflash.benchmark` (PyPI
dflash 0.1.0) builds and chooses them, held against z-lab's own functions; read offline (HumanEval and MT-Bench
from their PyPI packages, the others from `--bench-dir`), refused by name when unknown or missing, and decoded
in-process with one report row per benchmark."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pytest
from test_dflash_drafter import save_random_drafter
from test_eval_command import write_eval_profile

import launcher
from dflash.prompts.benchmarks import BENCHMARKS, build_prompts, humaneval_rows, load_benchmark, mtbench_rows, select
from launcher_core.errors import ConfigError, InputError
from launcher_core.manifest import read_manifest

# z-lab's wrappers, written out by hand from its source (not through our module's constants)
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
ZLAB_PIN = "dflash==0.1.0"     # z-lab's benchmark, whose own functions the prompts and the samples are held against


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.mark.parametrize("name, row, turns", [
    ("gsm8k", {"question": "Tom has 3 apples.", "answer": "3"}, ["Tom has 3 apples." + BOXED]),
    ("math500", {"problem": "Find $x$.", "solution": "x", "answer": "1"}, ["Find $x$." + BOXED]),
    ("humaneval", {"prompt": "def f():\n", "task_id": "HumanEval/0"}, [CODE + "def f():\n\n```"]),
    ("mbpp", {"prompt": "Write a function to add.", "task_id": 2}, ["Write a function to add."]),
    ("mt-bench", {"prompt": ["First?", "Second?"]}, ["First?", "Second?"]),
])
def test_each_benchmark_wraps_its_field_as_zlab_does(name, row, turns):
    [prompt] = build_prompts(BENCHMARKS[name], [row])
    assert list(prompt.turns) == turns and prompt.prompt_id == f"{name}-0"


def test_the_datasets_and_splits_are_zlabs():
    assert {n: (b.dataset, b.config, b.split, b.field) for n, b in BENCHMARKS.items()} == {
        "gsm8k": ("openai/gsm8k", "main", "test", "question"),
        "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
        "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
        "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt"),
        "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt")}


def test_the_profile_schema_knows_the_same_names():
    from launcher_core.schema import BENCHMARK_NAMES

    assert set(BENCHMARK_NAMES) == set(BENCHMARKS)


def test_humaneval_and_mtbench_come_from_their_packages():
    humaneval = build_prompts(BENCHMARKS["humaneval"], humaneval_rows())
    assert len(humaneval) == 164
    assert humaneval[0].turns[0].startswith(CODE + "from typing import List\n\n\ndef has_close_elements(")
    assert humaneval[0].turns[0].endswith("\n```")
    mtbench = load_benchmark("mt-bench")
    assert len(mtbench) == 80 and all(len(p.turns) == 2 for p in mtbench)
    first = min(mtbench, key=lambda p: int(p.prompt_id.split("-")[-1]))
    assert first.turns == ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                           "experiences and must-see attractions.",
                           "Rewrite your previous response. Start every sentence with the letter A.")


@pytest.fixture(scope="module")
def zlab_benchmark(tmp_path_factory) -> ModuleType:
    """z-lab's `dflash/benchmark.py` from PyPI dflash 0.1.0, installed without its dependencies into a folder of
    its own and executed from its file under another module name: our package is `dflash` too, so z-lab's never
    goes on sys.path (nor into the venv). Its module imports only the standard library, requests and tqdm."""
    target = tmp_path_factory.mktemp("zlab")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                                "--target", str(target), ZLAB_PIN], capture_output=True, text=True, timeout=300)
    if installed.returncode != 0:
        pytest.skip(f"{ZLAB_PIN} cannot be installed here: {(installed.stderr.strip().splitlines() or ['?'])[-1]}")
    spec = importlib.util.spec_from_file_location("zlab_dflash_benchmark", target / "dflash" / "benchmark.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def zlab_samples(zlab: ModuleType, monkeypatch, name: str, rows: list[dict]) -> list[dict]:
    """z-lab's own `load_and_process_dataset(name)` on `rows`, offline: `datasets.load_dataset` hands them over
    once z-lab asked for our benchmark's dataset, config and split."""
    import datasets

    bench = BENCHMARKS[name]
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: asked.append((args, kwargs)) or rows)
    samples = zlab.load_and_process_dataset(name)
    assert asked == [((bench.dataset, bench.config) if bench.config else (bench.dataset,), {"split": bench.split})]
    return samples


SYNTHETIC_ROWS = {"gsm8k": [{"question": f"Tom has {i} apples.", "answer": str(i)} for i in range(40)],
                  "math500": [{"problem": f"Find ${i}x$.", "solution": "x", "answer": "1"} for i in range(40)],
                  "mbpp": [{"prompt": f"Write function {i}.", "task_id": i} for i in range(40)]}


def benchmark_rows_for(name: str) -> list[dict]:
    """The real rows of the benchmarks that ship offline; rows of the hub's shape for the others."""
    return {"humaneval": humaneval_rows, "mt-bench": mtbench_rows}.get(name, lambda: SYNTHETIC_ROWS[name])()


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_prompts_are_built_by_zlabs_own_code_the_same(zlab_benchmark, monkeypatch, name):
    """z-lab's `load_and_process_dataset` on the same rows gives the same turns, in the same order."""
    rows = benchmark_rows_for(name)
    ours = [p.turns for p in build_prompts(BENCHMARKS[name], rows)]
    assert ours == [tuple(sample["turns"]) for sample in zlab_samples(zlab_benchmark, monkeypatch, name, rows)]


@pytest.mark.parametrize("name", ["humaneval", "mt-bench", "gsm8k"])
def test_samples_are_chosen_as_zlabs_own_code_chooses_them(zlab_benchmark, monkeypatch, name):
    """z-lab's `_select_dataset` (every path of PyPI dflash 0.1.0: the rows shuffled by random.Random(42), the
    first N) on the same samples picks ours, N below, at and past the row count and N unset; its engine path
    (`_run_openai`: N + concurrency with repeats, the first N benchmarked) too while N fits the rows."""
    rows = benchmark_rows_for(name)
    prompts = build_prompts(BENCHMARKS[name], rows)
    samples = zlab_samples(zlab_benchmark, monkeypatch, name, rows)
    total = len(rows)
    for count in (1, 3, 32, total - 1, total, total + 5, None):
        chosen = zlab_benchmark._select_dataset(samples, count)
        assert [p.turns for p in select(prompts, count)] == [tuple(s["turns"]) for s in chosen], count
    for count, concurrency in ((1, 1), (3, 4), (32, 8), (total, 2)):
        served = zlab_benchmark._select_dataset(samples, count + concurrency, repeat=True)[:count]
        assert [p.turns for p in select(prompts, count)] == [tuple(s["turns"]) for s in served], count


def test_gsm8k_from_a_local_copy(tmp_path):
    folder = tmp_path / "bench" / "gsm8k"
    folder.mkdir(parents=True)
    rows = [{"question": f"Question {i}?", "answer": f"#### {i}"} for i in range(5)]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_benchmark("gsm8k", tmp_path / "bench")
    assert sorted(p.turns[0] for p in prompts) == sorted(f"Question {i}?" + BOXED for i in range(5))
    assert len(load_benchmark("gsm8k", tmp_path / "bench", count=2)) == 2


def test_a_local_copy_without_the_field_is_named(tmp_path):
    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "test.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(InputError, match="row 0 has no field 'prompt'"):
        load_benchmark("mbpp", tmp_path)


def test_missing_data_names_the_dataset_split_and_the_command(tmp_path):
    with pytest.raises(InputError) as error:
        load_benchmark("math500", tmp_path)
    message = str(error.value)
    for part in ("HuggingFaceH4/MATH-500", "split test", f"{tmp_path}/math500/test.jsonl",
                 f"datasets.load_dataset('HuggingFaceH4/MATH-500', split='test').to_json('{tmp_path}/math500/test.jsonl')",
                 f"--bench-dir {tmp_path}"):
        assert part in message


def test_unknown_benchmarks_are_refused_with_the_valid_names(tiny_qwen3_target, tmp_path, capsys):
    profile = write_eval_profile(tmp_path, tiny_qwen3_target, "num_prompts = 1")
    assert launcher.main(["eval", "--profile", str(profile), "--bench", "humaneval,humaneva1"]) == 2
    err = capsys.readouterr().err
    assert "humaneva1" in err and "valid: humaneval, mt-bench, gsm8k, math500, mbpp" in err
    profile = write_eval_profile(tmp_path, tiny_qwen3_target, 'benchmarks = ["nope"]')
    assert launcher.main(["eval", "--profile", str(profile)]) == 2
    assert "eval.benchmarks" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        from dflash.prompts.benchmarks import parse_bench_names

        parse_bench_names(",")


def test_missing_benchmark_data_ends_the_eval_before_the_target_loads(tiny_qwen3_target, tiny_qwen3_model, tmp_path, capsys):
    profile = write_eval_profile(tmp_path, tiny_qwen3_target, "num_prompts = 1")
    save_random_drafter(tmp_path / "run", tiny_qwen3_model, block_size=4)
    assert launcher.main(["eval", "--profile", str(profile), "--bench", "gsm8k", "--bench-dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "openai/gsm8k (main), split test" in err and f"{tmp_path / 'b'}/gsm8k/test.jsonl" in err
    assert not (tmp_path / "run" / "eval").exists()


def test_eval_bench_decodes_each_benchmark_into_its_own_row(tiny_qwen3_target, tiny_qwen3_model, tmp_path, capsys):
    """Two HumanEval and two MT-Bench samples (both turns: the second after the target's first answer),
    lossless, one report per benchmark and one row each per drafting method in the main report."""
    from dflash.generate.prompt_files import load_prompts

    profile = write_eval_profile(tmp_path, tiny_qwen3_target, "num_prompts = 2\nmax_new_tokens = 5")
    run_dir = tmp_path / "run"
    save_random_drafter(run_dir, tiny_qwen3_model, block_size=4)
    assert launcher.main(["eval", "--profile", str(profile), "--bench", "humaneval,mt-bench"]) == 0
    out = capsys.readouterr().out
    main = json.loads((run_dir / "eval" / "report.json").read_text())
    assert [b["benchmark"] for b in main["also_sets"]] == ["humaneval", "mt-bench"]
    chosen = {name: load_benchmark(name, count=2) for name in ("humaneval", "mt-bench")}
    for brief in main["also_sets"]:
        name = brief["benchmark"]
        report = json.loads((run_dir / "eval" / "bench" / name / "report.json").read_text())
        ids = [p.prompt_id for p in chosen[name]]
        expected = ids if name == "humaneval" else ids + [f"{i}-turn2" for i in ids]
        assert [p["id"] for p in report["prompts"]] == expected
        assert brief["num_prompts"] == len(expected)
        if name == "mt-bench":     # the second turn's conversation holds the first turn and its answer
            tokens = {p["id"]: p["prompt_tokens"] for p in report["prompts"]}
            assert all(tokens[f"{i}-turn2"] > tokens[i] + 5 for i in ids)
        sent = load_prompts(run_dir / "eval" / "bench" / name / "prompts.jsonl")
        assert [r.messages[0]["content"] for r in sent] == [p.turns[0] for p in chosen[name]]
        for method in ("dflash", "prompt_lookup"):
            figures = brief["methods"][method]
            assert figures["identical_to_target"] is True
            assert figures["mean_tau"] == report["methods"][method]["mean_tau"]
            assert len(figures["position_acceptance"]) == 3 and figures["speedup"] > 0
        assert f"benchmark {name}, {len(expected)} turns: dflash tau" in out
        assert "dflash identical to target, prompt_lookup identical to target" in out
    entry = read_manifest(run_dir)["stages"]["eval"]
    for brief in main["also_sets"]:
        stem = f"bench_{brief['benchmark']}"
        assert entry[f"{stem}_dflash_tau"] == pytest.approx(brief["methods"]["dflash"]["mean_tau"], abs=1e-3)
        assert entry[f"{stem}_dflash_lossless"] is True and entry[f"{stem}_prompt_lookup_lossless"] is True
    markdown = (run_dir / "eval" / "report.md").read_text()
    assert "## Benchmarks" in markdown
    assert sum(line.startswith(("| humaneval | 2 |", "| mt-bench | 4 |")) for line in markdown.splitlines()) == 4


def test_math500_from_a_save_to_disk_folder(tmp_path):
    import datasets

    rows = [{"problem": f"Problem {i}.", "answer": str(i)} for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "math500"))
    assert sorted(p.turns[0] for p in load_benchmark("math500", tmp_path)) == sorted(f"Problem {i}." + BOXED for i in range(3))


@pytest.mark.slow
def test_the_demo_drafter_on_humaneval_and_mtbench_is_lossless_with_a_row_each(demo_drafter, smollm2_dir, tmp_path, capsys):
    """The cpu-demo drafter (trained on SmolLM2's answers) on two HumanEval and two MT-Bench samples, in-process:
    every turn decoded lossless by DFlash and prompt lookup, one row per benchmark and method."""
    profile = write_eval_profile(tmp_path, smollm2_dir, "num_prompts = 2\nmax_new_tokens = 16\ndraft_tokens = 3")
    assert launcher.main(["eval", "--profile", str(profile), "--draft", str(demo_drafter),
                          "--bench", "humaneval,mt-bench", "--num-prompts", "2"]) == 0
    main = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert {b["benchmark"]: b["num_prompts"] for b in main["also_sets"]} == {"humaneval": 2, "mt-bench": 4}
    for brief in main["also_sets"]:
        for method in ("dflash", "prompt_lookup"):
            figures = brief["methods"][method]
            assert figures["identical_to_target"] is True and figures["mean_tau"] >= 1.0
            assert len(figures["position_acceptance"]) == 7
    assert "benchmark mt-bench, 4 turns: dflash tau" in capsys.readouterr().out
