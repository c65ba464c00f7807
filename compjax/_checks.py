"""Argument and pytree checks shared by every factory (clear ValueErrors, raised early)."""

from __future__ import annotations

import math
from typing import Any

import jax


def check_range(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
    static: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` lies in the given interval.

    ``lo``/``hi`` of None mean unbounded; ``lo_open``/``hi_open`` exclude the end.
    A traced value (e.g. a hyperparameter that ``optax.inject_hyperparams``
    passes into ``update``) cannot be checked: it is accepted, unless
    ``static`` says the value fixes shapes of the compiled step (a ratio, a
    rank), which a traced value cannot do.
    """
    if isinstance(value, jax.core.Tracer):
        if static:
            raise ValueError(
                f"{name} fixes the shapes of the compiled step, so it must be a concrete number, got a "
                f"traced value; with optax.inject_hyperparams, list {name!r} in static_args"
            )
        return
    lb = "(" if lo_open else "["
    rb = ")" if hi_open else "]"
    rng = f"{lb}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{rb}"
    kind = "an integer" if integer else "a number"
    try:
        if isinstance(value, (bool, str, bytes)):  # float("2") would accept a string
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind} in {rng}, got {value!r}") from None
    if integer and (not math.isfinite(v) or v != int(v)):
        raise ValueError(f"{name} must be {kind} in {rng}, got {value!r}")
    ok = math.isfinite(v) or (hi is None and v == math.inf and not integer)
    if lo is not None:
        ok = ok and (v > lo if lo_open else v >= lo)
    if hi is not None:
        ok = ok and (v < hi if hi_open else v <= hi)
    if not ok:
        raise ValueError(f"{name} must be {kind} in {rng}, got {value!r}")


def check_same_tree(updates: Any, reference: Any, what: str) -> None:
    """Raise ``ValueError`` unless ``updates`` has the structure and leaf shapes of ``reference``.

    Called at trace time by every compressor's ``update`` so that a gradient tree
    that does not match the state fails loudly instead of broadcasting.
    """
    t_u = jax.tree.structure(updates)
    t_r = jax.tree.structure(reference)
    if t_u != t_r:
        raise ValueError(
            f"the gradient tree does not match the {what} built by init: "
            f"got structure {t_u}, expected {t_r}"
        )
    for path_leaf, ref in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(reference)):
        path, leaf = path_leaf
        if tuple(leaf.shape) != tuple(ref.shape):
            raise ValueError(
                f"the gradient leaf {jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, "
                f"but the {what} built by init has shape {tuple(ref.shape)}"
            )
