"""Per-worker plumbing of the data-parallel step builders: worker RNG streams and state averaged over workers.

Inside ``jax.shard_map`` every worker runs the same program; what tells the
workers apart is their index on the worker axis.  Random draws (dropout masks,
augmentation) must differ across workers and stay reproducible from one key:
:func:`fold_worker` folds the worker index into a key, and
:func:`nnx_fold_rngs` does so for the ``RngKey`` streams of Flax NNX objects for
the length of one step.  State that the model updates from each worker's own
batch (BatchNorm's running statistics) may be kept per worker or averaged over
workers after each step (:func:`average_leaves`, :func:`nnx_average`), as sync
BatchNorm does inside the forward pass.

These collectives belong to the model, not to a compressor: their bytes are not
in :func:`compjax.payload_bytes`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from compjax import collectives

__all__ = ["average_leaves", "check_average", "fold_worker", "is_key", "mean_floats", "nnx_average", "nnx_fold_rngs"]


def is_key(x: Any) -> bool:
    """True for a JAX PRNG key: a typed key array (``jax.random.key``) or a raw ``uint32[2]`` key."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == jnp.uint32 and jnp.shape(x) == (2,)


def fold_worker(key: jax.Array, axis_name: Hashable) -> jax.Array:
    """``jax.random.fold_in(key, i)`` for this worker's index ``i`` on ``axis_name`` (a name or a tuple).

    The same key gives every worker a different stream, and the same streams on
    every run.  Typed and raw keys keep their form.
    """
    return jax.random.fold_in(key, collectives.worker_index(axis_name))


def check_average(average: Any) -> tuple[tuple[str, ...], tuple[type, ...]]:
    """Split ``average`` into pytree key names and Flax NNX Variable types.

    Args:
      average: a name, an NNX ``Variable`` subclass, or a sequence of them.

    Returns:
      ``(names, types)``.

    Raises:
      ValueError: an entry that is neither a string nor a ``flax.nnx.Variable`` subclass.
    """
    if isinstance(average, (str, type)):
        entries = (average,)
    elif isinstance(average, (tuple, list)):
        entries = tuple(average)
    else:
        entries = (average,)  # refused below with the entry named
    names, types = [], []
    for e in entries:
        if isinstance(e, str) and e:
            names.append(e)
            continue
        if isinstance(e, type):
            from flax import nnx

            if issubclass(e, nnx.Variable):
                types.append(e)
                continue
        raise ValueError(
            f"average entries must be pytree key names (e.g. 'batch_stats') or flax.nnx.Variable subclasses "
            f"(e.g. nnx.BatchStat), got {e!r}"
        )
    return tuple(names), tuple(types)


def _path_names(path) -> set:
    out = set()
    for k in path:
        for attr in ("key", "name"):
            v = getattr(k, attr, None)
            if isinstance(v, str):
                out.add(v)
    return out


def mean_floats(leaves: Sequence[Any], axis_name: Hashable) -> list:
    """Mean over workers of each floating-point leaf of ``leaves`` (a list); other leaves as they are.

    One bucketed dense all-reduce per dtype over ``axis_name`` (a name or a
    tuple), not counted as compressor payload (the model's own state); each
    mean keeps its leaf's dtype and shape; empty leaves pass through.  Call it
    inside ``jax.shard_map`` (or another context binding ``axis_name``).
    """
    idx = [i for i, x in enumerate(leaves)
           if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.size(x) > 0]
    out = list(leaves)
    if idx:
        with collectives.uncounted():  # the model's state: no compressor's payload
            means, _ = collectives.dense_mean_arrays([leaves[i] for i in idx], axis_name)
        for i, m in zip(idx, means):
            out[i] = m.astype(jnp.result_type(leaves[i]))
    return out


def average_leaves(tree: Any, names: Sequence[str], axis_name: Hashable) -> Any:
    """Mean over workers of the floating-point leaves of ``tree`` whose key path holds one of ``names``.

    E.g. ``names=("batch_stats",)`` averages a Linen ``TrainState``'s
    ``batch_stats`` field (one bucketed all-reduce per dtype); other leaves
    are returned as they are.
    """
    if not names:
        return tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    sel = [i for i, (p, _) in enumerate(flat) if _path_names(p) & set(names)]
    leaves = [x for _, x in flat]
    if sel:
        means = mean_floats([leaves[i] for i in sel], axis_name)
        for i, m in zip(sel, means):
            leaves[i] = m
    return jax.tree.unflatten(treedef, leaves)


def nnx_average(nodes: Any, types: Sequence[type], axis_name: Hashable) -> None:
    """Average, in place, the Variables of the NNX objects ``nodes`` whose type is one of ``types``."""
    if not types:
        return
    from flax import nnx

    state = nnx.state(nodes, nnx.Any(*types))
    leaves, treedef = jax.tree.flatten(state)
    if leaves:
        nnx.update(nodes, jax.tree.unflatten(treedef, mean_floats(leaves, axis_name)))


def nnx_fold_rngs(nodes: Any, axis_name: Hashable) -> Any:
    """Fold this worker's index into every ``nnx.RngKey`` of ``nodes``, in place; returns the keys as they were.

    The streams' counters are left alone, so a draw is
    ``fold_in(fold_in(key, worker), count)``: distinct across workers, and the
    same on every run from the same seed.  Put the returned keys back
    (``nnx.update(nodes, saved)``) after the step, so the stored key stays the
    one every worker shares and only the counters advance.
    """
    from flax import nnx

    saved = jax.tree.map(lambda k: k, nnx.state(nodes, nnx.RngKey))  # a copy: nnx.state shares the Variables
    if jax.tree.leaves(saved):
        nnx.update(nodes, jax.tree.map(lambda k: fold_worker(k, axis_name), saved))
    return saved
