"""Requires-Dist of the GOOD and BAD versions of the changed packages: what couples them.

Where it is read, first hit wins:

1. the cache (`WORK_DIR/metadata.json`, written by a bisect run, so a resumed bisect groups
   exactly as the first run did even when the index is out of reach);
2. local files: every `--find-links` directory (and `name @ file://` pins) is searched for a
   wheel (`*.dist-info/METADATA`) or an sdist (`PKG-INFO`, trusted only from Metadata-Version
   2.2 on and when Requires-Dist is not declared Dynamic) of that name and version;
3. the index, unless `--no-index` or `--offline`: `pip install --dry-run --no-deps --report`
   resolves each pin the way the installer would and reports the metadata of the file it chose;
   where the index serves metadata files (PEP 658) no wheel is downloaded.

A package whose metadata is found nowhere is reported as unreadable; `changes.group_changes`
then falls back to the hard-coded families for it.
"""
from __future__ import annotations

import email.message
import email.parser
import json
import re
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional
from urllib.parse import unquote, urlparse

from envcheck.bisect.reqsets import Pin
from envcheck.bisect.venvs import InstallerOptions, installer_env
from envcheck.packages import normalize
from launcher_core.fileio import write_json_atomic

TRUSTED_SDIST_METADATA = (2, 2)        # PEP 643: from 2.2 on, static sdist metadata is reliable


@dataclass(frozen=True)
class PackageMetadata:
    """The Requires-Dist lines of one package at one version, and where they were read."""

    name: str
    version: str
    requires: tuple[str, ...]
    source: str                        # "wheel plug-2.0-py3-none-any.whl", "index", "cache: ..."

    def to_json(self) -> dict:
        return {"requires": list(self.requires), "source": self.source}


MetadataMap = dict[tuple[str, str], PackageMetadata]     # (canonical name, pinned version) ->


def pin_key(pin: Pin) -> tuple[str, str]:
    return pin.name, pin.version


def collect_metadata(pins: Iterable[Pin], options: InstallerOptions,
                     cache_path: Optional[Path] = None) -> MetadataMap:
    """Metadata for every pin that has some: cache, then local files, then the index."""
    wanted = {pin_key(pin): pin for pin in pins}
    found = read_cache(cache_path, wanted) if cache_path else {}
    found.update(read_local(_missing(wanted, found), options.find_links))
    if not (options.no_index or options.offline):
        found.update(read_index(_missing(wanted, found), options))
    return found


def _missing(wanted: dict[tuple[str, str], Pin], found: MetadataMap) -> list[Pin]:
    return [pin for key, pin in wanted.items() if key not in found]


def save_cache(cache_path: Path, metadata: MetadataMap) -> None:
    document = {f"{name}=={version}": entry.to_json() for (name, version), entry in sorted(metadata.items())}
    write_json_atomic(cache_path, document)


def read_cache(cache_path: Path, wanted: dict[tuple[str, str], Pin]) -> MetadataMap:
    try:
        document = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    found: MetadataMap = {}
    for key in wanted:
        entry = document.get(f"{key[0]}=={key[1]}") if isinstance(document, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("requires"), list):
            found[key] = PackageMetadata(key[0], key[1], tuple(entry["requires"]), str(entry.get("source", "cache")))
    return found


# -- local files ---------------------------------------------------------------------------------

def read_local(pins: list[Pin], find_links: Iterable[str]) -> MetadataMap:
    """Metadata of the pins found as files in local find-links directories or `@ file://` pins."""
    files = [path for link in find_links for path in _local_files(link)]
    found: MetadataMap = {}
    for pin in pins:
        candidates = _direct_file(pin) or [path for path in files if _file_matches(path, pin)]
        for path in sorted(candidates, key=_preference):
            requires = read_file_requires(path)
            if requires is not None:
                found[pin_key(pin)] = PackageMetadata(pin.name, pin.version, requires, f"{_kind(path)} {path.name}")
                break
    return found


def _local_files(link: str) -> list[Path]:
    parsed = urlparse(link)
    if parsed.scheme not in ("", "file"):
        return []
    directory = Path(unquote(parsed.path) if parsed.scheme else link)
    return sorted(directory.iterdir()) if directory.is_dir() else []


def _direct_file(pin: Pin) -> list[Path]:
    if not pin.version.startswith("@ file://"):
        return []
    path = Path(unquote(urlparse(pin.version[2:]).path))
    return [path] if path.is_file() else []


def _file_matches(path: Path, pin: Pin) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    parsed = parse_dist_filename(path.name)
    if parsed is None or parsed[0] != pin.name:
        return False
    try:
        return SpecifierSet(f"=={pin.version}").contains(parsed[1], prereleases=True)
    except InvalidSpecifier:
        return False


def parse_dist_filename(filename: str) -> Optional[tuple[str, str]]:
    """(canonical name, version) of a wheel or sdist file name, None for anything else."""
    from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename

    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        elif filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
        else:
            return None
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return normalize(name), str(version)


def _kind(path: Path) -> str:
    return "wheel" if path.name.endswith(".whl") else "sdist"


def _preference(path: Path) -> tuple[int, str]:
    """Wheels this interpreter can install first, then other wheels, then sdists."""
    if not path.name.endswith(".whl"):
        return 2, path.name
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    supported = set(sys_tags())
    tags = parse_wheel_filename(path.name)[3]
    return (0 if tags & supported else 1), path.name


def read_file_requires(path: Path) -> Optional[tuple[str, ...]]:
    """Requires-Dist of a wheel or sdist file; None when the file has no trustworthy metadata."""
    try:
        text = _wheel_metadata(path) if path.name.endswith(".whl") else _sdist_pkg_info(path)
    except (OSError, zipfile.BadZipFile, tarfile.TarError, UnicodeDecodeError):
        return None
    if text is None:
        return None
    message = email.parser.Parser().parsestr(text)
    if not path.name.endswith(".whl") and not _static_sdist_requires(message):
        return None
    return tuple(message.get_all("Requires-Dist") or ())


def _wheel_metadata(path: Path) -> Optional[str]:
    with zipfile.ZipFile(path) as archive:
        names = [name for name in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", name)]
        return archive.read(names[0]).decode("utf-8") if names else None


def _sdist_pkg_info(path: Path) -> Optional[str]:
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if re.fullmatch(r"[^/]+/PKG-INFO", name)]
            return archive.read(names[0]).decode("utf-8") if names else None
    with tarfile.open(path) as archive:
        members = [member for member in archive.getmembers() if re.fullmatch(r"[^/]+/PKG-INFO", member.name)]
        handle = archive.extractfile(members[0]) if members else None
        return handle.read().decode("utf-8") if handle else None


def _static_sdist_requires(message: email.message.Message) -> bool:
    try:
        version = tuple(int(part) for part in str(message.get("Metadata-Version", "0")).split(".")[:2])
    except ValueError:
        return False
    dynamic = {field.strip().lower() for field in message.get_all("Dynamic") or ()}
    return version >= TRUSTED_SDIST_METADATA and "requires-dist" not in dynamic


# -- the index -----------------------------------------------------------------------------------

def read_index(pins: list[Pin], options: InstallerOptions) -> MetadataMap:
    """Metadata the installer's index reports for the pins: one resolver call per batch of
    distinct names (GOOD's versions, then BAD's), each retried without a pin it cannot find."""
    found: MetadataMap = {}
    for batch in distinct_name_batches([pin for pin in pins if not pin.version.startswith("@")]):
        found.update(_read_index_batch(batch, options))
    return found


def distinct_name_batches(pins: list[Pin]) -> list[list[Pin]]:
    """The pins split so that no batch names a package twice (first versions first)."""
    batches: list[list[Pin]] = []
    for pin in pins:
        batch = next((b for b in batches if all(other.name != pin.name for other in b)), None)
        if batch is None:
            batches.append(batch := [])
        batch.append(pin)
    return batches


def _read_index_batch(remaining: list[Pin], options: InstallerOptions) -> MetadataMap:
    found: MetadataMap = {}
    while remaining:
        report, unknown = _dry_run_report(remaining, options)
        if report is None and unknown is None:
            return found                      # the resolver failed for no pin-specific reason
        if report is not None:
            found.update(_from_report(report, remaining))
            return found
        remaining = [pin for pin in remaining if pin.name != unknown]
    return found


def dry_run_command(pins: list[Pin], options: InstallerOptions, report: Path) -> tuple[list[str], dict[str, str]]:
    """`pip install --dry-run --no-deps --report`: resolves the pins, installs nothing."""
    argv = [options.tool_python, "-m", "pip"]
    argv += ["--python", options.base_python] if options.base_python != options.tool_python else []
    argv += ["install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", "--disable-pip-version-check",
             "--no-input", "--report", str(report)]
    argv += [arg for link in options.find_links for arg in ("--find-links", link)]
    argv += [pin.spec.split(";")[0].strip() for pin in pins]
    return argv, installer_env()


def _dry_run_report(pins: list[Pin], options: InstallerOptions) -> tuple[Optional[dict], Optional[str]]:
    """(report, None) on success, (None, name) when the index lacks that pin, (None, None) else."""
    with tempfile.TemporaryDirectory(prefix="bisect-metadata-") as scratch:
        report = Path(scratch) / "report.json"
        argv, env = dry_run_command(pins, options, report)
        try:
            completed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=options.timeout_s)
        except subprocess.TimeoutExpired:
            return None, None
        if completed.returncode == 0 and report.is_file():
            return json.loads(report.read_text(encoding="utf-8")), None
    return None, _unknown_pin(completed.stderr, pins)


def _unknown_pin(stderr: str, pins: list[Pin]) -> Optional[str]:
    match = re.search(r"(?:No matching distribution found for|satisfies the requirement) ([A-Za-z0-9._-]+)", stderr)
    name = normalize(match[1]) if match else None
    return name if name in {pin.name for pin in pins} else None


def _from_report(report: dict, pins: list[Pin]) -> MetadataMap:
    by_name = {pin.name: pin for pin in pins}
    found: MetadataMap = {}
    for item in report.get("install", []):
        metadata = item.get("metadata", {})
        pin = by_name.get(normalize(str(metadata.get("name", ""))))
        if pin is not None:
            filename = str(item.get("download_info", {}).get("url", "")).rsplit("/", 1)[-1]
            found[pin_key(pin)] = PackageMetadata(pin.name, pin.version, tuple(metadata.get("requires_dist") or ()),
                                                  f"index {filename}".strip())
    return found
