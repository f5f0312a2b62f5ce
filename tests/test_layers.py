"""The layout is the architecture: launcher_core/ imports nothing of the floors above it, envcheck/ (the
machine) never imports dflash/ (the workload), inside dflash/ the declared package edges hold
(`PACKAGE_RULES`: the memory model never imports the trainer), and no module imports itself back
through a chain, lazy imports inside functions included (TYPE_CHECKING imports excluded)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = {"launcher_core": 0, "envcheck": 1, "dflash": 2}
TOP = ("dflash.train", "dflash.eval", "dflash.pipeline", "dflash.commands")
# Inside dflash: (package, packages it must not import, why).
PACKAGE_RULES = (
    ("dflash.memory", TOP, "the memory model and plan run in the launcher process, below the trainer; what runs "
                           "the trainer's step (calibration) lives in dflash.train"),
    ("dflash.drafter", ("dflash.memory", *TOP), "the drafter model is used by training, memory and eval, and uses "
                                                "none of them"),
)


def modules() -> dict[str, Path]:
    found = {}
    for package in FLOORS:
        for path in (REPO / package).rglob("*.py"):
            dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[dotted.removesuffix(".__init__")] = path
    return found


def runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules `path` imports at run time (a `from pkg import submodule` counts the submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
                   for node in ast.walk(block)}
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & known.keys()
            targets |= subs if len(subs) == len(node.names) else {node.module, *subs}
        elif isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
    return targets & known.keys()


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: runtime_imports(path, known) - {name} for name, path in known.items()}


def floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_runs_up_a_floor():
    graph = import_graph()
    upward = sorted((module, target) for module, targets in graph.items() for target in targets
                    if floor(target) > floor(module))
    assert upward == []


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def forbidden_edges(graph: dict[str, set[str]], rules=PACKAGE_RULES) -> list[tuple[str, str, str]]:
    """(module, imported module, the rule's reason) for every import a package rule forbids."""
    return sorted((module, target, why) for module, targets in graph.items() for target in targets
                  for package, banned, why in rules
                  if in_package(module, package) and any(in_package(target, b) for b in banned))


def test_no_import_crosses_a_declared_package_edge():
    assert forbidden_edges(import_graph()) == []


def test_the_edge_checker_sees_memory_importing_train():
    graph = {"dflash.memory.calibration": {"dflash.train.setup", "dflash.memory.model"},
             "dflash.memory.model": {"dflash.drafter.shape"}, "dflash.memoryless": {"dflash.train.step"},
             "dflash.train.calibration": {"dflash.memory.model", "dflash.train.setup"}}
    assert [(m, t) for m, t, _ in forbidden_edges(graph)] == [("dflash.memory.calibration", "dflash.train.setup")]
    assert forbidden_edges(graph, (("dflash.train", ("dflash.memory",), "test"),)) == [
        ("dflash.train.calibration", "dflash.memory.model", "test")]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checker_sees_an_upward_import_and_a_cycle():
    graph = {"launcher_core.a": {"dflash.b"}, "dflash.b": {"dflash.c"}, "dflash.c": {"dflash.b"}}
    assert [(m, t) for m, ts in graph.items() for t in ts if floor(t) > floor(m)] == [("launcher_core.a", "dflash.b")]
    assert cycles(graph) == [["dflash.b", "dflash.c"]]
