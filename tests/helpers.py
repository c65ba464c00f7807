"""Shared test helpers: run a transform's update on n workers under shard_map, pmap or vmap."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
#: Bytes of the non-finite vote every compressor adds to a multi-worker step (one int32 pmax).
VOTE = 4


def stack(trees):
    """Stack a list of per-worker trees on a new leading axis (NumPy)."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def vmap_quadratic_trainer(tx, init, n):
    """``(params, state, step)`` for ``n`` workers under ``jax.vmap(axis_name=AXIS)`` on the loss
    ``|p - c|^2 / 2`` (gradient ``p - c``): ``step(params, state, targets)`` takes one target tree per worker
    (a list) and applies ``tx``'s update (``params`` passed) to each worker's parameters."""
    import optax

    params = jax.tree.map(lambda x: np.stack([x] * n), init)
    state = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init(init))

    def one(p, s, c):
        u, s = tx.update(jax.tree.map(lambda a, b: a - b, p, c), s, p)
        return optax.apply_updates(p, u), s

    f = jax.jit(jax.vmap(one, axis_name=AXIS))
    return params, state, lambda p, s, targets: f(p, s, stack(targets))


def run_workers(tx, grads_stacked, state_stacked, backend, mesh=None):
    """One ``tx.update`` on every worker; inputs and outputs have a leading worker axis.

    backend: "shard_map", "pmap" or "vmap".  Returns (updates, state) as NumPy trees.
    """

    def one(g, s):
        return tx.update(g, s)

    if backend == "vmap":
        out = jax.jit(jax.vmap(one, axis_name=AXIS))(grads_stacked, state_stacked)
    elif backend == "pmap":
        out = jax.pmap(one, axis_name=AXIS)(grads_stacked, state_stacked)
    elif backend == "shard_map":
        assert mesh is not None
        n = jax.tree.leaves(grads_stacked)[0].shape[0]
        assert n == mesh.shape[AXIS]

        def body(g, s):
            g, s = jax.tree.map(lambda x: x[0], (g, s))
            u, s = one(g, s)
            return jax.tree.map(lambda x: x[None], (u, s))

        spec = P(AXIS)
        put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
        out = f(put(grads_stacked), put(state_stacked))
    else:
        raise ValueError(backend)
    out = jax.block_until_ready(out)
    return jax.tree.map(np.asarray, out)


def init_stacked(tx, params, n):
    """``tx.init(params)`` copied for n workers (NumPy, leading worker axis)."""
    s = tx.init(params)
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), s)


def files_under(root) -> list[str]:
    """The files below ``root`` as sorted relative POSIX paths ([] if ``root`` does not exist)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []
