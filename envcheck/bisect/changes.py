"""GOOD vs BAD -> changes -> groups of changes that must move together, in bisect order.

What glues changes into one group, each rule named in the group's `rules` and `reasons`:

* `metadata`: the packages' own Requires-Dist couple them both ways (directly or around a
  cycle), e.g. `plug 2.0` requires `core==2.0` and `plug 1.0` requires `core==1.0`
  (`envcheck.bisect.coupling`). A coupling in one direction only orders the groups instead;
* `family`: for a package whose metadata could not be read, the hard-coded family: torch with
  torchvision/torchaudio, triton and the `nvidia-*` CUDA libraries (`nvidia-ml-py`, the NVML
  bindings, is independent); the FlashInfer companions (`flashinfer-python`, `-cubin`,
  `-jit-cache`);
* `--group`: the user's own glue (`--group a,b`);
* `check`: the consistency check of a candidate showed a coupling the metadata did not (the
  bisect learns it, regroups and retries); it joins or orders groups like a metadata coupling.

Every other change is a group of its own (`alone`). Groups are ordered so that a group comes
after the groups it needs (a dependency right before its first dependent), otherwise by name,
so a bisect is reproducible and its log can be resumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from envcheck.bisect.coupling import Coupling, readable, requirement_couplings
from envcheck.bisect.metadata import MetadataMap
from envcheck.bisect.reqsets import Pin, RequirementSet
from envcheck.packages import normalize

TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "triton", "pytorch-triton"})
FLASHINFER_FAMILY = frozenset({"flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"})
INDEPENDENT_NVIDIA = frozenset({"nvidia-ml-py"})
LONG_NAME = 4                                  # larger groups are named "head+N"


@dataclass(frozen=True)
class Change:
    name: str
    old: Optional[Pin]       # None: added in BAD
    new: Optional[Pin]       # None: removed in BAD

    def describe(self) -> str:
        if self.old is None:
            return f"{self.name} (added, {self.new.version if self.new else '?'})"
        if self.new is None:
            return f"{self.name} (removed, was {self.old.version})"
        return f"{self.name} {self.old.version} -> {self.new.version}"


@dataclass(frozen=True)
class Glue:
    """Packages put in one group by a rule other than their metadata."""

    members: frozenset[str]
    rule: str                # "family" or "--group"
    reason: str


@dataclass(frozen=True)
class Group:
    name: str
    changes: tuple[Change, ...]
    rules: tuple[str, ...] = ("alone",)
    reasons: tuple[str, ...] = ()
    after: tuple[tuple[str, str], ...] = ()   # (group applied earlier, the requirement that orders them)

    def describe(self) -> str:
        return "; ".join(change.describe() for change in self.changes)

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(change.name for change in self.changes)


def diff_sets(good: RequirementSet, bad: RequirementSet) -> list[Change]:
    """Every package whose pin differs between GOOD and BAD, sorted by name."""
    names = sorted(set(good) | set(bad))
    return [Change(name, good.get(name), bad.get(name)) for name in names
            if _version(good.get(name)) != _version(bad.get(name))]


def _version(pin: Optional[Pin]) -> Optional[str]:
    return None if pin is None else pin.version


def family_of(name: str) -> Optional[str]:
    """The hard-coded family a package belongs to, or None."""
    if name in TORCH_FAMILY or (name.startswith("nvidia-") and name not in INDEPENDENT_NVIDIA):
        return "torch"
    if name in FLASHINFER_FAMILY:
        return "flashinfer"
    return None


def group_changes(changes: list[Change], extra_groups: Sequence[str] = (), metadata: Optional[MetadataMap] = None,
                  learned: Sequence[Coupling] = ()) -> list[Group]:
    """Changes -> groups, ordered. Without `metadata` every package falls back to its family;
    `learned` adds couplings found by failed consistency checks."""
    metadata = metadata or {}
    names = [change.name for change in changes]
    glue = [*user_glue(extra_groups, names), *family_glue(changes, metadata)]
    couplings = [*requirement_couplings(changes, metadata), *learned]
    parts = _partition(names, glue, couplings)
    unreadable = {change.name for change in changes if not readable(change, metadata)}
    groups = [_make_group(members, changes, glue, couplings, unreadable) for members in parts]
    return order_groups(groups, couplings)


def user_glue(extra_groups: Iterable[str], names: list[str]) -> list[Glue]:
    glue = []
    for item in extra_groups:
        members = frozenset(normalize(part.strip()) for part in item.split(",") if part.strip())
        if len(members & set(names)) > 1:
            glue.append(Glue(members & set(names), "--group", f"--group {item}"))
    return glue


def family_glue(changes: list[Change], metadata: MetadataMap) -> list[Glue]:
    """Each package without readable metadata joins the changed members of its family."""
    names_by_family: dict[str, set[str]] = {}
    for change in changes:
        if (family := family_of(change.name)) is not None:
            names_by_family.setdefault(family, set()).add(change.name)
    glue = []
    for change in changes:
        family = family_of(change.name)
        if not readable(change, metadata) and family and len(names_by_family[family]) > 1:
            glue.append(Glue(frozenset(names_by_family[family]), "family",
                             f"no metadata readable for {change.name}: moves with its family ({family})"))
    return glue


def _partition(names: list[str], glue: Sequence[Glue], couplings: list[Coupling]) -> list[frozenset[str]]:
    """Union of the glue, then of every cycle of couplings between the glued parts."""
    parent = {name: name for name in names}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(members: Iterable[str]) -> None:
        roots = sorted({find(member) for member in members if member in parent})
        for root in roots[1:]:
            parent[root] = roots[0]

    for item in glue:
        union(item.members)
    edges = {(find(c.mover), find(c.needs)) for c in couplings if find(c.mover) != find(c.needs)}
    for cycle in strongly_connected({find(name) for name in names}, edges):
        union(cycle)
    parts: dict[str, set[str]] = {}
    for name in names:
        parts.setdefault(find(name), set()).add(name)
    return [frozenset(members) for members in parts.values()]


def strongly_connected(nodes: set[str], edges: set[tuple[str, str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one node (graphs here are small)."""
    successors = {node: sorted(b for a, b in edges if a == node) for node in nodes}
    reach = {node: _reachable(node, successors) for node in nodes}
    components = {frozenset(other for other in reach[node] if node in reach[other]) | {node} for node in nodes}
    return sorted((component for component in components if len(component) > 1), key=sorted)


def _reachable(start: str, successors: dict[str, list[str]]) -> set[str]:
    seen, stack = set(), list(successors[start])
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(successors[node])
    return seen


def _make_group(members: frozenset[str], changes: list[Change], glue: Sequence[Glue],
                couplings: list[Coupling], unreadable: set[str]) -> Group:
    inside = [c for c in couplings if c.mover in members and c.needs in members]
    glued = [item for item in glue if item.members <= members and len(item.members) > 1]
    rules = tuple(sorted({item.rule for item in glued} | {c.source for c in inside})) or ("alone",)
    reasons = tuple(dict.fromkeys([*(item.reason for item in glued), *(c.reason for c in inside)])) or \
        (_alone_reason(next(iter(members)), unreadable),)
    return Group(_group_name(members, glued, inside), tuple(c for c in changes if c.name in members), rules, reasons)


def _alone_reason(name: str, unreadable: set[str]) -> str:
    if name in unreadable:
        return f"no metadata readable for {name} and no family: moves alone (--group glues it to others)"
    return "its metadata pins no other changed package both ways"


def _group_name(members: frozenset[str], glued: Sequence[Glue], inside: list[Coupling]) -> str:
    families = {family_of(name) for name in members}
    family = next(iter(families)) if len(families) == 1 else None
    if len(members) > 1 and family is not None and any(g.rule == "family" for g in glued):
        return family
    ordered = sorted(members)
    if len(ordered) <= LONG_NAME:
        return "+".join(ordered)
    head = max(ordered, key=lambda name: (sum(c.mover == name for c in inside), [-ord(ch) for ch in name]))
    return f"{head}+{len(ordered) - 1}"


def order_groups(groups: list[Group], couplings: list[Coupling]) -> list[Group]:
    """Each group after the groups it needs, a needed group right before its first dependent."""
    owner = {name: group.name for group in groups for name in group.packages}
    needs: dict[str, dict[str, str]] = {group.name: {} for group in groups}
    for coupling in couplings:
        mover, needed = owner[coupling.mover], owner[coupling.needs]
        if mover != needed:
            needs[mover].setdefault(needed, coupling.reason)
    by_name = {group.name: group for group in groups}
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        for needed in sorted(needs[name]):
            visit(needed)
        ordered.append(name)

    for name in sorted(by_name):
        visit(name)
    return [_with_after(by_name[name], needs[name]) for name in ordered]


def _with_after(group: Group, needed: dict[str, str]) -> Group:
    after = tuple(sorted(needed.items()))
    return Group(group.name, group.changes, group.rules, group.reasons, after)


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
