"""Imports inside each package run one way: no two modules of ``compjax``, nor of ``experiments``, import each other.

The graph is read from the source with :mod:`ast` (nothing is imported): an edge ``a -> b`` for every
``import``/``from ... import`` in ``a`` that names module ``b`` of the same package, at module level or inside a
function (a lazy import still ties the two modules together).  ``from pkg import name`` counts as importing
``pkg.name`` when that is a module, else ``pkg``.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("compjax", "experiments")


def _modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` (``__init__.py`` names the package)."""
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known) -> list[str]:
    """The dotted names an import statement reaches (a name that is no module: the module it comes from)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    source = node.module or ""
    if node.level:  # relative: from the package holding the module, then up level - 1
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]


def import_graph(package: str) -> dict[str, set[str]]:
    """``{module: the modules of the same package it imports}`` for every module of ``package``."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):  # every statement, function bodies included
            for name in _imported(node, module, path.name == "__init__.py", modules):
                while name not in modules and "." in name:  # ``pkg.mod.func`` -> ``pkg.mod``
                    name = name.rsplit(".", 1)[0]
                if name in modules and name != module:
                    graph[module].add(name)
    return graph


def mutual_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The pairs of modules that import each other, each once, sorted."""
    return sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """What is wrong with ``graph``: each pair of modules that import each other, else one longer cycle, if any."""
    pairs = mutual_pairs(graph)
    if pairs:
        return [f"{a} <-> {b}" for a, b in pairs]
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:  # a -> b -> c -> a
        return [" -> ".join(e.args[1])]
    return []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_two_modules_import_each_other(package):
    found = cycles(import_graph(package))
    assert not found, f"modules of {package} that import each other: " + "; ".join(found)


def test_the_graph_sees_imports_inside_functions_and_cycles_are_reported():
    """The graph is not vacuous: train's lazy import of trainer (inside a function) is an edge, ``from compjax import
    collectives`` reaches the module; a pair and a longer cycle written into a graph are reported."""
    experiments = import_graph("experiments")
    assert "experiments.trainer" in experiments["experiments.train"]
    assert "experiments.checks" in experiments["experiments.trainer"]
    compjax = import_graph("compjax")
    assert "compjax.collectives" in compjax["compjax.compressors.base"]
    assert "compjax.algorithms.federated.uplink" in compjax["compjax.algorithms.federated.algorithms"]
    experiments["experiments.trainer"].add("experiments.train")
    assert cycles(experiments) == ["experiments.train <-> experiments.trainer"]
    found = cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    assert len(found) == 1 and set(found[0].split(" -> ")) == {"a", "b", "c"}
