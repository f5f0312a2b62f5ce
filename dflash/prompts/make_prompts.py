"""Make the training prompts `builtin_prompts.jsonl` and the in-distribution held-out set
`indist_prompts.jsonl` from the hand-written bank in `prompt_bank.json`.

Deterministic (fixed seed, no network): rerunning rewrites byte-identical files. Every bank
entry is one distinct request (explanations, advice, word problems, code, emails and letters,
poems and stories, editing a given passage, translation, prompts in eight languages,
comparisons, lists, facts, recipes, plans, classification and extraction, conversations
already under way, tool calls). Every tenth entry of each category is held out as the
in-distribution set; the rest are the training prompts, some behind one of several system
prompts or with a closing instruction ("Please keep it short.", ...), categories interleaved so
that the first N prompts cover them all. The default evaluation set, `everyday_prompts.jsonl`,
is written by hand apart from the bank (no template, no generator shared with it).

    python dflash/prompts/make_prompts.py [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BANK = HERE / "prompt_bank.json"
SEED = 20261201
HOLD_OUT_EVERY = 10
SYSTEM_SHARE = 0.3
NO_SUFFIX = {"translate", "multilingual", "classify", "edit"}


@dataclass(frozen=True)
class PromptBank:
    """The hand-written bank (`prompt_bank.json`): plain requests by category, conversations
    already under way, tool-call requests with the tools they may use, system prompts and
    closing instructions."""

    categories: dict[str, list[str]]
    conversations: list[list[str]]
    tool_requests: list[dict]
    tools: dict[str, dict]
    systems: list[str]
    suffixes: list[str]


def load_bank(path: Path = BANK) -> PromptBank:
    raw = json.loads(path.read_text(encoding="utf-8"))
    tools = {entry["function"]["name"]: entry for entry in raw["tools"]}
    return PromptBank(categories=raw["categories"], conversations=raw["conversations"],
                      tool_requests=raw["tool_requests"], tools=tools, systems=raw["systems"],
                      suffixes=raw["suffixes"])


def conversation(turns: list[str]) -> list[dict]:
    """Alternating user / assistant turns, ending with the user's."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]


def bank_records(bank: PromptBank) -> dict[str, list[dict]]:
    """Every bank entry as a prompt record (no id yet), by category, in bank order."""
    records = {name: [{"messages": [{"role": "user", "content": text}]} for text in texts]
               for name, texts in bank.categories.items()}
    records["chat"] = [{"messages": conversation(turns)} for turns in bank.conversations]
    records["tool"] = [{"messages": [{"role": "user", "content": entry["text"]}],
                        "tools": [bank.tools[name] for name in entry["tools"]]} for entry in bank.tool_requests]
    return records


def split(records: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(training, held out): every HOLD_OUT_EVERY-th entry of a category, from the fifth, is held out."""
    held = {name: [r for i, r in enumerate(rs) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY // 2]
            for name, rs in records.items()}
    kept = {name: [r for i, r in enumerate(rs) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY // 2]
            for name, rs in records.items()}
    return kept, held


def vary(record: dict, category: str, rng: random.Random, bank: PromptBank) -> dict:
    """Some training prompts get a system prompt, some a closing instruction (single-turn English only)."""
    messages = [dict(m) for m in record["messages"]]
    if category not in NO_SUFFIX and category != "chat" and len(messages) == 1:
        messages[-1]["content"] += rng.choice(bank.suffixes)
    if rng.random() < SYSTEM_SHARE:
        messages.insert(0, {"role": "system", "content": rng.choice(bank.systems)})
    return {**record, "messages": messages}


def interleave(prefix: str, groups: dict[str, list[dict]]) -> list[dict]:
    """Round-robin over the categories, so any first N prompts mix them; ids `PREFIX-NNNN-CATEGORY`."""
    queues = {name: list(rs) for name, rs in groups.items()}
    out: list[dict] = []
    while any(queues.values()):
        for name, queue in queues.items():
            if queue:
                out.append({"id": f"{prefix}-{len(out):04d}-{name}", **queue.pop(0)})
    return out


def make_sets(bank: PromptBank, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    kept, held = split(bank_records(bank))
    varied = {name: [vary(r, name, rng, bank) for r in rs] for name, rs in kept.items()}
    return interleave("train", varied), interleave("indist", held)


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--bank", type=Path, default=BANK)
    args = parser.parse_args(argv)
    train, indist = make_sets(load_bank(args.bank))
    write_jsonl(args.out_dir / "builtin_prompts.jsonl", train)
    write_jsonl(args.out_dir / "indist_prompts.jsonl", indist)
    print(f"wrote {len(train)} training and {len(indist)} in-distribution held-out prompts to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
