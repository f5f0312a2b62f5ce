#!/usr/bin/env python3
"""The docs' tables of profile keys, rules, launch checks and exit codes, generated from the code.

    python scripts/gen_docs_tables.py            # rewrite the generated parts of the docs
    python scripts/gen_docs_tables.py --check    # exit 1, naming each part that differs from the code

Each generated part of a doc lies between `<!-- generated: NAME ... -->` and `<!-- end generated: NAME -->`
(the text around it is written by hand). The sources, each rule declared once:

  profile-keys       launcher_core.schema: every key's type, default, `valid` Range and meaning
  cross-field-rules  launcher_core.schema.CROSS_FIELD_RULES (the rules that need no target)
  launch-checks      dflash.train.supervisor.launch_checks.LAUNCH_CHECKS (the rules that need the target)
  exit-codes         launcher_core.errors: every EXIT_* code, EXIT_MEANINGS and the error types

tests/test_docs_tables.py runs `--check`, so a doc that disagrees with the code fails the suite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

COMMAND = "python scripts/gen_docs_tables.py"


def _cell(text: str) -> str:
    """Text for one markdown table cell: one line, `|` escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows])


def describe_type(hint: Any) -> str:
    """A field's type as a profile author writes it."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(choice) for choice in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(hint) if a is not type(None)) + " (or unset)"
    if origin in (tuple, list):
        item = [a for a in typing.get_args(hint) if a is not Ellipsis][0]
        return f"list of {describe_type(item)}" + ("s" if item in (int, float, str) else "")
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(hint, str(hint))


def describe_default(spec: dataclasses.Field) -> str:
    if spec.default is dataclasses.MISSING:
        return "(required)"
    if spec.default is None:
        return "(unset)"
    return json.dumps(list(spec.default) if isinstance(spec.default, tuple) else spec.default)


def describe_valid(dotted: str, hint: Any) -> str:
    """The key's Range, and the names of the rules between keys and launch checks that involve it."""
    from dflash.train.supervisor.launch_checks import LAUNCH_CHECKS
    from launcher_core.schema import CROSS_FIELD_RULES, RANGES

    parts = []
    if dotted in RANGES:
        listed = typing.get_origin(hint) in (tuple, list)
        integer = "integer" in describe_type(hint)
        parts.append(("each " if listed else "") + RANGES[dotted].describe(integer))
    rules = [rule.name for rule in CROSS_FIELD_RULES if dotted in rule.keys]
    checks = [check.name for check in LAUNCH_CHECKS if dotted in check.keys]
    parts += [f"rule `{name}`" for name in rules] + [f"launch check `{name}`" for name in checks]
    return "; ".join(parts)


def render_profile_keys() -> str:
    """One table per section: key, type, default, valid values and rules, meaning."""
    from launcher_core.schema import KEYS, Profile

    hints = typing.get_type_hints(Profile)
    blocks = [_table(["key", "type", "default", "meaning"],
                     [[f"`{spec.name}`", describe_type(hints[spec.name]), describe_default(spec), spec.metadata["meaning"]]
                      for spec in dataclasses.fields(Profile)
                      if spec.name != "name" and not dataclasses.is_dataclass(hints[spec.name])])]
    for part in dataclasses.fields(Profile):
        cls = hints[part.name]
        if not dataclasses.is_dataclass(cls):
            continue
        section_hints = typing.get_type_hints(cls)
        rows = [[f"`{spec.name}`", describe_type(section_hints[spec.name]), describe_default(spec),
                 describe_valid(f"{part.name}.{spec.name}", section_hints[spec.name]), spec.metadata["meaning"]]
                for spec in dataclasses.fields(cls)]
        assert all(f"{part.name}.{row[0].strip('`')}" in KEYS for row in rows)
        doc = " ".join((cls.__doc__ or "").split())
        blocks.append(f"### `[{part.name}]`\n\n{doc}\n\n" + _table(["key", "type", "default", "valid", "meaning"], rows))
    return "\n\n".join(blocks)


def render_cross_field_rules() -> str:
    from launcher_core.schema import CROSS_FIELD_RULES

    return _table(["rule", "keys", "holds"], [[f"`{rule.name}`", ", ".join(f"`{k}`" for k in rule.keys), rule.description]
                                             for rule in CROSS_FIELD_RULES])


def render_launch_checks() -> str:
    from dflash.train.supervisor.launch_checks import LAUNCH_CHECKS

    return _table(["check", "keys", "holds"], [[f"`{check.name}`", ", ".join(f"`{k}`" for k in check.keys),
                                               check.description] for check in LAUNCH_CHECKS])


def render_exit_codes() -> str:
    """Every EXIT_* code of launcher_core.errors with its meaning and the error types that end with it."""
    from launcher_core import errors

    names = {value: name for name, value in vars(errors).items() if name.startswith("EXIT_") and isinstance(value, int)}
    raised = {code: [cls.__name__ for cls in vars(errors).values() if isinstance(cls, type)
                     and issubclass(cls, errors.LauncherError) and cls is not errors.LauncherError and cls.exit_code == code]
              for code in names}
    return _table(["code", "name", "raised as", "meaning"],
                  [[str(code), f"`{names[code]}`", ", ".join(f"`{n}`" for n in raised[code]), errors.EXIT_MEANINGS[code]]
                   for code in sorted(names)])


# doc (relative to the repository root) -> its generated parts, by name.
GENERATED: dict[str, dict[str, Callable[[], str]]] = {
    "docs/profile-keys.md": {"profile-keys": render_profile_keys},
    "docs/profile-rules.md": {"cross-field-rules": render_cross_field_rules, "launch-checks": render_launch_checks},
    "docs/exit-codes.md": {"exit-codes": render_exit_codes},
}


def _region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {re.escape(name)}\b[^\n]*-->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)",
                      re.DOTALL)


def regenerated(text: str, parts: dict[str, Callable[[], str]], doc: str) -> str:
    """`text` with each generated part replaced by what the code generates now; ValueError naming a missing marker."""
    for name, render in parts.items():
        pattern = _region(name)
        if not pattern.search(text):
            raise ValueError(f"{doc}: no `<!-- generated: {name} -->` ... `<!-- end generated: {name} -->` markers")
        text = pattern.sub(lambda match: match.group(1) + "\n" + render() + "\n\n" + match.group(3), text, count=1)
    return text


def stale_parts(root: Path) -> list[str]:
    """`DOC: NAME` for each generated part under `root` that differs from what the code generates."""
    stale = []
    for doc, parts in GENERATED.items():
        path = root / doc
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        for name, render in parts.items():
            match = _region(name).search(text)
            if match is None or match.group(2) != "\n" + render() + "\n\n":
                stale.append(f"{doc}: {name}")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a generated part is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the repository whose docs are read (default: this one)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_parts(args.root)
        for part in stale:
            print(f"{part}: differs from the code; regenerate it with `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    from launcher_core.fileio import write_text_atomic

    for doc, parts in GENERATED.items():
        path = args.root / doc
        before = path.read_text(encoding="utf-8")
        try:
            after = regenerated(before, parts, doc)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if after != before:
            write_text_atomic(path, after)
            print(f"{doc}: regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
