"""Profiles: `profiles/*.toml`, loaded, merged along `extends` and validated strictly.

A profile file holds sections whose fields are the dataclasses in `launcher_core.schema`. A variant
names its base with `extends = "NAME"` and states only what differs; tables merge key by key.
An unknown key, a wrong type, a value outside its choices or its range (the field's `valid`), a
missing required value or a broken cross-field rule is a ConfigError naming the file, the key and
what would be valid.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from launcher_core.errors import ConfigError
from launcher_core.paths import REPO_ROOT, profile_dir
from launcher_core.schema import REMOVED_KEYS, Profile, Range, cross_field_problems

REQUIRED = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class ProfileSource:
    """Where each resolved key came from, for error messages: dotted key -> file."""

    name: str
    files: tuple[Path, ...]
    origin: dict[str, Path]


def list_profiles(directory: Path | None = None) -> list[str]:
    """Names of the profiles in the directory (file stems), sorted."""
    return sorted(path.stem for path in (directory or profile_dir()).glob("*.toml"))


def profile_path(name_or_path: str, directory: Path | None = None) -> Path:
    """A profile name (`rtx6000-x8`) or a path to a TOML file -> the file's path."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" and candidate.is_file():
        return candidate
    path = (directory or profile_dir()) / f"{name_or_path}.toml"
    if not path.exists() and candidate.is_dir():
        raise ConfigError(not_a_profile_file(candidate))
    if not path.exists():
        choices = ", ".join(list_profiles(directory)) or "(none)"
        raise ConfigError(f"unknown profile {name_or_path!r}; valid choices: {choices}")
    return path


def load_profile(name_or_path: str, directory: Path | None = None) -> Profile:
    """Load, merge along `extends`, and validate one profile."""
    path = profile_path(name_or_path, directory)
    merged, origin = _resolve_chain(path, directory or path.parent, seen=())
    merged.pop("extends", None)
    return _checked(_build(Profile, merged, origin, prefix="", name=path.stem), origin)


def key_origins(name_or_path: str, directory: Path | None = None) -> tuple[Path, dict[str, Path]]:
    """(the profile's own file, dotted key -> the file along its `extends` chain that sets it).

    For messages about a resolved profile: a key no file sets is the profile's own file's to set."""
    path = profile_path(name_or_path, directory)
    _, origin = _resolve_chain(path, directory or path.parent, seen=())
    return path, origin


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}: {error.object[error.start:error.start + 1]!r}); a "
                          f"profile is TOML, which is UTF-8: save it as UTF-8") from None
    except IsADirectoryError:
        raise ConfigError(not_a_profile_file(path)) from None


def not_a_profile_file(path: Path) -> str:
    return (f"{path}: a directory, not a profile; --profile takes a profile name (`launcher.py profiles` lists them) "
            f"or a TOML file")


def _resolve_chain(path: Path, directory: Path, seen: tuple[Path, ...]) -> tuple[dict, dict]:
    if path in seen:
        chain = " -> ".join(p.stem for p in (*seen, path))
        raise ConfigError(f"{path}: `extends` forms a cycle: {chain}")
    document = _read_toml(path)
    own_origin = {key: path for key in _dotted_keys(document)}
    base_name = document.get("extends")
    if base_name is None:
        return document, own_origin
    if not isinstance(base_name, str):
        raise ConfigError(f"{path}: key 'extends' must be a profile name (a string), got {base_name!r}")
    base_path = _base_profile_path(base_name, [path.parent, directory, profile_dir()])
    if base_path is None:
        choices = ", ".join(sorted({*list_profiles(path.parent), *list_profiles(directory), *list_profiles()}))
        raise ConfigError(f"{path}: key 'extends' names unknown profile {base_name!r}; valid choices: {choices}")
    base, base_origin = _resolve_chain(base_path, directory, (*seen, path))
    return _deep_merge(base, document), {**base_origin, **own_origin}


def _base_profile_path(base_name: str, folders: list[Path]) -> Path | None:
    """`extends = "NAME"`: NAME.toml next to the extending file first, then the shipped profiles."""
    for folder in dict.fromkeys(folders):
        candidate = folder / f"{base_name}.toml"
        if candidate.exists():
            return candidate
    return None


def _dotted_keys(table: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, dict):
            keys.extend(_dotted_keys(value, f"{dotted}."))
    return keys


def _deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _build(cls: type, table: dict, origin: dict[str, Path], prefix: str, name: str) -> Any:
    """Construct dataclass `cls` from `table`, checking keys, types and choices."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            if dotted in REMOVED_KEYS:
                _fail(origin, dotted, name, f"no longer a profile key: {REMOVED_KEYS[dotted]}")
            _fail(origin, dotted, name, f"unknown key; valid keys here: {', '.join(sorted(fields))}")
        values[key] = _coerce(hints[key], value, origin, dotted, name)
        _check_range(values[key], fields[key].metadata.get("valid"), origin, dotted, name)
    for field in fields.values():
        if field.name in values or field.name == "name":
            continue
        if field.default is REQUIRED and field.default_factory is REQUIRED:
            _fail(origin, f"{prefix}{field.name}", name, "required value is missing")
        if dataclasses.is_dataclass(hints[field.name]):
            values[field.name] = _build(hints[field.name], {}, origin, f"{prefix}{field.name}.", name)
    if "name" in fields:
        values["name"] = name
    return cls(**values)    # the cross-field rules run after the whole profile is built (schema.cross_field_problems)


def _coerce(hint: Any, value: Any, origin: dict, dotted: str, name: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            _fail(origin, dotted, name, f"must be a table [{dotted}], got {value!r}")
        return _build(hint, value, origin, f"{dotted}.", name)
    if _matches(hint, value):
        if isinstance(value, list):
            return tuple(value)
        return float(value) if hint is float and isinstance(value, int) else value
    _fail(origin, dotted, name, f"got {value!r}; expected {_describe(hint)}")


def _check_range(value: Any, rule: Range | None, origin: dict, dotted: str, name: str) -> None:
    """The key's Range (its field's `valid`), for a number or each number of a list."""
    if rule is None:
        return
    for item in value if isinstance(value, tuple) else (value,):
        if isinstance(item, (int, float)) and not isinstance(item, bool) and not rule.admits(item):
            shown = f"{value!r}" if not isinstance(value, tuple) else f"{item!r} in {list(value)!r}"
            _fail(origin, dotted, name, f"{shown} is out of range; valid: {rule.describe(isinstance(item, int))}")


def _matches(hint: Any, value: Any) -> bool:
    origin = get_origin(hint)
    if origin is Literal:
        return value in get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(arg, value) for arg in get_args(hint))
    if origin in (tuple, list):
        args = [a for a in get_args(hint) if a is not Ellipsis]
        return isinstance(value, list) and all(_matches(args[0], item) for item in value) if args else isinstance(value, list)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return "one of: " + ", ".join(repr(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(hint) if a is not type(None))
    if origin in (tuple, list):
        args = [a for a in get_args(hint) if a is not Ellipsis]
        return f"a list of {_describe(args[0])}" if args else "a list"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _fail(origin: dict[str, Path], dotted: str, name: str, problem: str) -> typing.NoReturn:
    where = origin.get(dotted) or origin.get(dotted.rsplit(".", 1)[0]) or f"profile {name}"
    raise ConfigError(f"{where}: key '{dotted}': {problem}")


def profile_as_dict(profile: Profile) -> dict[str, Any]:
    """The resolved profile as plain data (for `plan` and JSON output)."""
    return dataclasses.asdict(profile)


def profile_to_json(profile: Profile) -> str:
    """The resolved profile as JSON (what each torchrun rank reads back with `profile_from_json`)."""
    return json.dumps(profile_as_dict(profile), indent=2, sort_keys=True) + "\n"


def profile_from_json(path: str | Path) -> Profile:
    """The resolved profile written by `profile_to_json`, validated by the same rules as a TOML file."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    name = document.pop("name")
    origin = {key: Path(path) for key in _dotted_keys(document)}
    return _checked(_build(Profile, document, origin, prefix="", name=name), origin)


def _checked(profile: Profile, origin: dict[str, Path]) -> Profile:
    """The cross-field rules of `launcher_core.schema` (the first problem is a ConfigError)."""
    for dotted, problem in cross_field_problems(profile):
        _fail(origin, dotted, profile.name, problem)
    return profile


def expand_path(profile: Profile, template: str) -> Path:
    """Expand `{profile}` and `{run_dir}` in a profile path; relative paths are under the repo root."""
    run_dir = profile.paths.run_dir.format(profile=profile.name)
    text = template.format(profile=profile.name, run_dir=run_dir)
    path = Path(text).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path
