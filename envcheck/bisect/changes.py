"""GOOD vs BAD -> changes -> groups of changes that must move together.

Groups: torch moves with torchvision/torchaudio, triton and its `nvidia-*` CUDA libraries
(`nvidia-ml-py`, the NVML bindings, is independent); the FlashInfer companions
(`flashinfer-python`, `-cubin`, `-jit-cache`) move together; `--group a,b` glues more; every
other changed package is a group of its own. Groups are ordered by name, so a bisect is
reproducible and its log can be resumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from envcheck.bisect.reqsets import Pin, RequirementSet, canonical_name

TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "triton", "pytorch-triton"})
FLASHINFER_FAMILY = frozenset({"flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"})
INDEPENDENT_NVIDIA = frozenset({"nvidia-ml-py"})


@dataclass(frozen=True)
class Change:
    name: str
    old: Optional[Pin]       # None: added in BAD
    new: Optional[Pin]       # None: removed in BAD

    def describe(self) -> str:
        if self.old is None:
            return f"{self.name} (added, {self.new.version})"
        if self.new is None:
            return f"{self.name} (removed, was {self.old.version})"
        return f"{self.name} {self.old.version} -> {self.new.version}"


@dataclass(frozen=True)
class Group:
    name: str
    changes: tuple[Change, ...]

    def describe(self) -> str:
        return "; ".join(change.describe() for change in self.changes)


def diff_sets(good: RequirementSet, bad: RequirementSet) -> list[Change]:
    """Every package whose pin differs between GOOD and BAD, sorted by name."""
    names = sorted(set(good) | set(bad))
    return [Change(name, good.get(name), bad.get(name)) for name in names
            if _version(good.get(name)) != _version(bad.get(name))]


def _version(pin: Optional[Pin]) -> Optional[str]:
    return None if pin is None else pin.version


def family_of(name: str, extra_groups: list[frozenset[str]]) -> Optional[str]:
    """The group a package belongs to, or None if it moves alone."""
    for members in extra_groups:
        if name in members:
            return "+".join(sorted(members))
    if name in TORCH_FAMILY or (name.startswith("nvidia-") and name not in INDEPENDENT_NVIDIA):
        return "torch"
    if name in FLASHINFER_FAMILY:
        return "flashinfer"
    return None


def group_changes(changes: list[Change], extra_groups: list[str] = ()) -> list[Group]:
    """Changes -> groups (families together, the rest one each), ordered by group name."""
    glued = [frozenset(canonical_name(part) for part in item.split(",") if part.strip())
             for item in extra_groups]
    buckets: dict[str, list[Change]] = {}
    for change in changes:
        key = family_of(change.name, glued) or change.name
        buckets.setdefault(key, []).append(change)
    return [Group(name, tuple(buckets[name])) for name in sorted(buckets)]


def apply_groups(good: RequirementSet, groups: list[Group]) -> RequirementSet:
    """GOOD with the given groups' changes applied."""
    pins = dict(good)
    for group in groups:
        for change in group.changes:
            if change.new is None:
                pins.pop(change.name, None)
            else:
                pins[change.name] = change.new
    return pins
