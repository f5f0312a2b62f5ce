"""What the real-vLLM gate tests share (tests/eval/test_engine_vllm.py, test_engine_vllm_sliding.py):
the data (the target's own greedy answers to the eval prompts), the two trained drafters, the engine
profile, the demo drafter's whole `eval --engine vllm` flow (whose target-only run is also the sliding
module's losslessness reference: the same prompt token ids, stop ids and settings, checked), and
serving one variant of an export against a target-only served run and an in-process decoding. The
data, the drafters and the flow are built once per test run, by whichever pytest-xdist worker asks
first (`built_once`: a lock and a marker in the run's shared temporary folder); the other module
waits for them and reuses them, so the two modules run side by side on two workers. The fixtures are
registered for tests/eval by its conftest.py."""
from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path
from typing import Callable, Optional

import pytest

from launcher_core.profile import load_profile
from tests.generate.gen_helpers import free_port
from tests.train.conftest import write_profile

NUM_PROMPTS = 10      # the drafters train on the target's answers to the first 10 eval prompts and are decoded on
#                       them: enough for the gate's paired test (it can fail from 9 prompts on) and for 4 prompts
#                       to depart before their first near-tie, the deterministic rule's count
SUBSET = 9            # a drafter served as trained passes the gate on every 9 of the 10 prompts
MAX_NEW_TOKENS = 32
DEMO_STEPS = 40       # with DEMO_RECIPE: see benchmarks/results/parity-gate-controls_cpu-2core_2026-12-02.md
SLIDING_STEPS = 40    # with DEMO_RECIPE: in-process tau 3.783 (the record named below)
# 16 anchors a row (32 before): each drafter trains in about 60 % of the CPU, with a gain the controls
# lose by far (demo 2.612, sliding 3.783 in-process; each control fails the gate:
# benchmarks/results/parity-gate-drafters-16-anchors_cpu-2core_2026-12-06.md).
ANCHORS = 16
# Both drafters' heads have 129 rows (their draft vocabulary: every distinct answer token; a head over the
# whole 49,152-token vocabulary made the sliding drafter's training 2.6x as long). Under the default warmup
# (2 of 40 steps), lr 3e-3 collapses the demo drafter onto one constant proposal (the same token at every
# position, loss stuck near the answers' unigram entropy, in-process tau 1.043); warmed up over 10 steps it
# learns. The same drafter with the whole vocabulary's head learned with the default (tau 1.794).
DEMO_RECIPE = {"warmup_ratio": 0.25}
SLIDING_WINDOW = 16
DEMO = {"num_layers": 3, "block_size": 8, "mask_token_id": 16, "target_layer_ids": [26], "init": "target",
        "draft_vocab_size": 512}
SLIDING = {"num_layers": 3, "block_size": 8, "mask_token_id": 16, "target_layer_ids": [26], "init": "target",
           "layer_types": ["sliding_attention"] * 3, "sliding_window": SLIDING_WINDOW, "draft_vocab_size": 512}


def target_greedy_rows(smollm2_dir: Path, count: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The target's own greedy answers to the eval prompts, as (tokens, loss mask) rows: a drafter trained on
    them accepts many drafts, so a served drafter that lost its training shows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.eval.evaluate import encode_prompts
    from dflash.eval.options import eval_prompts_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True).eval()
    rows = []
    for prompt in encode_prompts(tokenizer, eval_prompts_path(load_profile("cpu-demo"), None), count, False):
        ids = torch.tensor([prompt.token_ids])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
        rows.append((out, [0] * len(prompt.token_ids) + [1] * (len(out) - len(prompt.token_ids))))
    return rows


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test run's temporary folder that every xdist worker sees (its own basetemp without workers)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(root: Path, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(root / name)` once per test run whichever worker asks first; the others wait on the lock,
    then read the path it returned from the marker."""
    from launcher_core.runlock import waiting_lock

    folder, marker = root / name, root / f"{name}.built"
    with waiting_lock(root / f"{name}.lock"):
        if not marker.exists():
            shutil.rmtree(folder, ignore_errors=True)      # a build that failed in an earlier test
            folder.mkdir(parents=True)
            marker.write_text(str(build(folder)), encoding="utf-8")
        return Path(marker.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def answers(tmp_path_factory, smollm2_dir) -> Path:
    from dflash.data.dataset_io import save_token_rows

    return built_once(shared_root(tmp_path_factory), "answers", lambda folder: save_token_rows(
        folder / "data", target_greedy_rows(smollm2_dir, NUM_PROMPTS, MAX_NEW_TOKENS)))


def train(root: Path, smollm2_dir: Path, data: Path, drafter: dict, steps: int, **recipe: object) -> Path:
    """`steps` steps on the answers, the whole set each step (its target features cached after the first);
    `recipe`: [train] keys changed from these."""
    from dflash.drafter.checkpoint_files import latest_checkpoint
    from dflash.train.supervisor.launch import run_training

    profile = write_profile(root / "p.toml", smollm2_dir, data, root / "run", machine={"nproc_per_node": 1},
                            max_steps=steps, save_every_steps=steps, global_batch=NUM_PROMPTS,
                            max_micro_batch=NUM_PROMPTS, num_anchors=ANCHORS, lr=3e-3, decay_gamma=1.5, epochs=steps,
                            feature_cache=True, log_every_steps=10, drafter=drafter, **recipe)
    assert run_training(load_profile(str(profile)), run_dir=root / "run") == 0
    checkpoint = latest_checkpoint(root / "run")
    assert checkpoint is not None
    return checkpoint


@pytest.fixture(scope="module")
def demo_drafter(tmp_path_factory, smollm2_dir, answers) -> Path:
    return built_once(shared_root(tmp_path_factory), "demo-drafter",
                      lambda folder: train(folder, smollm2_dir, answers, DEMO, DEMO_STEPS, **DEMO_RECIPE))


@pytest.fixture(scope="module")
def sliding_drafter(tmp_path_factory, smollm2_dir, answers) -> Path:
    return built_once(shared_root(tmp_path_factory), "sliding-drafter",
                      lambda folder: train(folder, smollm2_dir, answers, SLIDING, SLIDING_STEPS, **DEMO_RECIPE))


def demo_flow(root: Path, profile, checkpoint: Path):
    """The whole `eval --engine vllm` flow on the demo drafter (three engine starts: target, DFlash, prompt
    lookup), its files written as `eval` writes them: (run directory, EngineEval), built once per test run."""
    def build(run_dir: Path) -> Path:
        from dflash.eval.evaluate import EvalOptions
        from dflash.eval.served import engine_eval, write_engine_reports

        result = engine_eval(profile, run_dir, checkpoint, EvalOptions(), "vllm")
        write_engine_reports(result.report, run_dir / "eval")
        (run_dir / "flow.pickle").write_bytes(pickle.dumps(result))
        return run_dir

    run_dir = built_once(root, "demo-flow", build)
    return run_dir, pickle.loads((run_dir / "flow.pickle").read_bytes())


@pytest.fixture(scope="module")
def engine_profile(vllm_python):
    """cpu-demo for the real engine: its own port, the gate's prompts and tokens, `--enforce-eager`."""
    base = load_profile("cpu-demo")
    return dataclasses.replace(base, eval=dataclasses.replace(base.eval, engine_port=free_port(),
                                                              num_prompts=NUM_PROMPTS, max_new_tokens=MAX_NEW_TOKENS),
                               generate=dataclasses.replace(base.generate, vllm_enforce_eager=True))


def inprocess_of(profile, checkpoint: Path, prompts_file: Path, context_k_norm_layer: Optional[int] = None):
    """`checkpoint`'s in-process decoding of the eval prompts, as `eval` decodes them: the target alone and
    DFlash (the method the gate compares; prompt lookup is not decoded)."""
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.served import engine_settings, inprocess_decode

    decoded = inprocess_decode(profile, checkpoint, prompts_file, NUM_PROMPTS, engine_settings(profile, EvalOptions()),
                               context_k_norm_layer, methods=("dflash",))
    assert set(decoded.tokens) == {"target", "dflash"}, "only the methods asked for are decoded"
    return decoded


def served_settings(profile, inprocess):
    """The engine's decoding settings with the in-process run's stop ids and block size."""
    from dflash.eval.evaluate import EvalOptions
    from dflash.eval.served import engine_settings

    return dataclasses.replace(engine_settings(profile, EvalOptions()), stop_token_ids=inprocess.stop_token_ids,
                               block_size=inprocess.report.block_size)


def serve_variant(profile, target_run: Callable, inprocess, checkpoint: Path, change: str, work: Path):
    """`checkpoint`'s vLLM export changed by `change` ('' = unchanged) and served alone with the drafter;
    the gate's dflash row against its in-process decoding and the engine's target-only run (`target_run`
    returns it; called once the variant has been served)."""
    from dflash.eval.controls import changed_export
    from dflash.eval.engines import run_engines
    from dflash.eval.served import export_for_engine, parity_rows
    from dflash.target_model import resolve_model_path

    settings = served_settings(profile, inprocess)
    target = resolve_model_path(profile.model.target)
    exported = export_for_engine("vllm", checkpoint, target, work, None)
    served = changed_export(exported, change, work / f"served-{change or 'as-trained'}")
    runs = run_engines("vllm", profile, target, served, settings.block_size, inprocess.prompt_ids, settings,
                       work / "logs", methods=("dflash",))
    rows = parity_rows({"target": target_run(), **runs}, inprocess, profile.model.dtype)
    return rows["dflash"], runs["dflash"]


def passes_on_every_subset(served, inprocess, ids: list[str], size: int = SUBSET) -> int:
    """The gate (parity.method_parity) on every `size` of the prompts (each decoded once per side; a subset is
    lossless where the whole set is): the number of subsets, each asserted to pass."""
    from itertools import combinations

    from dflash.eval.parity import SideFigures, method_parity

    def part(side: SideFigures, chosen: tuple[int, ...]) -> SideFigures:
        return SideFigures([side.prompts[i] for i in chosen], lossless=side.lossless)

    subsets = list(combinations(range(len(ids)), size))
    for chosen in subsets:
        row = method_parity("dflash", part(served, chosen), part(inprocess, chosen), [ids[i] for i in chosen])
        assert row.within_tolerance is True and row.conclusive is True, (chosen, row.failures)
    return len(subsets)


def assert_fails_the_gate(gate, change: str) -> None:
    """A served drafter that is not the trained one: the gate fails, naming the divergence. The deterministic
    rule sees every control, lossless or not (vLLM's output with a control drafter was once not its target-only
    output, in one of the suite's runs): on the steps before their first near-tie the served drafter accepts
    otherwise than the trained one on several prompts."""
    from dflash.eval.parity import check_parity
    from launcher_core.errors import ParityFailed

    print(f"{change}: served tau {gate.served_tau}, in-process {gate.inprocess_tau}; {gate.failures}")
    assert gate.within_tolerance is False, (gate.failures, gate.prompts)
    assert "deterministic prefix" in (gate.failed_rules or []), (gate.failures, gate.prompts)
    assert "prompts decoded differently where the same drafter must decode alike" in " | ".join(gate.failures or [])
    with pytest.raises(ParityFailed, match="the served drafter is not the trained one"):
        check_parity({"dflash": gate}, "report.json")
