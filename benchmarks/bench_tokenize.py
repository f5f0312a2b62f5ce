"""Tokenize throughput vs the floor: one `tokenizer(text)` call over the same rendered texts.

A fixed, seeded corpus of long conversations with reasoning (~1-3K tokens each; a fifth of them
multi-turn, a fifth with tool calls) is tokenized on ONE core with the real Qwen3 tokenizer and
thinking template: read + parse + render + tokenize-once + loss mask + Arrow write + inspect.
The floor is a single `tokenizer(text)` call per rendered sample text, nothing else. Target:
ours >= 0.75x the floor (i.e. building the mask never re-tokenizes prefixes). Runs alternate and
the best of each is reported, by CPU time (the judged figure: other processes on a shared machine
inflate wall time at random) and by wall time.

    .venv/bin/python benchmarks/bench_tokenize.py [--records 400] [--repeat 5] [--workers 1]
    .venv/bin/python benchmarks/bench_tokenize.py --smoke     (10 conversations, one run; the target not judged)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
TARGET_RATIO = 0.75
WORDS = ("the of and to in is that for it as with was on be by this are at from or an which but not have "
         "has we can if then so because therefore let us consider first second next finally check compute "
         "value function integral derivative matrix vector sum product prime number equation solution answer "
         "def return import class self print range len list dict None True False lambda yield async await "
         "Paris London Tokyo 2024 3.14159 42 1e-9 x y z alpha beta gamma delta = + - * / ( ) [ ] { } : ; , . ? ! "
         "naïve café résumé 北京 東京 数学 证明 проверка").split()


def prose(rng: random.Random, words: int) -> str:
    sentences, left = [], words
    while left > 0:
        size = min(left, rng.randint(6, 24))
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(size)).capitalize() + ".")
        left -= size
    return " ".join(sentences).replace(". ", ".\n", rng.randint(0, 3))


def conversation(rng: random.Random, index: int) -> dict:
    kind = index % 5
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": prose(rng, rng.randint(30, 120))}]
    record = {"id": f"bench-{index}", "finish_reason": "stop", "messages": messages}
    if kind == 3:  # tool call, then the answer
        record["tools"] = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
        call = {"type": "function", "function": {"name": "search", "arguments": json.dumps({"q": prose(rng, 5)})}}
        messages += [{"role": "assistant", "reasoning_content": prose(rng, rng.randint(200, 500)), "content": "",
                      "tool_calls": [call]},
                     {"role": "tool", "content": prose(rng, rng.randint(50, 200))}]
    if kind == 4:  # an earlier turn (its reasoning is dropped from history by the template)
        messages += [{"role": "assistant", "reasoning_content": prose(rng, rng.randint(150, 400)),
                      "content": prose(rng, 60)}, {"role": "user", "content": prose(rng, 40)}]
    messages.append({"role": "assistant", "reasoning_content": prose(rng, rng.randint(500, 1500)),
                     "content": prose(rng, rng.randint(80, 400))})
    return record


def write_corpus(path: Path, records: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as handle:
        for index in range(records):
            handle.write(json.dumps(conversation(rng, index), ensure_ascii=False) + "\n")
    return path


def pin_to_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"pinned to core {core}"
    return "not pinned"


def rendered_texts(tokenizer, corpus: Path, profile) -> list[str]:
    from dflash.data.chat_render import ChatRenderer
    from dflash.data.conversations import parse_record

    renderer = ChatRenderer(tokenizer, profile.generate.thinking, profile.data.rewritten_turns)
    lines = corpus.read_text(encoding="utf-8").splitlines()
    return [t.text for i, line in enumerate(lines) for t in renderer.render(parse_record(line, "b", i)).texts]


@dataclasses.dataclass
class Timing:
    tokens: int
    wall_s: float
    cpu_s: float


def timed(work) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = work()
    return Timing(tokens, time.perf_counter() - wall, time.process_time() - cpu)


def floor_timing(tokenizer, texts: list[str]) -> Timing:
    return timed(lambda: sum(len(tokenizer(text)["input_ids"]) for text in texts))


def ours_timing(profile, corpus: Path, output: Path, workers: int) -> Timing:
    from dflash.data.tokenize import tokenize_completions

    return timed(lambda: tokenize_completions(profile, corpus, output, workers=workers, allow_degenerate=True,
                                              progress=False).tokens)


def best_rate(timings: list[Timing], clock: str) -> float:
    return max(t.tokens / getattr(t, clock) for t in timings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1, help="1 = the one-core figure the target is about")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting: 10 conversations, one run")
    args = parser.parse_args()
    if args.smoke:
        args.records, args.repeat = 10, 1
    from dflash.data.tokenize import load_tokenizer, tokenizer_identity
    from dflash.target_model import qwen3_tokenizer_dir
    from launcher_core.profile import load_profile

    pinning = pin_to_one_core() if args.workers == 1 else f"{args.workers} workers"
    base = load_profile("cpu-demo")
    profile = dataclasses.replace(base, model=dataclasses.replace(base.model, tokenizer=str(qwen3_tokenizer_dir())),
                                  generate=dataclasses.replace(base.generate, thinking=True),
                                  data=dataclasses.replace(base.data, max_length=8192))
    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    tokenizer_identity(tokenizer, qwen3_tokenizer_dir())  # loaded + fingerprinted once, outside the timing
    with tempfile.TemporaryDirectory() as scratch:
        corpus = write_corpus(Path(scratch) / "corpus.jsonl", args.records)
        texts = rendered_texts(tokenizer, corpus, profile)
        floors, ours = [], []
        for attempt in range(args.repeat):  # alternate, so background load hits both alike
            floors.append(floor_timing(tokenizer, texts))
            ours.append(ours_timing(profile, corpus, Path(scratch) / f"ds{attempt}", args.workers))
    tokens = floors[0].tokens
    assert all(t.tokens == tokens for t in floors + ours), "ours and the floor must see the same tokens"
    print(f"corpus: {args.records} conversations, {len(texts)} samples, {tokens:,} tokens "
          f"({tokens / len(texts):,.0f} per sample); {pinning}; best of {args.repeat} alternating runs")
    ratio = 0.0
    clocks = (("cpu_s", "CPU time"), ("wall_s", "wall time")) if args.workers == 1 else (("wall_s", "wall time"),)
    for clock, label in clocks:  # with workers the work is in child processes: wall time only
        floor_tps, ours_tps = best_rate(floors, clock), best_rate(ours, clock)
        ratio = ratio or ours_tps / floor_tps
        print(f"[{label}] floor tokenizer(text) only: {floor_tps:10,.0f} tokens/s | ours parse+render+tokenize+"
              f"mask+Arrow write+inspect: {ours_tps:10,.0f} tokens/s | ratio {ours_tps / floor_tps:.2f}x")
    print(f"ratio ({clocks[0][1]}) {ratio:.2f}x of the floor, target >= {TARGET_RATIO}x: "
          f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'}")
    return 0 if ratio >= TARGET_RATIO or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
