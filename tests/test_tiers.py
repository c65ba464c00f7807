"""The two test tiers stay honest: every module of ``compjax`` keeps a test in the fast tier.

``python -m pytest`` runs the fast tier: every test not marked ``slow``, and the docstring examples;
``python -m pytest --all`` runs the full tier, the ``slow`` tests too (CI runs both; tests/conftest.py
deselects the slow ones without ``--all``).

A module of ``compjax`` (found by walking the package, so a new module is checked without being listed
here) counts as tested in the fast tier when a fast test reaches it by name: the test function, the
fixtures it asks for, the helpers of tests/ it calls and the data of tests/ it reads (``registry.CASES``,
say) name the module or a function, class or object defined in it, directly or through the code of the
``compjax`` functions they name (a test of ``cj.topk`` reaches the sparse exchange topk calls).  Names are
read from the code objects (globals and attributes), not from a trace: a name in a branch the test never
takes counts too.  A package whose ``__init__`` defines nothing of its own counts when one of its modules
does.  A fast test is a test function not marked ``slow`` (nor its class or module); a parametrized test
is fast when one of its cases is not marked ``slow``, and then only its fast cases' arguments count.
Doctests do not count: they are examples, not checks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys
import types
from pathlib import Path

import pytest

import compjax

TESTS = Path(__file__).resolve().parent
SLOW = "slow"


# --- marks ----------------------------------------------------------------------------------------------------


def is_param(obj) -> bool:
    """True for a ``pytest.param(...)`` (a parameter set: its values and marks)."""
    return isinstance(getattr(obj, "values", None), tuple) and hasattr(obj, "marks") and hasattr(obj, "id")


def marks(obj) -> list:
    """The pytest marks set on a function, class or module (``pytestmark``) or a ``pytest.param``, as ``Mark``
    objects."""
    found = obj.marks if is_param(obj) else getattr(obj, "pytestmark", [])
    return [getattr(m, "mark", m) for m in (found if isinstance(found, (list, tuple)) else [found])]


def is_slow(obj) -> bool:
    return any(m.name == SLOW for m in marks(obj))


def fast_parameters(fn) -> list | None:
    """The argument values of ``fn``'s cases not marked slow (one list per ``parametrize``); None if every case of
    one ``parametrize`` is marked slow (the test is then in the full tier only)."""
    out = []
    for mark in marks(fn):
        if mark.name != "parametrize":
            continue
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        one = len(names.split(",") if isinstance(names, str) else names) == 1
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"]
        # pytest.param(x, marks=...) holds (x,) in .values
        fast = [(v.values[0] if one else v.values) if is_param(v) else v for v in values if not is_slow(v)]
        if not fast:
            return None
        out.append(fast)
    return out


def collected_tests(module) -> list[tuple[str, object, object]]:
    """(name, function, class or None) for every test function pytest collects from ``module``."""
    found = []
    for name, obj in vars(module).items():
        if name.startswith("test") and inspect.isfunction(obj):
            found.append((name, obj, None))
        elif name.startswith("Test") and inspect.isclass(obj):
            found += [(f"{name}::{k}", f, obj) for k, f in vars(obj).items()
                      if k.startswith("test") and inspect.isfunction(f)]
    return found


# --- what a test reaches by name -----------------------------------------------------------------------------


def in_compjax(name) -> bool:
    return isinstance(name, str) and (name == "compjax" or name.startswith("compjax."))


def in_tests(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS)


def code_names(code: types.CodeType) -> set[str]:
    """Every global and attribute name a code object and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


class Reach:
    """The ``compjax`` modules that objects reach by name: through tests/' own code and data, and through the code
    of the ``compjax`` functions and classes reached.  What one object names directly is found once and kept."""

    def __init__(self):
        self._names: dict[int, tuple[object, str | None, list]] = {}  # id -> (object, its module, what it names)
        self._tests = {n for n, m in list(sys.modules.items())
                       if Path(getattr(m, "__file__", None) or "/").resolve().is_relative_to(TESTS)}

    def modules(self, *objs) -> set[str]:
        """The compjax modules ``objs`` reach."""
        found, seen, todo = set(), set(), [(o, 0) for o in objs]
        while todo:
            obj, depth = todo.pop()
            if id(obj) in seen or depth > 6:
                continue
            seen.add(id(obj))
            module, named, nested = self.names(obj)
            if module is not None:
                found.add(module)
            todo += [(x, depth) for x in named] + [(x, depth + 1) for x in nested]
        return found

    def names(self, obj) -> tuple[str | None, list, list]:
        """(the compjax module that defines ``obj`` or that ``obj`` is, the objects its code names, the items of a
        container)."""
        if id(obj) not in self._names:
            self._names[id(obj)] = (obj, *self._direct(obj))
        return self._names[id(obj)][1:]

    def _direct(self, obj) -> tuple[str | None, list, list]:
        if isinstance(obj, types.ModuleType):
            return (obj.__name__ if in_compjax(obj.__name__) else None), [], []
        if isinstance(obj, functools.partial):
            return None, [obj.func, *obj.args, *obj.keywords.values()], []
        if isinstance(obj, (dict, list, tuple, set, frozenset)):  # registries, cases (NamedTuples too)
            return None, [], list(obj.values() if isinstance(obj, dict) else obj)
        fn = inspect.unwrap(obj) if callable(obj) else obj
        fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)  # a @given test: the test itself
        owner = getattr(fn, "__module__", None)
        mine = owner if in_compjax(owner) else None
        if inspect.isfunction(fn):
            if mine or in_tests(fn):  # follow the code (not that of jax, optax, numpy ...)
                return mine, code_objects(fn.__code__, fn.__globals__), []
            return None, [], []
        if inspect.isclass(fn):
            if mine or owner in self._tests:
                return mine, [f for f in vars(fn).values() if inspect.isfunction(f)], []
            return None, [], []
        if in_compjax(type(obj).__module__):  # an instance of a compjax class
            return None, [type(obj)], []
        return None, [], []


def code_objects(code: types.CodeType, namespace: dict) -> list:
    """What a code object names: globals of its module, and attributes of the compjax modules it names
    (``cj.codecs.bitpack.pack``)."""
    names = {n for n in code_names(code) if not n.startswith("__")}
    found = [namespace[n] for n in names if n in namespace]
    found += [sys.modules[n] for n in names if in_compjax(n) and n in sys.modules]  # import compjax.x inside
    modules = [m for m in found if isinstance(m, types.ModuleType) and in_compjax(m.__name__)]
    done = set()
    while modules:
        module = modules.pop()
        if module.__name__ in done:
            continue
        done.add(module.__name__)
        for n in names:
            attr = getattr(module, n, None)
            if attr is not None:
                found.append(attr)
                if isinstance(attr, types.ModuleType) and in_compjax(attr.__name__):
                    modules.append(attr)
    return found


def fixture_functions(config) -> dict[str, object]:
    """Fixture name -> function, from the conftest.py files pytest loaded (tests/ and the root)."""
    out = {}
    for plugin in config.pluginmanager.get_plugins():
        path = getattr(plugin, "__file__", None)
        if isinstance(plugin, types.ModuleType) and path and Path(path).name == "conftest.py":
            for name, obj in vars(plugin).items():
                if hasattr(obj, "_fixture_function_marker"):
                    out[name] = obj
    return out


def load_test_modules() -> list[types.ModuleType]:
    """Every test module of tests/, imported as pytest imports it (tests/ on sys.path)."""
    return [importlib.import_module(p.stem) for p in sorted(TESTS.glob("test_*.py"))]


def fast_tier_reach(modules, fixtures) -> tuple[dict[str, set[str]], list[str], list[str]]:
    """({compjax module: the fast tests that reach it}, the fast tests, the tests in the full tier only)."""
    by_module: dict[str, set[str]] = {}
    reach = Reach()
    fast, slow = [], []
    for module in modules:
        for name, fn, cls in collected_tests(module):
            test_id = f"{module.__name__}.py::{name}"
            params = fast_parameters(fn)
            if is_slow(module) or (cls is not None and is_slow(cls)) or is_slow(fn) or params is None:
                slow.append(test_id)
                continue
            fast.append(test_id)
            objs = [fn, *params]
            for arg in inspect.signature(fn).parameters:
                fixture = vars(module).get(arg, fixtures.get(arg))
                if fixture is not None:
                    objs.append(getattr(fixture, "__wrapped__", fixture))
            for m in reach.modules(*objs):
                by_module.setdefault(m, set()).add(test_id)
    return by_module, fast, slow


def compjax_modules() -> list[str]:
    """Every module and package of compjax, found by walking it."""
    return sorted({"compjax", *(m.name for m in pkgutil.walk_packages(compjax.__path__, "compjax."))})


# --- the guards -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiers(request):
    return fast_tier_reach(load_test_modules(), fixture_functions(request.config))


def defines_nothing(package: str) -> bool:
    """True when a package's ``__init__`` defines no function or class of its own (it only gathers its modules')."""
    module = importlib.import_module(package)
    return hasattr(module, "__path__") and not any(
        (inspect.isfunction(x) or inspect.isclass(x)) and x.__module__ == package for x in vars(module).values())


def untested(by_module: dict, names: list[str]) -> list[str]:
    """The modules of ``names`` that no fast test reaches; a package that only gathers its modules counts when
    one of its modules does."""
    return [m for m in names if m not in by_module
            and not (defines_nothing(m) and any(n.startswith(m + ".") and n in by_module for n in names))]


def test_every_compjax_module_has_a_fast_test(tiers):
    by_module, fast, slow = tiers
    assert len(fast) > 100 and slow, (len(fast), len(slow))
    missing = untested(by_module, compjax_modules())
    assert not missing, ("modules of compjax that no test of the fast tier reaches (their tests are all marked "
                         f"slow, or they have none): {missing}")


def test_the_battery_runs_every_case_in_the_fast_tier():
    """Each test of the shared battery runs some case in the fast tier, and each case of tests/registry.py runs
    in some battery test of the fast tier, except those kept for the full tier (registry.FULL_ONLY)."""
    import registry
    import test_battery

    fast_cases = set()
    for name, fn, _ in collected_tests(test_battery):
        params = fast_parameters(fn)
        assert params and not is_slow(fn) and not is_slow(test_battery), f"{name}: no case in the fast tier"
        fast_cases |= {v for values in params for v in values if isinstance(v, str)}
    assert set(registry.FULL_ONLY) <= set(registry.CASES)
    assert fast_cases == set(registry.CASES) - set(registry.FULL_ONLY), (
        f"not in the fast tier: {sorted(set(registry.CASES) - set(registry.FULL_ONLY) - fast_cases)}; "
        f"in it, though full-tier only: {sorted(fast_cases & set(registry.FULL_ONLY))}")


class _Item:
    def __init__(self, name, slow):
        self.name, self.slow = name, slow

    def get_closest_marker(self, name):
        return object() if name == SLOW and self.slow else None


class _Config:
    def __init__(self, all_tiers):
        self.all_tiers, self.deselected = all_tiers, []
        self.hook = types.SimpleNamespace(pytest_deselected=lambda items: self.deselected.extend(items))

    def getoption(self, name):
        assert name == "all_tiers"
        return self.all_tiers


def test_slow_tests_are_left_out_unless_all_is_given(request):
    """tests/conftest.py: without --all the tests marked slow are deselected (and reported so); with it, none."""
    (conftest,) = [p for p in request.config.pluginmanager.get_plugins()
                   if Path(getattr(p, "__file__", None) or "/") == TESTS / "conftest.py"]
    for all_tiers, kept in ((False, ["a", "c"]), (True, ["a", "b", "c", "d"])):
        items = [_Item("a", False), _Item("b", True), _Item("c", False), _Item("d", True)]
        config = _Config(all_tiers)
        conftest.pytest_collection_modifyitems(config, items)
        assert [i.name for i in items] == kept
        assert [i.name for i in config.deselected] == sorted({"a", "b", "c", "d"} - set(kept))
