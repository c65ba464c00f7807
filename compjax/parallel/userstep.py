"""A user's own single-device train step, run on every worker's slice: :func:`worker_step`.

The step's arguments are sorted by kind (worker-stacked pytrees and NNX
objects, batches, keys) and handed to the step core
(:func:`compjax.parallel.core.build_step`); NNX objects are split into a
static graph and worker-stacked state, merged back inside each worker and
updated in place after the step.  On a mesh with axes besides the worker
axis (a ``slow x fast`` mesh, parameters sharded by their own annotations)
the step runs manual over the worker axis only and XLA partitions each
worker's step over the other axes (``core.build_step(..., manual_only=True)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import workers
from compjax.compressors import clip
from compjax.parallel.core import (
    build_step,
    check_donatable,
    check_flags,
    crosses_axis,
    is_graph_node,
    load_nnx,
)
from compjax.parallel.mesh import check_axis, check_cpu_pool
from compjax.parallel.placement import is_padded_array, put, shard_batch


def _argnums(name: str, value: Any) -> tuple[int, ...]:
    vals = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise ValueError(f"{name} must be an int or a tuple of ints (positions of the step's arguments), got {value!r}")
    return vals


class _OwnJit(NamedTuple):
    """What ``worker_step`` reads of a step jitted with ``jax.jit`` (its own ``static_argnums``,
    ``donate_argnums``), and the function it runs inside each worker."""

    fn: Callable[..., Any]
    static_argnums: tuple
    donate_argnums: tuple


def _drop_axis(sharding: Any, axis_name: str) -> Any:
    """A ``NamedSharding`` with ``axis_name`` taken out of every entry of its spec; anything else as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    entries = []
    for e in tuple(sharding.spec):
        axes = tuple(a for a in _axes_of(e) if a != axis_name)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(sharding.mesh, P(*entries))


def _own_jit(fn: Callable[..., Any], axis_name: str) -> _OwnJit:
    """The step's own ``jax.jit`` settings, and ``fn`` with the worker axis taken out of its shardings.

    A step written for the whole mesh shards its batch over the data axis
    (``in_shardings=(..., NamedSharding(mesh, P('data')))``); inside each
    worker that axis is the worker axis itself, which JAX refuses in a
    sharding there.  Such a step is jitted again from the function it wraps,
    with ``axis_name`` taken out of every in/out sharding (each worker's rows
    are its batch) and its own static and donated arguments.  A step of
    another kind (not jitted, ``nnx.jit``) runs as it is.
    """
    info, inner = getattr(fn, "_jit_info", None), getattr(fn, "_fun", None)
    if info is None or inner is None:
        return _OwnJit(fn, (), ())
    static, donated = tuple(info.static_argnums), tuple(info.donate_argnums)
    ins, outs = tuple(info.in_shardings_leaves), tuple(info.out_shardings_leaves)

    def names_worker(s):
        return isinstance(s, NamedSharding) and any(axis_name in _axes_of(e) for e in tuple(s.spec))

    if not any(names_worker(s) for s in ins + outs):
        return _OwnJit(fn, static, donated)
    unspecified = lambda leaves: all(type(s).__name__ == "UnspecifiedValue" for s in leaves)
    kw = {}
    if not unspecified(ins):
        kw["in_shardings"] = jax.tree.unflatten(info.in_shardings_treedef, [_drop_axis(s, axis_name) for s in ins])
    if not unspecified(outs):
        kw["out_shardings"] = jax.tree.unflatten(info.out_shardings_treedef,
                                                 [_drop_axis(s, axis_name) for s in outs])
    rejit = jax.jit(inner, static_argnums=static, static_argnames=tuple(info.static_argnames), **kw)
    return _OwnJit(rejit, static, donated)


def _beyond_worker_axis(x: Any, axis_name: str) -> bool:
    """True for an array laid out beyond the 1-D worker axis: its worker axis over several mesh axes, or a
    dimension of its own sharded (``replicate(..., fast_axis=...)``, ``specs=``)."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    if spec is None or not len(spec):
        return False
    first, *rest = tuple(spec)
    return (isinstance(first, tuple) and len(first) > 1) or any(e is not None for e in rest)


def _axes_of(entry: Any) -> tuple:
    """The mesh axes of one ``PartitionSpec`` entry (None, a name or a tuple of names)."""
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _own_spec(x: Any, mesh: Mesh) -> tuple:
    """The spec entries of a worker-stacked leaf's own dimensions (after the worker axis, trailing Nones
    dropped), read from its ``NamedSharding`` on ``mesh`` (an array placed elsewhere, or not an array: held
    whole, ``()``)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
        return ()
    rest = list(tuple(sharding.spec)[1:])
    while rest and rest[-1] is None:
        rest.pop()
    return tuple(rest)


def _trimmed(x: Any, mesh: Mesh) -> Any:
    """``x`` with its spec's trailing Nones dropped (``P('data', 'fast', None)`` -> ``P('data', 'fast')``).

    The same layout and the same buffers (no copy), under the spec XLA gives
    the step's outputs: the outputs fed back then hit the compilation cache.
    """
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
        return x
    spec = tuple(sharding.spec)
    if not spec or spec[-1] is not None:
        return x
    keep = len(spec)
    while keep and spec[keep - 1] is None:
        keep -= 1
    return jax.device_put(x, NamedSharding(mesh, P(*spec[:keep])))


def _misplaced(x: Any, mesh: Mesh, axis_name: str) -> str | None:
    """Why a worker-stacked leaf cannot run on ``mesh``'s worker axis ``axis_name`` with the other axes
    automatic (None: it can): its worker axis over several mesh axes (one worker per device), or a
    dimension of its own sharded over ``axis_name``."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
        return None
    spec = tuple(sharding.spec)
    if spec and len(_axes_of(spec[0])) > 1:
        return "its worker axis runs over several mesh axes (one worker per device, replicate(..., fast_axis=...))"
    if any(axis_name in _axes_of(e) for e in spec[1:]):
        return f"a dimension of its own is sharded over the worker axis {axis_name!r}"
    return None


def worker_step(
    fn: Callable[..., Any],
    mesh: Mesh,
    *,
    axis_name: str = "data",
    batch_argnums: int | tuple[int, ...] | None = None,
    rng_argnums: int | tuple[int, ...] = (),
    average: Any = (),
    worker_rngs: bool = True,
    donate: bool | None = None,
    independent: bool = False,
    static_argnums: int | tuple[int, ...] | None = None,
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
    * **batch arguments** (``batch_argnums``, default the last argument that
      is not an NNX object, so a trailing ``rngs`` of
      ``train_step(model, optimizer, metrics, batch, rngs)`` is skipped) are split
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

    A step of your own over :func:`compjax.diloco` or :func:`compjax.sparseloco`
    may call ``params, opt_state = cj.apply_gradients(tx, grads, opt_state,
    params)`` in place of ``tx.update`` and ``optax.apply_updates``: the same
    step, with the inner updates added to the parameters where they are
    computed (the float32 updates of the whole model are never held).

    Args:
      fn: the single-device step (jitted or not; ``nnx.jit`` works too).
      mesh: mesh with axis ``axis_name`` (n workers).
      axis_name: the data axis; compressors in ``fn``'s optimizers must use it.
      batch_argnums: positions of the batch arguments (negative counts from the
        end); None: the last argument that is neither an NNX object nor
        static (``static_argnums``).
      rng_argnums: positions of PRNG key arguments (typed or raw), passed as one
        key for all workers.
      average: names and/or NNX Variable types to average over workers after each step.
      worker_rngs: fold the worker index into NNX arguments' ``RngKey`` streams.
      donate: donate the worker-stacked arguments' buffers (the arrays held
        before the call are deleted; NNX objects get the new ones).  None
        (the default): donate them when ``fn`` is a ``jax.jit`` function whose
        own ``donate_argnums`` name every worker-stacked argument (the
        outputs then reuse their buffers, as in the program alone); False
        otherwise.
      static_argnums: positions of arguments passed to ``fn`` as they are
        (hashable: a config, a flag; the step compiles once per value).  None
        (the default): ``fn``'s own ``static_argnums`` when it is a
        ``jax.jit`` function, else none.
      independent: the workers are meant to train apart (local SGD, an
        ensemble): no warning when nothing in the step crosses the worker
        axis.  Without it, a step that updates an optimizer (an
        ``nnx.Optimizer`` among its arguments, or a new optax state among its
        outputs) and in which no collective crosses ``axis_name`` (no compjax
        compressor in the optimizer, no ``lax.pmean`` of the step's own) warns
        at its first call, naming the fix: each worker would train its own
        model.  An evaluation step (``eval_step(model, metrics, batch)``)
        updates no optimizer and does not warn.

    **Porting checks.**  At its first call the step also warns when an
    optimizer it runs (closed over or named as a global by ``fn``, a Linen
    ``TrainState.tx``, an ``nnx.Optimizer``'s ``tx``) applies a norm-based
    transform before its compressor
    (:func:`compjax.compressors.clip.warn_local_norms`), and a collective of
    ``fn`` over an axis this step does not bind (a pmap program's
    ``lax.pmean(x, "batch")``, Flax's ``DynamicScale.value_and_grad(...,
    axis_name=...)``, which averages the gradients itself) is refused with a
    ``ValueError`` that names it and the fix.

    **Meshes.**  On a 1-D worker mesh (:func:`make_mesh`) every device is a
    worker.  On a mesh with other axes (``slow x fast``, :func:`make_2d_mesh`,
    axes of type ``Auto``) every index of ``axis_name`` is a worker (a host)
    and the other axes are left to XLA inside it: the step runs under a
    ``jax.shard_map`` manual over ``axis_name`` only, each worker-stacked
    array keeps its own sharding over the other axes (parameters annotated
    with ``nnx.with_partitioning`` / ``nn.with_partitioning`` and placed by
    :func:`replicate` / :func:`nnx_replicate` with ``specs=``, e.g.
    ``nnx.get_partition_spec(nnx.state(model))``; a leaf placed ``P(axis_name)``
    is held whole by every device of its worker), and XLA's sharding
    propagation gathers parameters where ``fn`` uses them, inside the host.
    ``fn`` is the same single-device step.  What crosses between workers is
    the collectives of compjax's compressors and algorithms over
    ``axis_name`` alone, each device of a worker sending its own part of the
    payload (:mod:`compjax.collectives`), so summed over a host they carry
    exactly ``payload_bytes``.  A batch is split over the workers; with one
    axis besides ``axis_name``, where its rows divide by all the devices, over
    every device (``P((axis_name, fast))``); with several (``data x fsdp x
    tensor``) each worker's rows are held whole by its devices (``P(axis_name)``,
    XLA partitions the step's activations from there): token ids split over
    the automatic axes of a partly manual program make XLA:CPU's partitioner
    abort on an embedding lookup (a gather) of a table sharded over two axes.  What ``fn`` returns with the structure and
    shapes of a worker-stacked argument (a new ``TrainState``, new
    parameters), and the NNX objects' state, keeps the arguments' shardings;
    the rest is laid out by XLA.  The numbers are those of
    :func:`data_parallel_step` with the same ``specs``.

    Returns:
      ``step(*args)`` with ``fn``'s arguments in the worker-stacked layout,
      returning ``fn``'s outputs with a leading worker axis.  ``step.lower(*args)``
      lowers the underlying jitted function (so
      :func:`compjax.audit_collectives` accepts ``step``); ``step.jitted`` is it;
      ``step.worker_of_device`` gives each device's worker (devices numbered
      as the compiled program numbers them), by which the audit tells
      collectives inside a worker from those between workers.

    Raises:
      ValueError: when built, ``axis_name`` not an axis of ``mesh``, another
        axis of more than one device of type ``Explicit``, a flag not a bool, argnums not ints or overlapping, an ``average`` entry neither a
        name nor an NNX Variable type; when called, an argnum out of range, an
        NNX object or a non-key at a batch or key position (or no argument left
        for the default batch), an argument laid out for another layout (on a
        1-D mesh: one for a 2-D mesh or sharded, ``fast_axis=`` / ``specs=``;
        on a 2-D mesh: one worker per device, ``fast_axis=``, or a dimension
        sharded over ``axis_name``), a collective of ``fn`` over an unbound
        axis (above), a batch not divisible by ``n``, a
        closed-over NNX object that ``fn`` tries to update (pass it as an
        argument), a static argument that is not hashable, a sharding over
        ``axis_name`` inside ``fn`` that cannot be translated (a constraint of
        its own), or (donating) an array already donated.

    **The program's own jit.**  A ``fn`` jitted with ``jax.jit`` keeps what
    its jit says: its ``static_argnums`` pass through as they are (unless
    ``static_argnums`` is given), its ``donate_argnums`` are honoured (see
    ``donate``), and its ``in_shardings`` / ``out_shardings`` written for the
    whole mesh (the batch over ``P('data')``, parameters over ``fsdp`` and
    ``tensor``) are kept with ``axis_name`` taken out of them: inside each
    worker the data axis is the worker axis, each worker's rows its batch.

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
    check_cpu_pool(mesh)
    check_flags(worker_rngs=worker_rngs, independent=independent)
    if donate is not None:
        check_flags(donate=donate)
    own = _own_jit(fn, axis_name)
    fn = own.fn
    static_nums = own.static_argnums if static_argnums is None else _argnums("static_argnums", static_argnums)
    others = tuple(a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1)
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    explicit = [a for a in others if types.get(a) == AxisType.Explicit]
    if explicit:
        raise ValueError(
            f"mesh axes {explicit} are of type Explicit: worker_step leaves the axes besides the worker axis "
            f"{axis_name!r} to XLA's sharding propagation, which needs them Auto. Build the mesh with "
            "parallel.make_2d_mesh(slow, fast), or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * "
            "ndim)")
    batch_nums = None if batch_argnums is None else _argnums("batch_argnums", batch_argnums)
    rng_nums = _argnums("rng_argnums", rng_argnums)
    names, types = workers.check_average(average)

    def kinds_of(args: tuple) -> tuple[str, ...]:
        nargs = len(args)
        bnums = batch_nums
        if bnums is None:  # the last argument that is no NNX object (not a trailing nnx.Rngs)
            taken = {v % nargs for v in static_nums if -nargs <= v < nargs}
            free = [i for i, a in enumerate(args) if not is_graph_node(a) and i not in taken]
            if not free:
                raise ValueError(
                    f"batch_argnums: every one of the step's {nargs} arguments is an NNX object, so none is the "
                    "batch: pass the batch as an argument and name its position with batch_argnums=<i>"
                )
            bnums = (free[-1],)
        pos = {}
        for label, nums, what in (("t", static_nums, "static_argnums"), ("b", bnums, "batch_argnums"),
                                  ("k", rng_nums, "rng_argnums")):
            for v in nums:
                if not -nargs <= v < nargs:
                    raise ValueError(f"{what} entry {v} is out of range for a step called with {nargs} arguments")
                i = v % nargs
                if i in pos:
                    raise ValueError(f"argument {i} is listed twice in static_argnums / batch_argnums / "
                                     "rng_argnums")
                pos[i] = label
        return tuple(pos.get(i, "s") for i in range(nargs))

    def body(graphdef, kinds, gstate, stacked, batches, keys):  # this worker's slices, its keys folded (build_step)
        nnx = load_nnx() if graphdef is not None else None
        objs = nnx.merge(graphdef, gstate) if graphdef is not None else ()
        saved = workers.nnx_fold_rngs(objs, axis_name) if objs and worker_rngs else None
        it = {"g": iter(objs), "s": iter(stacked), "b": iter(batches), "k": iter(keys)}
        args = [k[1] if isinstance(k, tuple) else next(it[k]) for k in kinds]  # ("t", value): static
        try:
            out = fn(*args)
        except Exception as e:
            if (unbound := _unbound_axis(e, axis_name)) is not None:
                raise unbound from e
            from flax import errors

            if isinstance(e, errors.TraceContextError):
                raise ValueError(
                    "the step updates an NNX object it closed over (e.g. an nnx.Rngs used inside the loss), which "
                    "cannot change inside a jitted data-parallel step: pass it as an argument of the step instead "
                    "(replicated with parallel.nnx_replicate, like the model)"
                ) from e
            raise
        key = _trace_key(graphdef, kinds, (gstate, stacked, batches, keys))
        trained[key] = _updates_optimizer(objs, stacked, out)
        out = workers.average_leaves(out, names, axis_name)
        if objs:
            if saved is not None:
                nnx.update(objs, saved)
            workers.nnx_average(objs, types, axis_name)
            gstate = nnx.state(objs)
        return gstate, out

    if others:
        # jitted(graphdef, kinds, layout, gstate, stacked, batches, keys): manual over the worker axis only, the
        # other axes automatic; each worker's state keeps its own sharding over them (layout: see _leaf_layout).
        def host_body(graphdef, kinds, lay, gstate, stacked, batches, keys):
            gstate, out = body(graphdef, kinds, gstate, stacked, batches, keys)
            leaves, treedef = jax.tree.flatten(gstate)
            return jax.tree.unflatten(treedef, _constrain(leaves, lay.gstate)), _keep_layout(out, lay)

        build = lambda d: build_step(host_body, mesh, axis_name, "cccssbk", donate=d, manual_only=True)
    else:
        # jitted(graphdef, kinds, gstate, stacked, batches, keys): outputs placed P(axis_name) as replicate() places
        # them, so the second call does not compile again.
        build = lambda d: build_step(body, mesh, axis_name, "ccssbk", donate=d)
    builds: dict = {}

    def jitted_for(d: bool) -> Any:
        if d not in builds:
            builds[d] = build(d)
        return builds[d]

    def donating(kinds: tuple) -> bool:
        """``donate``, or (None) whether ``fn``'s own jit donates every worker-stacked argument."""
        if donate is not None:
            return donate
        nargs = len(kinds)
        own_donated = {v % nargs for v in own.donate_argnums if -nargs <= v < nargs}
        mine = {i for i, k in enumerate(kinds) if k in ("s", "g")}
        return bool(mine) and mine <= own_donated

    def check_layout(args, kinds, gstate, stacked):
        """Refuse leaves laid out for another step; on a 1-D mesh any sharding beyond the worker axis; padded leaves."""
        for i, a in ((i, a) for i, (a, k) in enumerate(zip(args, kinds)) if k in "gs"):
            if is_graph_node(a):
                continue  # nnx_replicate refuses parallel.Padded specs
            for path, x in jax.tree_util.tree_leaves_with_path(a):
                if is_padded_array(x):
                    raise ValueError(
                        f"argument {i}{jax.tree_util.keystr(path)} is stored padded (a parallel.Padded entry of "
                        f"its specs, shape {tuple(np.shape(x))} with the worker axis): worker_step would hand it "
                        "to your step padded, and your model would train the padding. Build the specs with "
                        "parallel.fsdp_specs(..., pad_min_size=None) (such leaves are then held whole), or train "
                        "with parallel.data_parallel_step(..., specs=specs), which cuts the padding off")
        if others:
            bad = [why for why in (_misplaced(x, mesh, axis_name) for x in jax.tree.leaves((gstate, stacked))) if why]
        else:
            bad = [x for x in jax.tree.leaves((gstate, stacked)) if _beyond_worker_axis(x, axis_name)]
        if not bad:
            return
        for i, a in ((i, a) for i, (a, k) in enumerate(zip(args, kinds)) if k in "gs"):  # name it
            for path, x in jax.tree_util.tree_leaves_with_path(load_nnx().state(a) if is_graph_node(a) else a):
                where = f"argument {i}{jax.tree_util.keystr(path)}"
                if others and (why := _misplaced(x, mesh, axis_name)):
                    raise ValueError(
                        f"{where} is laid out {x.sharding.spec}: {why}. worker_step on this mesh runs one worker per "
                        f"{axis_name!r} index, the axes {others} left to XLA inside each worker: lay the state out "
                        f"with parallel.replicate(tree, mesh, specs=...) / parallel.nnx_replicate(mesh, ..., "
                        "specs=...) (specs over the other axes only), or train one worker per device with "
                        "data_parallel_step(loss_fn, tx, mesh, fast_axis=...)")
                if not others and _beyond_worker_axis(x, axis_name):
                    raise ValueError(
                        f"{where} is laid out {x.sharding.spec} on a mesh of axes {dict(x.sharding.mesh.shape)}: a "
                        f"2-D or sharded layout (fast_axis= or specs=), but this step's mesh has the worker axis "
                        f"{axis_name!r} alone. Build worker_step on the 2-D mesh the state lives on (sharded "
                        "state: parallel.replicate(tree, mesh, specs=...) / parallel.nnx_replicate(mesh, ..., "
                        "specs=...)), train it with data_parallel_step(loss_fn, tx, mesh, fast_axis=..., specs=...) "
                        "(pytrees) or nnx_data_parallel_step(loss_fn, mesh, fast_axis=...) (NNX), or lay the state "
                        "out with parallel.replicate(tree, mesh) / parallel.nnx_replicate(mesh, ...) on the 1-D mesh")

    def place_batch(a):
        if len(others) != 1:  # a 1-D mesh, or several axes besides the worker axis: each worker's rows whole
            return shard_batch(a, mesh, axis_name)
        every = (axis_name, *others)
        rows = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(a)}
        if all(r is not None and r % int(np.prod([mesh.shape[ax] for ax in every])) == 0 for r in rows):
            return jax.tree.map(lambda x: put(x, NamedSharding(mesh, P(every))), a)  # each device its rows
        return shard_batch(a, mesh, axis_name)

    def prepare(args):
        kinds = kinds_of(args)
        for i, (a, k) in enumerate(zip(args, kinds)):
            if k != "s" and is_graph_node(a):
                free = [j for j, b in enumerate(args) if not is_graph_node(b)]
                hint = f" (batch_argnums={free[-1]}, the last argument that is no NNX object)" if free else ""
                raise ValueError(f"argument {i} ({type(a).__name__}) is an NNX object, but "
                                 f"{'batch_argnums' if k == 'b' else 'rng_argnums'} lists it: NNX objects are "
                                 "worker-stacked arguments (parallel.nnx_replicate); name the batch's position with "
                                 f"batch_argnums{hint}")
            if k == "k" and not all(workers.is_key(x) for x in jax.tree.leaves(a)):
                raise ValueError(f"argument {i} is listed in rng_argnums but is not a PRNG key "
                                 "(jax.random.key(seed) or a raw uint32[2] key)")
        kinds = tuple("g" if k == "s" and is_graph_node(a) else k for a, k in zip(args, kinds))
        d = donating(kinds)
        for i, (a, k) in enumerate(zip(args, kinds)):
            if k == "t":
                try:
                    hash(a)
                except TypeError:
                    raise ValueError(
                        f"argument {i} is static (static_argnums) but not hashable ({type(a).__name__}): a static "
                        "argument is part of the compiled program's key; pass a hashable value (a frozen "
                        "dataclass, a tuple), or leave it out of static_argnums") from None
        objs = tuple(a for a, k in zip(args, kinds) if k == "g")
        graphdef, gstate = load_nnx().split(objs) if objs else (None, None)
        stacked = tuple(a for a, k in zip(args, kinds) if k == "s")
        n = mesh.shape[axis_name]
        check_layout(args, kinds, gstate, stacked)
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
        if d:
            check_donatable((gstate, stacked))
        if others:
            gstate, stacked = jax.tree.map(lambda x: _trimmed(x, mesh), (gstate, stacked))
        batches = tuple(place_batch(a) for a, k in zip(args, kinds) if k == "b")
        keys = tuple(put(a, NamedSharding(mesh, P())) for a, k in zip(args, kinds) if k == "k")
        kinds = tuple(("t", a) if k == "t" else k for a, k in zip(args, kinds))  # static values in the key
        if others:
            return objs, d, (graphdef, kinds, _leaf_layout(gstate, stacked, mesh), gstate, stacked, batches, keys)
        return objs, d, (graphdef, kinds, gstate, stacked, batches, keys)

    checked: set = set()
    trained: dict = {}  # per traced structure: whether the step updates an optimizer (recorded while tracing)
    nstatic = 3 if others else 2

    def warn_if_apart(jitted: Any, jargs: tuple) -> None:
        """At the first call per structure: warn when no collective of the step crosses ``axis_name``."""
        sig = (jargs[:nstatic], jax.tree.structure(jargs[nstatic:]),
               tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in jax.tree.leaves(jargs[nstatic:])))
        if independent or sig in checked:
            return
        checked.add(sig)
        try:
            jaxpr = jitted.trace(*jargs).jaxpr
        except ValueError as e:
            _explain_manual_axis(e, axis_name)
            raise
        if not trained.get(_trace_key(jargs[0], jargs[1], jargs[nstatic:]), True):
            return  # an evaluation step: no optimizer is updated, so no model is trained apart
        if not crosses_axis(jaxpr, axis_name):
            warnings.warn(
                f"worker_step: nothing in this step crosses the worker axis {axis_name!r} (no compressor's "
                f"collective, no collective of the step's own), so each of the {mesh.shape[axis_name]} workers "
                f"trains its own model on its own batch and the copies drift apart. Put a compjax compressor with "
                f"axis_name={axis_name!r} in the optimizer's chain, e.g. optax.chain(cj.identity(axis_name="
                f"{axis_name!r}), optax.adam(1e-3)) for the dense mean, or pass independent=True to "
                "parallel.worker_step when independent workers are meant (local SGD)",
                UserWarning, stacklevel=3)

    read_tx: list = []  # whether the optimizers were read (at the first call)

    def step(*args):
        if not read_tx:
            read_tx.append(True)
            for tx in _transforms_of(fn, args):
                clip.warn_local_norms(tx)
        objs, d, jargs = prepare(args)
        step.jitted = jitted = jitted_for(d)
        warn_if_apart(jitted, jargs)
        try:
            gstate, out = jitted(*jargs)
        except ValueError as e:
            _explain_manual_axis(e, axis_name)
            raise
        if objs:
            load_nnx().update(objs, gstate)
        return out

    def lower(*args):
        _, d, jargs = prepare(args)
        try:
            return jitted_for(d).lower(*jargs)
        except ValueError as e:
            _explain_manual_axis(e, axis_name)
            raise

    step.lower = lower
    step.jitted = jitted_for(bool(donate))
    # Each device's worker (devices numbered as the compiled program numbers them: positions in mesh.devices):
    # the audit tells collectives inside a worker from those between workers by it.
    where = mesh.axis_names.index(axis_name)
    step.worker_of_device = tuple(int(np.unravel_index(k, mesh.devices.shape)[where]) for k in range(mesh.size))
    return step


def _explain_manual_axis(e: ValueError, axis_name: str) -> None:
    """Raise a ValueError naming the fix when JAX refuses a sharding over the worker axis inside the step."""
    msg = str(e)
    if ("manual axes" in msg and repr(axis_name) in msg) or (
            "should be of type `Manual`" in msg and f"axis: {axis_name} " in msg):
        raise ValueError(
            f"the step shards something over the worker axis {axis_name!r} itself (a sharding constraint, an "
            f"in/out sharding of an inner jit, e.g. the batch's P({axis_name!r})): inside worker_step each worker "
            f"runs the step on its own slice, so {axis_name!r} cannot appear there. Take {axis_name!r} out of "
            "those specs (each worker's rows are its batch; P() or the other axes), or pass the step jitted with "
            f"jax.jit(..., in_shardings=..., out_shardings=...), whose shardings worker_step translates"
        ) from e


class _Layout(NamedTuple):
    """The own specs of a two-level :func:`worker_step`'s state (static: the step compiles once per layout).

    Attributes:
      gstate: one spec tuple per leaf of the NNX objects' state (flatten order), ``()`` for a leaf held whole.
      stacked: one entry per worker-stacked pytree argument: ``(treedef, shapes, specs)``, its tree
        structure, its leaves' shapes without the worker axis and their spec tuples.
    """

    gstate: tuple
    stacked: tuple


def _leaf_layout(gstate: Any, stacked: tuple, mesh: Mesh) -> _Layout:
    """The :class:`_Layout` of the step's state, read from the arrays' shardings (:func:`_own_spec`)."""
    per_arg = []
    for a in stacked:
        leaves, treedef = jax.tree.flatten(a)
        per_arg.append((treedef, tuple(tuple(np.shape(x))[1:] for x in leaves),
                        tuple(_own_spec(x, mesh) for x in leaves)))
    return _Layout(tuple(_own_spec(x, mesh) for x in jax.tree.leaves(gstate)), tuple(per_arg))


def _constrain(leaves: list, specs: tuple) -> list:
    """Each leaf (one worker's value, inside the step) held to its own spec over the automatic axes."""
    return [jax.lax.with_sharding_constraint(x, P(*spec)) for x, spec in zip(leaves, specs)]


def _keep_layout(out: Any, lay: _Layout) -> Any:
    """``fn``'s outputs with the shardings of the arguments they update.

    Whatever ``fn`` returns (or each element of a returned tuple or list)
    with the tree structure and shapes of a worker-stacked argument (a new
    ``TrainState``, new parameters) is held to that argument's specs, so the
    step's outputs come back laid out as its inputs (the next call does not
    compile again); the rest is left to XLA.
    """
    def match(tree):
        leaves, treedef = jax.tree.flatten(tree)
        shapes = tuple(tuple(np.shape(x)) for x in leaves)
        for t, s, specs in lay.stacked:
            if t == treedef and s == shapes:
                return jax.tree.unflatten(treedef, _constrain(leaves, specs))
        return None

    whole = match(out)
    if whole is not None:
        return whole
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(m if (m := match(o)) is not None else o for o in out)
    return out


def _trace_key(graphdef: Any, kinds: tuple, dynamic: tuple) -> tuple:
    """What identifies one trace of the step's body: its static arguments and the structure of the rest."""
    return graphdef, kinds, jax.tree.structure(dynamic)


def _is_optimizer_state(x: Any) -> bool:
    """An optax or compjax optimizer state: a NamedTuple defined in either (``ScaleByAdamState``, ``TopkState``)."""
    return hasattr(x, "_fields") and (type(x).__module__ or "").startswith(("optax", "compjax"))


def _updates_optimizer(objs: tuple, stacked: tuple, out: Any) -> bool:
    """Whether a step (traced inside one worker) updates an optimizer, so that it trains a model.

    True when an ``nnx.Optimizer`` is among the NNX objects, or when ``out``
    holds an optax/compjax optimizer state that is not the argument's state
    passed through unchanged (a Linen ``train_step`` returns the new
    ``TrainState``; an ``eval_step`` returns metrics, or the state with new
    metrics only).  An evaluation step (``eval_step(model, metrics, batch)``)
    updates none.
    """
    if objs:
        nnx = load_nnx()
        if any(isinstance(node, nnx.Optimizer) for o in objs for _, node in nnx.iter_graph(o)):
            return True
    given = {id(x) for x in jax.tree.leaves(stacked)}
    for s in (x for x in jax.tree.leaves(out, is_leaf=_is_optimizer_state) if _is_optimizer_state(x)):
        leaves = jax.tree.leaves(s)
        if not leaves or any(id(x) not in given for x in leaves):
            return True
    return False


def _is_transform(x: Any) -> bool:
    return isinstance(x, (optax.GradientTransformation, optax.GradientTransformationExtraArgs))


def _transforms_of(fn: Callable, args: tuple) -> list:
    """The optimizers a user's step runs: closed over or named as globals by ``fn`` (through ``jax.jit`` /
    ``functools.wraps`` wrappers), a Linen ``TrainState.tx`` in the arguments, an ``nnx.Optimizer``'s ``tx``."""
    found: list = []

    def add(x: Any) -> None:
        if _is_transform(x) and not any(x is y for y in found):
            found.append(x)

    f, depth = fn, 0
    while f is not None and depth < 8:
        code = getattr(f, "__code__", None)
        if code is not None:
            for cell in f.__closure__ or ():
                try:
                    add(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            glob = getattr(f, "__globals__", {})
            for name in code.co_names:
                add(glob.get(name))
        f, depth = getattr(f, "__wrapped__", None), depth + 1
    for a in args:
        if is_graph_node(a):
            nnx = load_nnx()
            for _, node in nnx.iter_graph(a):
                if isinstance(node, nnx.Optimizer):
                    add(node.tx)
            continue
        for x in jax.tree.leaves(a, is_leaf=lambda x: _is_transform(getattr(x, "tx", None))):
            add(getattr(x, "tx", None))
    return found


def _unbound_axis(e: BaseException, axis_name: str) -> ValueError | None:
    """The error to raise instead of JAX's bare one when a collective of the step names an axis not bound here.

    A pmap program's ``lax.pmean(x, "batch")``, or Flax's
    ``DynamicScale.value_and_grad(..., axis_name="batch")`` (which pmeans the
    gradients itself), fails inside :func:`worker_step` with an
    ``AssertionError`` without a message (or a ``NameError``).  Read from the
    traceback: frames of ``jax/_src/lax/parallel.py`` (the collectives) or of
    ``flax/training/dynamic_scale.py``.  None when ``e`` is something else.
    """
    if not isinstance(e, (AssertionError, NameError)) or (isinstance(e, AssertionError) and str(e)):
        return None  # JAX's is a bare assertion: one with a message is the user's own
    collective, scale, axes = False, False, None
    tb = e.__traceback__
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith("flax/training/dynamic_scale.py"):
            scale = True
            axes = frame.f_locals.get("axis_name", axes)
        elif path.endswith("jax/_src/lax/parallel.py"):
            collective = True
            axes = axes if axes is not None else frame.f_locals.get("axis_name")
    named = f" {axes!r}" if isinstance(axes, (str, tuple)) else ""
    if scale:
        given = f"axis_name={axes!r}" if named else "an axis_name"
        return ValueError(
            f"the step calls flax.training.dynamic_scale.DynamicScale.value_and_grad with {given}, which "
            f"averages the gradients over that axis itself (lax.pmean), and the worker axis "
            f"here is {axis_name!r}. Call it without axis_name (value_and_grad(loss_fn)): each worker scales and "
            "checks its own gradients, the compjax compressor in the optimizer averages them over the workers, and "
            "its non-finite vote makes every worker skip a step together")
    if collective:
        return ValueError(
            f"a collective in the step names the axis{named} that is not bound here: worker_step binds the worker "
            f"axis {axis_name!r} alone. A pmap program's lax.pmean/psum of the gradients is no longer needed "
            "(the compjax compressor in the optimizer averages them): remove it; a metric's lax.pmean may use "
            f"{axis_name!r}")
    return None
