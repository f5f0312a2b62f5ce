"""Make the built-in prompt sets: `builtin_prompts.jsonl` (training) and `heldout_prompts.jsonl` (eval).

Deterministic (fixed seeds, no network): rerunning rewrites byte-identical files. Every prompt is
written here from templates of our own: arithmetic and word problems, short code tasks,
rewriting and instruction following, lists and definitions, and tool-calling requests with
`tools`. The held-out set is drawn from the same families with different values, and any prompt
whose text also appears in the training set is rejected, so the two never share a prompt.

    python dflash/prompts/make_prompts.py [--train 300] [--heldout 40]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
SYSTEM = "You are a helpful assistant. Answer clearly and concisely."

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun", "Kemal", "Lea", "Milo", "Noor"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "cookies", "stamps", "shells", "cards", "coins"]
TOPICS = ["photosynthesis", "a binary search", "compound interest", "the water cycle", "a hash table",
          "inflation", "plate tectonics", "recursion", "a vaccine", "supply and demand", "an API",
          "gravity", "a prime number", "version control", "the immune system", "a neural network",
          "erosion", "a database index", "the greenhouse effect", "a compiler", "democracy", "entropy",
          "a black hole", "caching", "osmosis", "a budget", "public-key encryption", "a leap year"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
              "counts the vowels in a string", "removes duplicates from a list while keeping order",
              "computes the factorial of n", "checks whether a string is a palindrome",
              "returns the largest element of a list without using max", "merges two sorted lists",
              "converts Celsius to Fahrenheit", "flattens a nested list one level deep",
              "counts word frequencies in a sentence", "returns the sum of the digits of an integer",
              "checks whether two strings are anagrams", "finds the second smallest number in a list",
              "splits a list into chunks of size k", "capitalizes the first letter of every word",
              "computes the greatest common divisor of two integers", "rotates a list by k positions",
              "returns the indices of all occurrences of a value in a list"]
LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "C", "Java"]
SENTENCES = ["the meeting has been moved to thursday because the room was double booked",
             "our new app lets you track your daily water intake and reminds you to drink",
             "the train was late again so i missed the first half of the presentation",
             "please remember to bring your own cup to the office party on friday",
             "the library will be closed for renovations during the whole month of august",
             "we are looking for volunteers to help clean up the park next saturday morning",
             "the recipe needs two eggs a cup of flour and a pinch of salt",
             "after three weeks of testing the bug turned out to be a missing semicolon",
             "the hiking trail is steep but the view from the top is worth it",
             "customers can now return items within sixty days instead of thirty"]
STYLES = ["more formal", "more friendly", "shorter", "suitable for a child", "as a bullet list",
          "in the passive voice", "as a tweet under 200 characters", "with correct capitalization and punctuation"]
LIST_ASKS = ["List {n} tips for {goal}.", "Give {n} examples of {thing}.", "Name {n} ways to {goal}."]
GOALS = ["sleeping better", "learning a new language", "saving money on groceries", "staying focused while studying",
         "reducing plastic waste", "writing clearer emails", "preparing for a job interview", "keeping houseplants alive"]
THINGS = ["renewable energy sources", "mammals that live in the ocean", "sorting algorithms", "musical instruments with strings",
          "board games for families", "programming languages", "simple machines", "uses of a spreadsheet"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Hanoi", "Cairo", "Perth", "Quito"]


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = tool("get_weather", "Current weather for a city",
               {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])
CALCULATOR = tool("calculate", "Evaluate an arithmetic expression exactly",
                  {"expression": {"type": "string"}}, ["expression"])
CONVERT = tool("convert_currency", "Convert an amount between currencies",
               {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}, ["amount", "from", "to"])
REMINDER = tool("create_reminder", "Create a reminder at a time",
                {"text": {"type": "string"}, "time": {"type": "string"}}, ["text", "time"])


def arithmetic(rng: random.Random) -> dict:
    a, b, c = rng.randint(12, 999), rng.randint(2, 99), rng.randint(2, 30)
    form = rng.choice(["What is {a} + {b} * {c}?", "Compute ({a} - {b}) * {c}. Show your steps.",
                       "What is {a} divided by {c}, rounded to two decimals?", "Is {a} divisible by {c}? Explain."])
    return {"messages": [{"role": "user", "content": form.format(a=a, b=b, c=c)}]}


def word_problem(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    item, n, k, price = rng.choice(ITEMS), rng.randint(5, 60), rng.randint(2, 9), rng.randint(2, 15)
    form = rng.choice([
        "{name} has {n} {item} and gives {k} to {other}. Then {name} buys {k} times as many as {other} got. "
        "How many {item} does {name} have now?",
        "{name} buys {n} {item} at {price} dollars each and pays with a {bill} dollar bill. How much change is left?",
        "{name} and {other} share {n} {item} so that {name} gets {k} more than {other}. How many does each get?",
        "A box holds {k} {item}. How many boxes does {name} need for {n} {item}?"])
    text = form.format(name=name, other=other, item=item, n=n, k=k, price=price, bill=(n * price // 100 + 1) * 100)
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]}


def code_task(rng: random.Random) -> dict:
    task, language = rng.choice(CODE_TASKS), rng.choice(LANGUAGES)
    form = rng.choice(["Write a {language} function that {task}.",
                       "Write a short {language} function that {task}, with one example call.",
                       "In {language}, implement a function that {task}. Keep it under 15 lines."])
    return {"messages": [{"role": "user", "content": form.format(language=language, task=task)}]}


def rewrite(rng: random.Random) -> dict:
    sentence, style = rng.choice(SENTENCES), rng.choice(STYLES)
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Rewrite this {style}: \"{sentence}\""}]}


def listing(rng: random.Random) -> dict:
    form, n = rng.choice(LIST_ASKS), rng.randint(3, 7)
    text = form.format(n=n, goal=rng.choice(GOALS), thing=rng.choice(THINGS))
    return {"prompt": text}


def definition(rng: random.Random) -> dict:
    topic = rng.choice(TOPICS)
    form = rng.choice(["Explain {t} in two sentences.", "What is {t}? Give a one-line definition and an example.",
                       "Explain {t} to a ten-year-old.", "Summarize the key idea behind {t} in three bullet points."])
    return {"prompt": form.format(t=topic)}


def tool_call(rng: random.Random) -> dict:
    city, other = rng.sample(CITIES, 2)
    a, b = rng.randint(100, 9999), rng.randint(3, 97)
    choices: list[tuple[str, list[dict]]] = [
        (f"What's the weather like in {city} right now, in celsius?", [WEATHER]),
        (f"Should I take an umbrella in {city} today?", [WEATHER, REMINDER]),
        (f"What is {a} * {b} exactly? Use the calculator.", [CALCULATOR]),
        (f"Convert {a} US dollars to euros.", [CONVERT, CALCULATOR]),
        (f"Remind me to call {rng.choice(NAMES)} at {rng.randint(1, 12)} pm.", [REMINDER]),
        (f"Is it warmer in {city} or in {other} at the moment?", [WEATHER]),
    ]
    text, tools = rng.choice(choices)
    return {"messages": [{"role": "user", "content": text}], "tools": tools}


FAMILIES: list[tuple[str, Callable[[random.Random], dict], int]] = [
    ("math", arithmetic, 2), ("word", word_problem, 2), ("code", code_task, 2), ("rewrite", rewrite, 2),
    ("list", listing, 1), ("define", definition, 1), ("tool", tool_call, 2)]


def prompt_text(record: dict) -> str:
    return record.get("prompt") or record["messages"][-1]["content"]


def make_set(prefix: str, count: int, seed: int, exclude: set[str]) -> list[dict]:
    """`count` distinct prompts, families interleaved by weight, none whose text is in `exclude`."""
    rng = random.Random(seed)
    schedule = [family for family in FAMILIES for _ in range(family[2])]
    records: list[dict] = []
    seen = set(exclude)
    while len(records) < count:
        name, make, _ = schedule[len(records) % len(schedule)]
        for _ in range(1000):
            record = make(rng)
            if prompt_text(record) not in seen:
                break
        seen.add(prompt_text(record))
        records.append({"id": f"{prefix}-{len(records):04d}-{name}", **record})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=300)
    parser.add_argument("--heldout", type=int, default=40)
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args(argv)
    train = make_set("train", args.train, seed=20240601, exclude=set())
    heldout = make_set("heldout", args.heldout, seed=777, exclude={prompt_text(r) for r in train})
    write_jsonl(args.out_dir / "builtin_prompts.jsonl", train)
    write_jsonl(args.out_dir / "heldout_prompts.jsonl", heldout)
    print(f"wrote {len(train)} training and {len(heldout)} held-out prompts to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
