"""Which changed packages constrain each other, read from their Requires-Dist.

A coupling `mover -> needs` says: `mover` cannot take its BAD version while `needs` still has
its GOOD one. Two readings of the metadata give one:

* forward: mover's BAD version requires `needs` with a specifier that `needs`'s GOOD version
  violates (or `needs` is absent from GOOD: it is added by BAD);
* backward: `needs`'s GOOD version requires `mover` with a specifier that `mover`'s BAD version
  violates (or BAD removes `mover`).

Couplings in both directions (directly or around a cycle) make one group; a coupling in one
direction only is an order: `needs` is applied first and both stay separately testable.
Markers are evaluated for this interpreter, with the extras the pin asks for.

`learned_couplings` reads the same from a failed consistency check of a candidate: "A requires
B" with A applied and B not means A needs B; with B applied and A not, B needs A.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

from envcheck.bisect.metadata import MetadataMap, pin_key
from envcheck.bisect.reqsets import Pin
from envcheck.packages import normalize

if TYPE_CHECKING:
    from packaging.requirements import Requirement

    from envcheck.bisect.changes import Change


@dataclass(frozen=True)
class Coupling:
    """`mover` cannot move before (or without) `needs`; `reason` quotes the requirement."""

    mover: str
    needs: str
    reason: str
    source: str = "metadata"            # or "check": learned from an inconsistent candidate


def readable(change: "Change", metadata: MetadataMap) -> bool:
    """Both of the change's versions (the ones that exist) have metadata."""
    return all(pin_key(pin) in metadata for pin in (change.old, change.new) if pin is not None)


def requirement_couplings(changes: list["Change"], metadata: MetadataMap) -> list[Coupling]:
    """Every coupling between changed packages that their metadata shows, sorted."""
    by_name = {change.name: change for change in changes}
    found = {(c.mover, c.needs, c.reason): c for change in changes
             for c in (*_forward(change, by_name, metadata), *_backward(change, by_name, metadata))}
    return [found[key] for key in sorted(found)]


def _forward(change: "Change", by_name: dict[str, "Change"], metadata: MetadataMap) -> Iterator[Coupling]:
    """change's BAD version requires another changed package that GOOD does not satisfy."""
    for requirement, target in _requirements_on(change.new, by_name, metadata):
        old = by_name[target].old
        if old is None:
            yield Coupling(change.name, target, f"{_at(change.new)} requires {requirement} (GOOD lacks {target})")
        elif _violates(requirement, old):
            yield Coupling(change.name, target, f"{_at(change.new)} requires {requirement} (GOOD has {_at(old)})")


def _backward(change: "Change", by_name: dict[str, "Change"], metadata: MetadataMap) -> Iterator[Coupling]:
    """change's GOOD version requires another changed package that BAD moves out of range."""
    for requirement, target in _requirements_on(change.old, by_name, metadata):
        new = by_name[target].new
        if new is None:
            yield Coupling(target, change.name, f"{_at(change.old)} requires {requirement} (BAD removes {target})")
        elif _violates(requirement, new):
            yield Coupling(target, change.name, f"{_at(change.old)} requires {requirement} (BAD has {_at(new)})")


def _requirements_on(pin: Optional[Pin], by_name: dict[str, "Change"],
                     metadata: MetadataMap) -> Iterator[tuple["Requirement", str]]:
    """The pin's active requirements on other changed packages, with their canonical names."""
    if pin is None or pin_key(pin) not in metadata:
        return
    extras = _pin_extras(pin)
    for line in metadata[pin_key(pin)].requires:
        requirement = _parse(line)
        target = normalize(requirement.name) if requirement else None
        if requirement is not None and target in by_name and target != pin.name and _active(requirement, extras):
            yield requirement, target


def _parse(line: str) -> Optional["Requirement"]:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(line)
    except InvalidRequirement:
        return None


def _pin_extras(pin: Pin) -> set[str]:
    requirement = _parse(pin.spec.split(";")[0]) if not pin.version.startswith("@") else _parse(pin.spec)
    return set(requirement.extras) if requirement else set()


def _active(requirement: "Requirement", extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ({""} | extras))


def _violates(requirement: "Requirement", pin: Pin) -> bool:
    """The pinned version falls outside the requirement's specifier (unknown versions never do)."""
    from packaging.version import InvalidVersion, Version

    if pin.version.startswith("@") or not requirement.specifier:
        return False
    try:
        return not requirement.specifier.contains(Version(pin.version), prereleases=True)
    except InvalidVersion:
        return False


def learned_couplings(lines: list[str], applied: set[str], changed: set[str], step: int) -> list[Coupling]:
    """Couplings a failed check shows (`lines`: its conflict lines) for a candidate that applied
    the changes of `applied`. Conflicts a regrouping cannot fix (both or neither applied,
    unchanged packages) teach nothing."""
    from envcheck.bisect.venvs import check_conflicts

    found = []
    for line in lines:
        for package, required in check_conflicts(line):
            if package not in changed or required not in changed or (package in applied) == (required in applied):
                continue
            mover, needs = (package, required) if package in applied else (required, package)
            found.append(Coupling(mover, needs, f"check of step {step}: {line}", "check"))
    return found


def _at(pin: Optional[Pin]) -> str:
    return "(none)" if pin is None else f"{pin.name} {pin.version}"
