"""Imports inside each package run one way: no two modules of ``compjax``, nor of ``experiments``, import each other.

The graph is read from the source with :mod:`ast` (nothing is imported): an edge ``a -> b`` for every
``import``/``from ... import`` in ``a`` that names module ``b`` of the same package, at module level or inside a
function (a lazy import still ties the two modules together).  ``from pkg import name`` counts as importing
``pkg.name`` when that is a module, else ``pkg``.

The same reading checks that no module of ``compjax`` uses another module's private (``_name``) helper:
:func:`private_uses`.
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


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def private_uses(package: str = "compjax") -> list[str]:
    """Every use of another module's private name in ``package``: ``from a import _x`` (``_x`` not a module of
    the package) and ``a._x`` (``a`` a module of the package, bound by an import in the same file), as
    ``"file:line: what"``.

    A module whose own name starts with ``_`` (``compjax._checks``) may be imported; a name starting with ``_``
    from it may not.  Dunder names (``__version__``) are public.
    """
    modules = _modules(package)
    found = []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> the module of the package it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                for alias, target in zip(node.names, _imported(node, module, is_package, modules)):
                    if not target.startswith(package):
                        continue
                    if target in modules and target.rsplit(".", 1)[-1] == alias.name:  # a module, by name
                        bound[alias.asname or alias.name] = target
                    elif private(alias.name) and target != module:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {target} import {alias.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            owner = _dotted(node.value)  # ``a`` bound by an import, or a full ``pkg.a`` after ``import pkg.a``
            target = bound.get(owner) if owner in bound else owner if owner in modules else None
            if target is not None and target != module:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {owner}.{node.attr} ({target})")
    return found


def test_no_module_uses_another_modules_private_names():
    """House rule: a helper shared between modules is public in the module that defines it (with a docstring);
    no module of compjax imports ``_name`` from another or reaches into ``other._name``."""
    found = private_uses("compjax")
    assert not found, "private names of another module used: " + "; ".join(found)


def test_private_uses_sees_both_forms(tmp_path, monkeypatch):
    """The check is not vacuous: on a small package written for it, both a ``from a import _x`` and a
    ``a._x`` through ``from pkg import a`` are found, a module's own ``_x`` and a private module are not."""
    pkg = tmp_path / "pkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_priv.py").write_text("def helper():\n    return 1\n")
    (pkg / "a.py").write_text("def _x():\n    return 1\n\n\ndef y():\n    return _x()\n")
    (pkg / "b.py").write_text("import pkgx.a\nfrom pkgx import a, _priv\nfrom pkgx.a import _x\n"
                              "from pkgx._priv import helper\n\n\n"
                              "def z():\n    return a._x() + _x() + helper() + _priv.helper() + pkgx.a._x()\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = private_uses("pkgx")
    assert sorted(f.split(": ", 1)[1] for f in found) == ["a._x (pkgx.a)", "from pkgx.a import _x",
                                                          "pkgx.a._x (pkgx.a)"], found
