"""Requirement sets: exact pins read from a requirements file, `pip freeze` output or a snapshot.

* requirements / freeze text: one `name[extras]==version` per line; comments, blank lines and
  option lines (`--index-url`, `--extra-index-url`, `--find-links`) are ignored; `-r FILE`
  includes another file (relative to this one); an environment marker after `;` is kept
  in the install spec; `name @ URL` (a direct reference in freeze output) is kept as is.
* snapshots: JSON with a `packages` mapping name -> version (a probe report works too).

Anything that is not an exact pin is an InputError naming the file, the line and the fix.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from envcheck.packages import normalize
from launcher_core.errors import InputError

RequirementSet = dict[str, "Pin"]          # canonical name -> pin
IGNORED_OPTIONS = ("--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--no-index",
                   "--pre", "--trusted-host", "--prefer-binary", "--only-binary", "--no-binary")
PIN_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[^\]]*\])?\s*"
                      r"===?\s*(?P<version>[^\s;#]+)\s*(?:;(?P<marker>[^#]*))?$")
DIRECT_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[^\]]*\])?\s*@\s*(?P<url>\S+)")


@dataclass(frozen=True)
class Pin:
    """One package at one exact version; `spec` is what the installer is given."""

    name: str           # canonical (PEP 503) name
    version: str        # "2.9.1+cu128", or "@ URL" for a direct reference
    spec: str           # "transformers[serving]==5.24.0", "torch @ file:///..."


def load_requirement_set(path: str | Path) -> RequirementSet:
    """Read a requirements file, a `pip freeze` output or a JSON snapshot into exact pins."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"{source}: file not found; give a requirements file, a `pip freeze` output "
                         "or a snapshot JSON")
    text = source.read_text(encoding="utf-8")
    if source.suffix == ".json" or text.lstrip().startswith("{"):
        return parse_snapshot(json.loads(text) if text.strip() else {}, source)
    return parse_requirements(text, source)


def parse_snapshot(document: object, source: Path) -> RequirementSet:
    packages = document.get("packages") if isinstance(document, dict) else None
    if not isinstance(packages, dict):
        raise InputError(f"{source}: a snapshot needs a `packages` object mapping name -> version")
    pins: RequirementSet = {}
    for name, value in packages.items():
        version = value.get("version") if isinstance(value, dict) else value
        if not isinstance(version, str) or not version:
            raise InputError(f"{source}: packages.{name}: expected a version string, got {value!r}")
        pins[normalize(name)] = Pin(normalize(name), version, f"{name}=={version}")
    return pins


def parse_requirements(text: str, source: Path, seen: tuple[Path, ...] = ()) -> RequirementSet:
    pins: RequirementSet = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _strip_comment(raw)
        if not line or _is_ignored_option(line):
            continue
        if line.startswith(("-r ", "--requirement ", "-c ", "--constraint ")):
            pins.update(_include(line, source, seen, number))
            continue
        pin = parse_pin_line(line, source, number)
        pins[pin.name] = pin
    return pins


def parse_pin_line(line: str, source: Path, number: int) -> Pin:
    match = PIN_LINE.match(line)
    if match:
        name, version = normalize(match["name"]), match["version"]
        spec = f"{match['name']}{match['extras'] or ''}=={version}"
        marker = (match["marker"] or "").strip()
        return Pin(name, version, f"{spec}; {marker}" if marker else spec)
    direct = DIRECT_LINE.match(line)
    if direct:
        return Pin(normalize(direct["name"]), f"@ {direct['url']}", line)
    if line.startswith(("-e ", "--editable")):
        raise InputError(f"{source}:{number}: editable install {line!r} cannot be bisected; "
                         "pin it as name==version or name @ URL")
    raise InputError(f"{source}:{number}: {line!r} is not an exact pin; bisect needs name==version "
                     "(as in `pip freeze` output) or name @ URL")


def _strip_comment(raw: str) -> str:
    line = raw.strip()
    if line.startswith("#"):
        return ""
    return re.split(r"\s+#", line, maxsplit=1)[0].strip()


def _is_ignored_option(line: str) -> bool:
    head = line.split("=", 1)[0].split()[0]
    return head in IGNORED_OPTIONS


def _include(line: str, source: Path, seen: tuple[Path, ...], number: int) -> RequirementSet:
    target = (source.parent / line.split(maxsplit=1)[1].strip()).resolve()
    if target in seen:
        raise InputError(f"{source}:{number}: {target.name} includes itself")
    if not target.is_file():
        raise InputError(f"{source}:{number}: included file {target} not found")
    return parse_requirements(target.read_text(encoding="utf-8"), target, seen + (target,))


def requirements_text(pins: RequirementSet) -> str:
    """A requirement set as a pinned requirements file, sorted by name."""
    return "".join(f"{pins[name].spec}\n" for name in sorted(pins))
