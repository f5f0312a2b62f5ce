"""The layout is the architecture: one declared order of the packages (`LAYERS`, lowest first), and
every import goes down it: a module imports its own package and packages of lower layers, never a
package of a higher layer nor another package of its own layer, and no module imports itself back
through a chain. Lazy imports inside functions count; TYPE_CHECKING imports do not (they are types)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("launcher_core", "envcheck", "dflash")
# The declared order, lowest first; a layer's packages are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("launcher_core",),                          # profiles, errors, files, processes: the floor
    ("envcheck",),                               # the machine: snapshot, checks, bisect (never the workload)
    ("dflash", "dflash.compat", "dflash.chat", "dflash.prompts", "dflash.torch_private"),  # the package's
                                                 # __init__, transformers versions, chat JSON shapes, prompt
                                                 # sets, torch's private APIs (each behind one function)
    ("dflash.target_model",),                    # target models: builtin targets, config readers
    ("dflash.tokenizer",),                       # the target's tokenizer, one loader for tokenize and eval
    ("dflash.drafter", "dflash.data", "dflash.generate"),  # the drafter model; tokenized data; generation
    ("dflash.memory",),                          # the analytic memory model and plan: the launcher process plans with it
    ("dflash.train", "dflash.train.supervisor"),  # the launcher's side of a run (the launcher process, the torchrun
                                                 # agent), and the records and variables the ranks report through
    ("dflash.train.rank",),                      # what runs inside each torchrun worker: never imported by the supervisor
    ("dflash.measure", "dflash.eval"),           # memory measured (trace, GPU calibration) by the rank's own step; evaluation
    ("dflash.stages",),                          # the pipeline's stages, all in one run dir
    ("dflash.commands",),                        # the CLI's subcommands
)
# Packages whose subpackages are declared one by one: a module of an undeclared subpackage is an error.
SPLIT = {"dflash", "dflash.train"}


def modules() -> dict[str, Path]:
    found = {}
    for package in ROOTS:
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


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def package_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> str | None:
    """The declared package that holds `module` (the longest match); None when none does."""
    found = [package for layer in layers for package in layer
             if module == package or (in_package(module, package) and package not in SPLIT)]
    return max(found, key=len, default=None)


def layer_of(package: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    return next(index for index, layer in enumerate(layers) if package in layer)


def undeclared(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    return sorted(module for module in graph if package_of(module, layers) is None)


def wrong_edges(graph: dict[str, set[str]],
                layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[tuple[str, str, str]]:
    """(module, imported module, "up" | "sideways") for every import that does not go down the layers."""
    found = []
    for module, targets in graph.items():
        source = package_of(module, layers)
        for target in targets:
            imported = package_of(target, layers)
            if source is None or imported is None or imported == source:
                continue
            step = layer_of(imported, layers) - layer_of(source, layers)
            if step >= 0:
                found.append((module, target, "up" if step > 0 else "sideways"))
    return sorted(found)


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


def test_every_package_is_declared_once():
    declared = [package for layer in LAYERS for package in layer]
    assert len(declared) == len(set(declared))
    assert undeclared(import_graph()) == []


def test_every_import_goes_down_the_declared_layers():
    assert wrong_edges(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


# What a rank may import of the supervisor: the records it writes for it and the variables it reads from it.
# Anything else a rank needs (the tokenizer's mask id, the validation split) lives below both.
SUPERVISOR_FOR_THE_RANK = {f"dflash.train.supervisor.{name}" for name in
                           ("heartbeat", "progress", "failures", "oom_records", "rendezvous", "agent")}


def supervisor_imports_of_the_rank(graph: dict[str, set[str]]) -> set[str]:
    return {target for module, targets in graph.items() if in_package(module, "dflash.train.rank")
            for target in targets if in_package(target, "dflash.train.supervisor")}


def test_the_rank_imports_of_the_supervisor_only_the_records_and_variables_it_reports_through():
    assert supervisor_imports_of_the_rank(import_graph()) - SUPERVISOR_FOR_THE_RANK == set()
    assert supervisor_imports_of_the_rank({"dflash.train.rank.setup": {"dflash.train.supervisor.launch_checks"}}) == {
        "dflash.train.supervisor.launch_checks"}

def test_the_checker_sees_upward_and_sideways_imports_and_undeclared_packages():
    graph = {"launcher_core.a": {"dflash.data.b"}, "dflash.memory.calibration_record": {"dflash.train.rank.setup", "dflash.drafter.shape"},
             "dflash.memoryless": {"dflash.train.rank.step"}, "dflash.train.rank.step": {"dflash.memory.peak_estimate", "dflash.eval.eval_run"},
             "dflash.train.supervisor.launch": {"dflash.train.rank.worker", "dflash.train.supervisor.heartbeat"},
             "dflash.train.rank.worker": {"dflash.train.supervisor.heartbeat"}, "dflash.measure.trace": {"dflash.eval.eval_run"},
             "dflash.data.tokenize": {"dflash.data.chat_render", "dflash.target_model"}, "dflash.generate.generation_run": {"dflash.data"}}
    assert wrong_edges(graph) == [("dflash.generate.generation_run", "dflash.data", "sideways"),
                                  ("dflash.measure.trace", "dflash.eval.eval_run", "sideways"),
                                  ("dflash.memory.calibration_record", "dflash.train.rank.setup", "up"),
                                  ("dflash.train.rank.step", "dflash.eval.eval_run", "up"),
                                  ("dflash.train.supervisor.launch", "dflash.train.rank.worker", "up"),
                                  ("launcher_core.a", "dflash.data.b", "up")]
    assert undeclared(graph) == ["dflash.memoryless"]
    assert undeclared({"dflash": set(), "dflash.data": set(), "envcheck.x.y": set()}) == []
    assert undeclared({"dflash.train": set(), "dflash.train.rank.step": set(), "dflash.train.step": set()}) == ["dflash.train.step"]


def test_the_checker_sees_a_cycle():
    graph = {"dflash.b": {"dflash.c"}, "dflash.c": {"dflash.b"}, "dflash.d": {"dflash.b"}}
    assert cycles(graph) == [["dflash.b", "dflash.c"]]


PRIVATE_HOME = "dflash/torch_private.py"


def private_torch_imports(path: Path) -> list[str]:
    """The private torch modules `path` imports (a dotted part starting with "_", beyond torch._C's ops)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    names += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    return sorted(name for name in names if name.split(".")[0] == "torch"
                  and any(part.startswith("_") for part in name.split(".")[1:]))


def test_private_torch_apis_are_imported_in_one_module_only():
    """Every private torch path the project needs is behind a function of dflash/torch_private.py, whose
    test (tests/test_torch_private.py) fails when torch moves one."""
    found = {str(path.relative_to(REPO)): private_torch_imports(path)
             for root in (*ROOTS, "benchmarks", "scripts") for path in (REPO / root).rglob("*.py")}
    found["launcher.py"] = private_torch_imports(REPO / "launcher.py")
    assert {path: names for path, names in found.items() if names and path != PRIVATE_HOME} == {}
    assert private_torch_imports(REPO / PRIVATE_HOME)          # the checker sees them where they are


def test_the_private_import_checker_sees_each_form(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import torch.distributed\nfrom torch.distributed.fsdp import FSDPModule\n"
                      "from torch._subclasses.fake_tensor import FakeTensorMode\nimport torch.testing._internal.x\n")
    assert private_torch_imports(module) == ["torch._subclasses.fake_tensor", "torch.testing._internal.x"]
