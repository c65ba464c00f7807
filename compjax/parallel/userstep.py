"""A user's own single-device train step, run on every worker's slice: :func:`worker_step`.

The step's arguments are sorted by kind (worker-stacked pytrees and NNX
objects, batches, keys) and handed to the step core
(:func:`compjax.parallel.core.build_step`); NNX objects are split into a
static graph and worker-stacked state, merged back inside each worker and
updated in place after the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import workers
from compjax.parallel.core import build_step, check_donatable, check_flags, is_graph_node, load_nnx
from compjax.parallel.mesh import check_axis
from compjax.parallel.placement import put, shard_batch


def _argnums(name: str, value: Any) -> tuple[int, ...]:
    vals = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise ValueError(f"{name} must be an int or a tuple of ints (positions of the step's arguments), got {value!r}")
    return vals


def worker_step(
    fn: Callable[..., Any],
    mesh: Mesh,
    *,
    axis_name: str = "data",
    batch_argnums: int | tuple[int, ...] = -1,
    rng_argnums: int | tuple[int, ...] = (),
    average: Any = (),
    worker_rngs: bool = True,
    donate: bool = False,
) -> Callable[..., Any]:
    """Turn a single-device train step into the data-parallel step over the worker-stacked layout.

    ``fn`` is the step a program already has, written for one device, e.g. a
    Flax Linen ``train_step(state, batch) -> (state, metrics)`` over a
    ``TrainState`` whose ``tx`` chains a compjax compressor, or a Flax NNX
    ``train_step(model, optimizer, metrics, batch)`` that updates its objects in
    place.  The returned step runs ``fn`` on every worker's slice under
    ``jax.shard_map`` and ``jax.jit``:

    * **worker-stacked arguments** (every argument that is neither a batch nor
      a key: pytrees from :func:`replicate`, NNX objects from
      :func:`nnx_replicate`) are sliced to this worker's copy; ``fn`` sees
      one worker's values with their usual shapes.  Gradients taken inside
      ``fn`` are then local (per-worker parameters): JAX adds no all-reduce of
      its own, and the compressor in the optimizer averages them over
      ``axis_name``;
    * **batch arguments** (``batch_argnums``, default the last) are split
      along their leading axis (:func:`shard_batch`): worker ``i`` gets rows
      ``[i*b, (i+1)*b)``;
    * **key arguments** (``rng_argnums``): one key, the same for all, from
      which each worker gets ``jax.random.fold_in(key, i)``; with
      ``worker_rngs`` the ``nnx.RngKey`` streams of NNX arguments are folded
      the same way for the step (dropout masks differ across workers and
      repeat from the same seed; the stored key stays shared, the counters
      advance);
    * **outputs**: whatever ``fn`` returns comes back worker-stacked (leading
      axis of ``n`` workers: each worker's new state, aux outputs and metrics);
      NNX arguments are updated in place with every worker's new state;
    * **average**: key names (``"batch_stats"``) of ``fn``'s outputs, or NNX
      Variable types (``nnx.BatchStat``) of its NNX arguments, averaged over
      workers after each step (one dense all-reduce per dtype); the rest stays
      per worker.  The model's own collectives inside ``fn`` (BatchNorm with
      ``axis_name=``) are allowed.

    Args:
      fn: the single-device step (jitted or not; ``nnx.jit`` works too).
      mesh: mesh with axis ``axis_name`` (n workers).
      axis_name: the data axis; compressors in ``fn``'s optimizers must use it.
      batch_argnums: positions of the batch arguments (negative counts from the end).
      rng_argnums: positions of PRNG key arguments (typed or raw), passed as one
        key for all workers.
      average: names and/or NNX Variable types to average over workers after each step.
      worker_rngs: fold the worker index into NNX arguments' ``RngKey`` streams.
      donate: donate the worker-stacked arguments' buffers (the arrays held
        before the call are deleted; NNX objects get the new ones).

    Returns:
      ``step(*args)`` with ``fn``'s arguments in the worker-stacked layout,
      returning ``fn``'s outputs with a leading worker axis.  ``step.lower(*args)``
      lowers the underlying jitted function (so
      :func:`compjax.audit_collectives` accepts ``step``); ``step.jitted`` is it.

    Raises:
      ValueError: when built, ``axis_name`` not an axis of ``mesh``, a flag not a bool, argnums not
        ints or overlapping, an ``average`` entry neither a name nor an NNX
        Variable type; when called, an argnum out of range, an NNX object or a
        non-key at a batch or key position, a batch not divisible by ``n``, a
        closed-over NNX object that ``fn`` tries to update (pass it as an
        argument), or (with ``donate``) an array already donated.

    Examples:
      A single-device step, unchanged, run on 8 workers with top-k:

      >>> import jax, jax.numpy as jnp, optax, compjax as cj
      >>> from compjax import parallel
      >>> mesh = parallel.make_mesh()
      >>> tx = optax.chain(cj.topk(0.5, axis_name="data"), optax.sgd(0.1))
      >>> @jax.jit
      ... def train_step(params, opt_state, batch):
      ...     loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p - 1.0) ** 2))(params)
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state, {"loss": loss}
      >>> params = jnp.zeros(4)
      >>> params, opt_state = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
      >>> step = parallel.worker_step(train_step, mesh)
      >>> params, opt_state, metrics = jax.block_until_ready(step(params, opt_state, jnp.ones((16, 4))))
      >>> metrics["loss"].shape, int(cj.payload_bytes(opt_state)[0])   # 2 indices + 2 values + the vote
      ((8,), 20)
    """
    check_axis(mesh, axis_name)
    check_flags(worker_rngs=worker_rngs, donate=donate)
    batch_nums, rng_nums = _argnums("batch_argnums", batch_argnums), _argnums("rng_argnums", rng_argnums)
    names, types = workers.check_average(average)

    def kinds_of(nargs: int) -> tuple[str, ...]:
        pos = {}
        for label, nums, what in (("b", batch_nums, "batch_argnums"), ("k", rng_nums, "rng_argnums")):
            for v in nums:
                if not -nargs <= v < nargs:
                    raise ValueError(f"{what} entry {v} is out of range for a step called with {nargs} arguments")
                i = v % nargs
                if i in pos:
                    raise ValueError(f"argument {i} is listed twice in batch_argnums / rng_argnums")
                pos[i] = label
        return tuple(pos.get(i, "s") for i in range(nargs))

    def body(graphdef, kinds, gstate, stacked, batches, keys):  # this worker's slices, its keys folded (build_step)
        nnx = load_nnx() if graphdef is not None else None
        objs = nnx.merge(graphdef, gstate) if graphdef is not None else ()
        saved = workers.nnx_fold_rngs(objs, axis_name) if objs and worker_rngs else None
        it = {"g": iter(objs), "s": iter(stacked), "b": iter(batches), "k": iter(keys)}
        args = [next(it[k]) for k in kinds]
        try:
            out = fn(*args)
        except Exception as e:
            from flax import errors

            if isinstance(e, errors.TraceContextError):
                raise ValueError(
                    "the step updates an NNX object it closed over (e.g. an nnx.Rngs used inside the loss), which "
                    "cannot change inside a jitted data-parallel step: pass it as an argument of the step instead "
                    "(replicated with parallel.nnx_replicate, like the model)"
                ) from e
            raise
        out = workers.average_leaves(out, names, axis_name)
        if objs:
            if saved is not None:
                nnx.update(objs, saved)
            workers.nnx_average(objs, types, axis_name)
            gstate = nnx.state(objs)
        return gstate, out

    # jitted(graphdef, kinds, gstate, stacked, batches, keys): outputs placed P(axis_name) as replicate() places
    # them, so the second call does not compile again.
    jitted = build_step(body, mesh, axis_name, "ccssbk", donate=donate)

    def prepare(args):
        kinds = kinds_of(len(args))
        for i, (a, k) in enumerate(zip(args, kinds)):
            if k != "s" and is_graph_node(a):
                raise ValueError(f"argument {i} is an NNX object, but batch_argnums / rng_argnums list it: NNX "
                                 "objects are worker-stacked arguments (parallel.nnx_replicate)")
            if k == "k" and not all(workers.is_key(x) for x in jax.tree.leaves(a)):
                raise ValueError(f"argument {i} is listed in rng_argnums but is not a PRNG key "
                                 "(jax.random.key(seed) or a raw uint32[2] key)")
        kinds = tuple("g" if k == "s" and is_graph_node(a) else k for a, k in zip(args, kinds))
        objs = tuple(a for a, k in zip(args, kinds) if k == "g")
        graphdef, gstate = load_nnx().split(objs) if objs else (None, None)
        stacked = tuple(a for a, k in zip(args, kinds) if k == "s")
        n = mesh.shape[axis_name]
        unstacked = any(np.ndim(x) == 0 or np.shape(x)[0] != n for x in jax.tree.leaves((gstate, stacked)))
        for i, a in ((i, a) for i, (a, k) in enumerate(zip(args, kinds)) if unstacked and k in "gs"):  # name it
            for path, x in jax.tree_util.tree_leaves_with_path(load_nnx().state(a) if is_graph_node(a) else a):
                if np.ndim(x) == 0 or np.shape(x)[0] != n:
                    raise ValueError(
                        f"argument {i}{jax.tree_util.keystr(path)} has shape {np.shape(x)}, not the worker-stacked "
                        f"layout (a leading axis of {n} workers): give it the worker axis first "
                        f"(parallel.replicate for pytrees, parallel.nnx_replicate for NNX objects), or list it in "
                        "batch_argnums / rng_argnums"
                    )
        if donate:
            check_donatable((gstate, stacked))
        batches = tuple(shard_batch(a, mesh, axis_name) for a, k in zip(args, kinds) if k == "b")
        keys = tuple(put(a, NamedSharding(mesh, P())) for a, k in zip(args, kinds) if k == "k")
        return objs, (graphdef, kinds, gstate, stacked, batches, keys)

    def step(*args):
        objs, jargs = prepare(args)
        gstate, out = jitted(*jargs)
        if objs:
            load_nnx().update(objs, gstate)
        return out

    step.lower = lambda *args: jitted.lower(*prepare(args)[1])
    step.jitted = jitted
    return step
