"""Shared test helpers: run a transform's update on n workers under shard_map, pmap or vmap."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
#: ``compiler_options`` of one compilation (``jax.jit(..., compiler_options=...)``, ``lowered.compile(...)``) that
#: give the code users get: the tests' processes compile with XLA:CPU's fast-compile flags (conftest.py at the
#: root), whose fusions differ, so a test that measures a program's memory or promises bits across two
#: compiled copies of one expression compiles with these (XLA's defaults).
USERS_CODEGEN = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
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

    backend: "shard_map", "pmap" or "vmap".  Returns (updates, state) as NumPy trees.  The program is built once
    per ``(tx, backend, mesh)``, so the steps of a loop compile once (a fresh closure each call would compile
    at every step).
    """
    if backend == "shard_map":
        assert mesh is not None
        n = jax.tree.leaves(grads_stacked)[0].shape[0]
        assert n == mesh.shape[AXIS]
        put = lambda t: jax.device_put(t, NamedSharding(mesh, P(AXIS)))
        grads_stacked, state_stacked = put(grads_stacked), put(state_stacked)
    out = jax.block_until_ready(_workers_program(tx, backend, mesh)(grads_stacked, state_stacked))
    return jax.tree.map(np.asarray, out)


_PROGRAMS: dict = {}


def _workers_program(tx, backend, mesh):
    """``tx.update`` mapped over the worker axis by ``backend``, built once per ``(tx, backend, mesh)``."""
    key = (id(tx), backend, mesh)
    if key in _PROGRAMS and _PROGRAMS[key][0] is tx:
        return _PROGRAMS[key][1]

    def one(g, s):
        return tx.update(g, s)

    if backend == "vmap":
        f = jax.jit(jax.vmap(one, axis_name=AXIS))
    elif backend == "pmap":
        f = jax.pmap(one, axis_name=AXIS)
    elif backend == "shard_map":
        def body(g, s):
            g, s = jax.tree.map(lambda x: x[0], (g, s))
            u, s = one(g, s)
            return jax.tree.map(lambda x: x[None], (u, s))

        spec = P(AXIS)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    else:
        raise ValueError(backend)
    _PROGRAMS[key] = (tx, f)  # tx kept alive with its program: its id is not reused while the entry lives
    while len(_PROGRAMS) > 16:  # the last few transforms' programs (a test's loop reuses one)
        del _PROGRAMS[next(iter(_PROGRAMS))]
    return f


def init_stacked(tx, params, n):
    """``tx.init(params)`` copied for n workers (NumPy, leading worker axis)."""
    s = tx.init(params)
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), s)


def files_under(root) -> list[str]:
    """The files below ``root`` as sorted relative POSIX paths ([] if ``root`` does not exist)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def replicated_and_sharded(loss_fn, tx, init, specs, batches, mesh, fast_axis="fast"):
    """Train ``batches`` in the replicated 2-D layout and in the sharded one (``specs``) from the same ``init``.

    Returns ``((rp, rs), (sp, ss), sharded)``: each layout's parameters and state after the last batch, and the
    sharded step compiled from the first batch (the very program that ran, for ``audit_collectives``).
    """
    from compjax import parallel

    rp = parallel.replicate(init, mesh, fast_axis=fast_axis)
    rs = parallel.init_worker_state(tx, init, mesh, fast_axis=fast_axis)
    sp = parallel.replicate(init, mesh, specs=specs)
    ss = parallel.init_worker_state(tx, init, mesh, specs=specs)
    first = parallel.shard_batch(batches[0], mesh, fast_axis=fast_axis)
    replicated = parallel.data_parallel_step(loss_fn, tx, mesh, fast_axis=fast_axis)
    sharded = parallel.data_parallel_step(loss_fn, tx, mesh, specs=specs).lower(sp, ss, first).compile()
    for b in batches:
        b = parallel.shard_batch(b, mesh, fast_axis=fast_axis)
        rp, rs, _ = replicated(rp, rs, b)
        sp, ss, _ = sharded(sp, ss, b)
    return (rp, rs), (sp, ss), sharded


def assert_same_params(sharded_params, replicated_params, fast, tol=1e-6):
    """Every leaf of the sharded layout equals the replicated 2-D layout's (one copy per host) within ``tol``."""
    from compjax import parallel

    got, want = parallel.gather(sharded_params), parallel.gather(replicated_params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k][::fast], rtol=tol, atol=tol, err_msg=k)


def battery_problem():
    """The sharded battery's problem: ``(init, batches)``: ``w1`` (6, 16), ``b1`` (16,), ``w2`` (16, 3), ``b2`` (3,)
    and a scalar ``s`` (the last two held whole on a fast axis of 4), and five batches of 32 rows."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    init = {"w1": jnp.asarray(rng.normal(size=(6, 16)) * 0.3, jnp.float32), "b1": jnp.zeros(16),
            "w2": jnp.asarray(rng.normal(size=(16, 3)) * 0.3, jnp.float32), "b2": jnp.zeros(3), "s": jnp.zeros(())}
    batches = [(rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 3)).astype(np.float32))
               for _ in range(5)]
    return init, batches
