"""What an optax transformation is made of: the functions inside a chain, read from their closures.

optax builds a transformation from closures (``optax.chain`` closes over its
members, ``optax.MultiSteps`` keeps its inner transformation, wrappers close
over what they wrap), so the transformations a chain holds, and their order,
can be read without running it.  The step builders of :mod:`compjax.parallel`
use this to say, when they are built, what would otherwise train wrong without
a word: a chain with no compjax compressor (nothing crosses the worker axis),
a norm-based transform before the compressor or on a shard
(:mod:`compjax.compressors.clip`); and how the optimizer may see sharded
leaves (:func:`works_on_any_cut`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optax

__all__ = ["factory_name", "holds_exchange", "is_exchange", "parts", "works_on_any_cut"]

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


def works_on_any_cut(tx: Any) -> bool:
    """Whether every compjax compressor and algorithm in ``tx`` works on shards cut any way.

    A compressor built with ``compressor(..., any_cut=True)`` (``cj.identity``,
    ``cj.cast``, ``cj.signsgd``, ``cj.twobit``, ``cj.e3m0``: elementwise codecs
    whose per-layer statistics are sums or maxima over the host) needs to know
    only which leaves are shards; so does ``cj.diloco`` around such a
    compressor (it marks its own update).  The other compressors (top-k,
    random-k, DGC, PowerSGD, 1-bit SGD's columns, TernGrad's and QSGD's
    draws per entry, chunk top-k's tiles) and algorithms (delayed averaging,
    DeMo) map flat indices, columns or tiles between a shard and its layer
    and need each shard cut along one dimension.  A sharded step over several
    fast axes reads this to decide whether its optimizer may work on the
    leaves as the model lays them out (no re-layout inside the host every
    step: :func:`compjax.parallel.placement.shard_view`).  Transforms from
    outside compjax (optax's) are taken as elementwise; a compressor of one's
    own built on :func:`compjax.compressors.base.compressor` says so itself.

    Args:
      tx: an optax transformation (or any function or container of them).

    Returns:
      True when no compressor in ``tx`` says it needs one-dimensional shards
      and every compjax algorithm in it is marked ``any_cut``.

    Examples:
      >>> import optax, compjax as cj
      >>> works_on_any_cut(optax.chain(cj.identity(axis_name="data"), optax.adamw(1e-3)))
      True
      >>> works_on_any_cut(optax.chain(cj.topk(0.01, axis_name="data"), optax.adamw(1e-3)))
      False
    """
    fns = list(parts(tx))
    if any(getattr(f, "any_cut", None) is False for f in fns):
        return False
    marked = {factory_name(f) for f in fns if getattr(f, "any_cut", False)}
    return all(factory_name(f) in marked for f in fns
               if is_exchange(f) and (getattr(f, "__module__", "") or "").startswith("compjax.algorithms"))
