"""Fails the docs build when a public name of compjax has no entry in the API reference.

Public names are those of ``compjax.__all__``, of ``compjax.checkpoint.__all__`` (not imported by
``compjax`` itself, to keep orbax out of ``import compjax``) and, recursively, of the ``__all__`` of every
compjax module listed in one of them (``compjax.parallel``, ``compjax.netmodel``, ``compjax.codecs``,
``compjax.algorithms.federated``, ...).  A name counts as documented when the Python domain holds an entry
for it under any of its public names: ``compjax.payload_bytes`` documents ``compjax.accounting.payload_bytes``
(the same function), and the page of the module ``compjax.algorithms.federated`` documents
``compjax.federated``.  Constants (``compjax.bytecount.MAX``) must be documented under their own name.

The check runs after Sphinx has read every page (``env-check-consistency``) and raises a ``SphinxError``,
so the build fails with or without ``-W``.  :func:`undocumented` is the whole rule, a plain function of two
lists: ``tests/test_docs.py`` calls it on a doctored list of documented names.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable
from typing import Any

#: Where the walk over ``__all__`` starts.
ROOTS = ("compjax", "compjax.checkpoint")


def _is_compjax_module(obj: Any) -> bool:
    return isinstance(obj, types.ModuleType) and obj.__name__.split(".")[0] == "compjax"


def public_groups(roots: Iterable[str] = ROOTS) -> list[list[str]]:
    """Every public object as the sorted list of its public qualified names.

    Functions, classes and modules reachable under several names (re-exports) form one group;
    any other value (a constant, a string) is a group of its own name.  Groups are sorted by their
    first name.
    """
    by_id: dict[tuple, set[str]] = {}
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        modname = pending.pop()
        if modname in seen:
            continue
        seen.add(modname)
        module = importlib.import_module(modname)
        names = getattr(module, "__all__", None)
        if names is None:
            raise RuntimeError(f"{modname} is public but has no __all__: list its public names there")
        for name in names:
            obj = getattr(module, name)
            qualified = f"{modname}.{name}"
            shared = isinstance(obj, (types.FunctionType, type, types.ModuleType)) or callable(obj)
            key = ("object", id(obj)) if shared else ("name", qualified)
            by_id.setdefault(key, set()).add(qualified)
            if _is_compjax_module(obj):
                by_id[key].add(obj.__name__)  # its own name: the one automodule documents
                pending.append(obj.__name__)
    return sorted((sorted(group) for group in by_id.values()), key=lambda g: g[0])


def undocumented(groups: Iterable[Iterable[str]], documented: Iterable[str]) -> list[str]:
    """The public names none of whose aliases is documented (one name per missing object, sorted)."""
    documented = set(documented)
    return sorted(min(group) for group in map(list, groups) if not documented.intersection(group))


def check(app, env) -> None:
    """``env-check-consistency`` handler: raise when a public name has no entry."""
    from sphinx.errors import SphinxError

    missing = undocumented(public_groups(), env.get_domain("py").objects)
    if missing:
        raise SphinxError(
            "every public name of compjax needs an entry in the API reference (an autosummary line in "
            f"docs/api/*.rst); undocumented: {', '.join(missing)}")


def setup(app):
    app.connect("env-check-consistency", check)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
