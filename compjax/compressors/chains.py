"""What an optax transformation is made of: the functions inside a chain, read from their closures.

optax builds a transformation from closures (``optax.chain`` closes over its
members, ``optax.MultiSteps`` keeps its inner transformation, wrappers close
over what they wrap), so the transformations a chain holds, and their order,
can be read without running it.  The step builders of :mod:`compjax.parallel`
use this to say, when they are built, what would otherwise train wrong without
a word: a chain with no compjax compressor (nothing crosses the worker axis),
a norm-based transform before the compressor or on a shard
(:mod:`compjax.compressors.clip`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optax

__all__ = ["factory_name", "holds_exchange", "is_exchange", "parts"]

#: compjax transforms that wrap others but exchange nothing of their own (the vote aside).
_WRAPPERS = frozenset({"apply_if_finite", "clip_by_global_norm", "multi_steps"})


def parts(tx: Any) -> Iterator[Any]:
    """The functions ``tx`` is built from, depth first in closure order (chain order for ``optax.chain``).

    Walks closures, tuples, lists, dicts, ``optax.GradientTransformation`` s and the
    instance behind a bound method (``optax.MultiSteps(...).gradient_transformation()``).

    Args:
      tx: an optax transformation (or any function or container of them).

    Yields:
      Python functions, each once.
    """
    yield from _parts(tx, set())


def _parts(obj: Any, seen: set) -> Iterator[Any]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if hasattr(obj, "__func__") and hasattr(obj, "__self__"):  # a bound method: optax.MultiSteps.update
        yield obj.__func__
        yield from _parts(vars(obj.__self__) if hasattr(obj.__self__, "__dict__") else (), seen)
    elif callable(obj) and hasattr(obj, "__code__"):
        yield obj
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _parts(value, seen)
    elif isinstance(obj, (optax.GradientTransformation, optax.GradientTransformationExtraArgs)):
        yield from _parts(obj.update, seen)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _parts(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _parts(x, seen)


def factory_name(fn: Any) -> str:
    """The factory a closure comes from: ``"clip_by_global_norm"`` for ``clip_by_global_norm.<locals>.update_fn``."""
    return getattr(fn, "__qualname__", "").split(".<locals>")[0]


def is_exchange(fn: Any) -> bool:
    """Whether ``fn`` belongs to a compjax compressor or algorithm: what exchanges across workers."""
    mod = getattr(fn, "__module__", "") or ""
    return mod.startswith(("compjax.compressors", "compjax.algorithms")) and factory_name(fn) not in _WRAPPERS \
        and not mod.startswith("compjax.compressors.chains")


def holds_exchange(tx: Any) -> bool:
    """Whether ``tx`` holds a compjax compressor or algorithm anywhere (inside any optax wrapper).

    Examples:
      >>> import optax, compjax as cj
      >>> holds_exchange(optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.1)))
      True
      >>> holds_exchange(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)))
      False
    """
    return any(is_exchange(f) for f in parts(tx))
