"""Every worker takes the same branch around a collective: the branch predicates of an algorithm, gathered.

A collective inside a ``lax.cond`` / ``lax.switch`` branch or a ``fori_loop`` of a traced trip count runs only
where that branch is taken; if one worker's predicate differed from another's, the workers that took the branch
would wait in its collective for the others, and XLA:CPU would abort the process ("Termination timeout ...
only 6 of them arrived").  :func:`probing` wraps ``jax.lax.cond``, ``jax.lax.switch`` and ``jax.lax.fori_loop``
while a step is traced: each call site that traces a collective inside (``jax.lax.psum``, ``pmax``,
``all_gather``, ... counted while its branches are traced) gets its predicate (the ``cond`` flag, the ``switch``
index, the loop's trip count) all-gathered over the worker axis before the branch and handed to the host
(``jax.debug.callback``).  :func:`run` trains an algorithm for a few steps with inputs that differ per worker
(targets, and NaN gradients on some workers only at chosen steps) and returns what was gathered.

Run as ``python -m tests.branch_probe ALGORITHM`` (8 simulated devices, short collective time-outs: a predicate
that differs across workers aborts the process instead of hanging); it prints one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections import defaultdict
from pathlib import Path

AXIS = "data"
N = 8
STEPS = 6
BAD_WORKERS = (0, 3, 5)  # the workers that get NaN gradients at the steps below
COLLECTIVES = ("psum", "pmean", "pmax", "pmin", "all_gather", "ppermute", "all_to_all", "psum_scatter")
HERE = str(Path(__file__).resolve().parents[1])


@contextlib.contextmanager
def probing(axis_name: str):
    """Wrap ``jax.lax``'s branching functions while tracing; yields ``(records, sites)``.

    ``records[site]`` is the list of gathered predicate vectors (one entry per worker) the host received for a
    call site (``file:line`` of the caller, past ``collectives.cond_unified``); ``sites`` the call sites that
    traced a collective inside.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from compjax import collectives

    lax = jax.lax
    originals = {name: getattr(lax, name) for name in ("cond", "switch", "fori_loop", *COLLECTIVES)}
    records: dict = defaultdict(list)
    sites: set = set()
    traced = [0]

    def site() -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if HERE in frame.filename and not frame.filename.endswith(("branch_probe.py", "collectives.py")):
                return f"{Path(frame.filename).name}:{frame.lineno}"
        return "?"

    def counted(name):
        def f(*a, **k):
            traced[0] += 1
            return originals[name](*a, **k)
        return f

    def gather(tag: str, value) -> None:
        v = jnp.asarray(value).astype(jnp.int32)
        if axis_name not in collectives.varying_axes(v):
            v = lax.pcast(v, (axis_name,), to="varying")
        g = originals["all_gather"](v, axis_name)
        jax.debug.callback(lambda x: records[tag].append(np.asarray(x).tolist()), g)

    def branching(name, pred_of):
        def f(*a, **k):
            pred = pred_of(*a, **k)
            if pred is None or not isinstance(pred, jax.core.Tracer):
                return originals[name](*a, **k)
            tag = f"{name}@{site()}"
            gather(tag, pred)
            before = traced[0]
            out = originals[name](*a, **k)
            if traced[0] > before:
                sites.add(tag)
            return out
        return f

    patched = {
        "cond": branching("cond", lambda pred, *a, **k: pred),
        "switch": branching("switch", lambda index, *a, **k: index),
        "fori_loop": branching("fori_loop", lambda lower, upper, *a, **k: upper if isinstance(
            upper, jax.core.Tracer) else lower if isinstance(lower, jax.core.Tracer) else None),
        **{name: counted(name) for name in COLLECTIVES},
    }
    for name, fn in patched.items():
        setattr(lax, name, fn)
    try:
        yield records, sites
    finally:
        for name, fn in originals.items():
            setattr(lax, name, fn)


def algorithm(name: str):
    """``(tx, nan_steps)``: the transformation and the steps at which ``BAD_WORKERS`` get NaN gradients."""
    import optax

    import compjax as cj

    top = cj.topk(0.25, axis_name=AXIS)
    return {
        # the non-finite vote (the compressor's, and cj.apply_if_finite's): NaN on 3 of 8 workers at step 1
        "skip": (cj.apply_if_finite(optax.chain(top, optax.sgd(0.1)), axis_name=AXIS), (1,)),
        # delayed averaging: the delayed mean arrives through a cond on the step count
        "delayed_averaging": (optax.chain(cj.delayed_averaging(2, axis_name=AXIS, compressor=top), optax.sgd(0.1)),
                              (2, 3)),
        # DiLoCo, 2 fragments with overlap: each fragment's sync in a loop of 0 or 1 trips; NaN on a sync step
        "diloco": (cj.diloco(optax.adam(0.01), sync_every=2, fragments=2, overlap=1, compressor=top,
                             axis_name=AXIS), (1, 2)),
        # an inner optimizer that exchanges itself: its collectives must run on every worker, local skip or not
        "diloco_inner_exchange": (cj.diloco(optax.chain(cj.topk(0.5, axis_name=AXIS), optax.adam(0.01)),
                                            sync_every=3, axis_name=AXIS), (1, 2)),
        "sparseloco": (cj.sparseloco(optax.adam(0.01), sync_every=2, k=4, chunk=8, axis_name=AXIS), (1, 2)),
        "demo": (cj.demo(0.01, k=4, chunk=8, axis_name=AXIS), (2,)),
        "multi_steps": (cj.multi_steps(optax.chain(top, optax.sgd(0.1)), 3), (1, 2)),
    }[name]


def run(name: str) -> dict:
    """Train ``name`` for ``STEPS`` steps on ``N`` workers; returns ``{"records": ..., "sites": [...]}``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import compjax as cj
    from compjax import parallel

    mesh = parallel.make_mesh(N)
    tx, nan_steps = algorithm(name)
    params = {"w": jnp.full((8, 16), 0.1), "b": jnp.zeros(16)}
    rng = np.random.default_rng(0)
    targets = {k: rng.normal(size=(N, *v.shape)).astype(np.float32) for k, v in params.items()}

    def train_step(p, s, batch):
        target, scale = batch  # this worker's target (1, ...) and gradient scale (1,): NaN on a bad worker
        grads = jax.tree.map(lambda x, t: (x - t[0]) * scale[0], p, target)
        return cj.apply_gradients(tx, grads, s, p)

    with probing(AXIS) as (records, sites):
        step = parallel.worker_step(train_step, mesh, independent=True)
        p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
        for t in range(STEPS):
            scale = np.ones(N, np.float32)
            if t in nan_steps:
                scale[list(BAD_WORKERS)] = np.nan
            p, s = jax.block_until_ready(step(p, s, (targets, scale)))
        jax.effects_barrier()
    del optax
    return {"records": {k: v for k, v in records.items()}, "sites": sorted(sites)}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
