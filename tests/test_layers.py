"""The package's layers point only down, its files import in no circle, and no file outgrows 400 lines.

Every `import` and `from ... import` of every module under nag_lightning/ counts, those inside
functions included: a lazy import hides a dependency from Python, not from a reader. A module's
layer is that of the longest prefix of its name in `LAYERS`; a module may import its own layer or
any below it, and the files of one layer may not import each other in a circle.

    0  arguments, inputs, registry,   what every layer may use
       data
    1  residuals, routers             the model's plugins
    2  model                          the network, plain torch.nn
    3  callbacks, checkpoints, tasks, what training is built from, and the Hugging Face folder
       hf
    4  training                       the LightningModule, its optimizer and schedule, run folders
    5  analysis                       studies, sweeps, evaluation, reports
    6  cli, the package itself        the command table
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nag_lightning"

LAYERS = {
    "nag_lightning.arguments": 0,
    "nag_lightning.inputs": 0,
    "nag_lightning.registry": 0,
    "nag_lightning.data": 0,
    "nag_lightning.residuals": 1,
    "nag_lightning.routers": 1,
    "nag_lightning.model": 2,
    "nag_lightning.callbacks": 3,
    "nag_lightning.checkpoints": 3,
    "nag_lightning.tasks": 3,
    "nag_lightning.hf": 3,
    "nag_lightning.training": 4,
    "nag_lightning.analysis": 5,
    "nag_lightning.cli": 6,
    "nag_lightning": 6,
}

MAX_LINES = 400


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package` (a package by its __init__)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module a dotted name imports: itself if it is a module, else the longest known prefix
    (`from pkg.mod import function` depends on pkg.mod)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    known = modules(package)
    root = package.name
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                if target == root or target.startswith(root + "."):
                    resolved = _resolve(target, known)
                    if resolved and resolved != name:
                        edges.setdefault(resolved, node.lineno)
        graph[name] = edges
    return graph


def layer(module: str) -> int | None:
    while module:
        if module in LAYERS:
            return LAYERS[module]
        module = module.rpartition(".")[0]
    return None


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import from a lower layer into a higher one, as 'file:line a (layer) -> b (layer)'."""
    found = []
    for source, edges in graph.items():
        for target, line in edges.items():
            if layer(target) > layer(source):
                found.append(f"{source}:{line} (layer {layer(source)}) imports {target} "
                             f"(layer {layer(target)})")
    return sorted(found)


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(found)


GRAPH = import_graph(PACKAGE)


def test_every_module_has_a_layer():
    assert [m for m in GRAPH if layer(m) is None] == []


def test_imports_only_point_down():
    assert upward_imports(GRAPH) == []


def test_no_circle_of_imports():
    assert circles(GRAPH) == []


def test_callbacks_draw_no_figures():
    """A callback runs inside training; a figure is analysis's job."""
    assert {(m, t) for m, edges in GRAPH.items() if m.startswith("nag_lightning.callbacks")
            for t in edges if t.startswith("nag_lightning.analysis")} == set()


def test_the_checks_find_a_circle_and_an_upward_import():
    """The walk sees lazy imports and reports both faults (three files in a circle, one pointing up)."""
    graph = {"nag_lightning.model.a": {"nag_lightning.cli": 3},
             "nag_lightning.cli": {"nag_lightning.model.b": 5},
             "nag_lightning.model.b": {"nag_lightning.model.a": 7}}
    assert circles(graph) == [sorted(graph)]
    assert upward_imports(graph) == ["nag_lightning.model.a:3 (layer 2) imports nag_lightning.cli (layer 6)"]
    lazy = ast.parse("def f():\n    from nag_lightning.cli import main\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(lazy))  # ast.walk enters functions


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_400_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines; split it by idea"
