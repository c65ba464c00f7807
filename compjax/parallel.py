"""Data-parallel plumbing: meshes, the worker-stacked state layout and train-step builders.

Layout: parameters and optimizer state carry a leading worker axis of size n
(one slice per worker), sharded over the mesh's data axis with
``P(axis_name)``, so device i holds worker i's copy; inside ``jax.shard_map``
each device takes its slice ``x[0]``, runs the step on unstacked values and
re-stacks the result with ``x[None]``.  Keeping parameters worker-stacked (each
worker its own copy, kept equal by the compressor's mean) means gradients are
taken with respect to per-worker values, so JAX inserts no dense all-reduce of
its own: the compiled step carries only the compressor's collectives.

Two front ends share this layout: pure pytrees (:func:`replicate`,
:func:`init_worker_state`, :func:`data_parallel_step`) and Flax NNX objects,
whose Variables are stacked in place (:func:`nnx_replicate`,
:func:`nnx_data_parallel_step`, :func:`nnx_unreplicate`).

Two-level meshes (:func:`make_2d_mesh`): a slow axis between hosts (or slices)
and a fast axis inside each one.  With ``fast_axis=`` the worker axis of the
layout runs over both mesh axes (``P((axis_name, fast_axis))``, one worker per
device); :func:`data_parallel_step` averages gradients densely over the fast
axis and leaves only the slow axis to the compressor.

Sharded parameters (FSDP, ``specs=``): on a 2-D mesh the worker axis runs over
the slow axis only and every large leaf of the parameters, optimizer state and
compressor state is sharded over the fast axis inside it
(``P(axis_name, *spec)``; :func:`fsdp_specs` gives a default rule).  The step
all-gathers the parameters over the fast axis for the forward pass; the gradient
through that gather is a reduce-scatter (a sum over the fast axis, divided by its
size), each device updates its own shard, and the compressors see whole layers
(:mod:`compjax.layout`): the numbers are those of the replicated layout, with
``1/fast`` of the state on each device.

Several processes (``jax.distributed``): every function here takes global
arrays spanning all processes' devices; host values (parameters, a global batch)
must be the same on every process, and :func:`gather` brings a worker-stacked
tree back to every host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import collectives, layout, workers

__all__ = [
    "data_parallel_step",
    "fsdp_specs",
    "gather",
    "init_worker_state",
    "local_view",
    "make_2d_mesh",
    "make_mesh",
    "nnx_data_parallel_step",
    "nnx_replicate",
    "nnx_unreplicate",
    "replicate",
    "shard_batch",
    "state_specs",
    "unreplicate",
    "worker_step",
]


def make_mesh(num_workers: int | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh of ``num_workers`` devices (default: all) with axis ``axis_name``.

    The axis is of type ``Auto``: arrays the data-parallel steps return (worker-stacked,
    sharded over the axis) can be indexed and reduced on the host (``loss[0]``,
    ``metrics.compute()``), which JAX's default ``Explicit`` axes refuse without an
    ``out_sharding``.

    Raises:
      ValueError: ``num_workers`` < 1 or more than the available devices.
    """
    n_dev = len(jax.devices())
    n = n_dev if num_workers is None else int(num_workers)
    if not 1 <= n <= n_dev:
        raise ValueError(f"num_workers must be in [1, {n_dev}] (the available devices), got {num_workers}")
    # Auto axes (not JAX's default Explicit): the worker-stacked arrays a step returns then read on the host
    # like any array (``loss[0]``, ``int(state.step[0])``, flax metrics' reset), with no out_sharding needed.
    return jax.make_mesh((n,), (axis_name,), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def make_2d_mesh(slow: int, fast: int, *, slow_axis: str = "data", fast_axis: str = "fast") -> Mesh:
    """A ``slow x fast`` mesh: a slow axis between hosts, a fast axis inside each host.

    Devices are taken in (process, device id) order and laid out row-major, so
    each row (the ``fast`` devices that share a ``slow`` index) lies inside one
    process whenever ``fast`` divides the devices of a process: the fast axis
    then stays on the host's own interconnect (NVLink, ICI) and only the slow
    axis crosses the network.

    Args:
      slow: size of the slow axis (hosts or slices), >= 1.
      fast: size of the fast axis (devices per host), >= 1.
      slow_axis: name of the slow axis; compressors take it as ``axis_name``.
      fast_axis: name of the fast axis.

    Returns:
      A ``jax.sharding.Mesh`` with axes ``(slow_axis, fast_axis)`` over the
      first ``slow * fast`` devices.

    Raises:
      ValueError: a size < 1, ``slow * fast`` more than the available devices,
        equal axis names, or a fast row that would straddle two processes.

    Examples:
      >>> from compjax import parallel
      >>> mesh = parallel.make_2d_mesh(2, 4)     # 8 devices: 2 "hosts" of 4
      >>> dict(mesh.shape)
      {'data': 2, 'fast': 4}
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    for name, v in (("slow", slow), ("fast", fast)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1 (devices along the {name} axis), got {v}")
    if slow * fast > len(devices):
        raise ValueError(f"slow x fast = {slow} x {fast} = {slow * fast} devices, but only {len(devices)} are "
                         "available")
    if slow_axis == fast_axis:
        raise ValueError(f"slow_axis and fast_axis must differ, both are {slow_axis!r}")
    grid = np.array(devices[: slow * fast], dtype=object).reshape(slow, fast)
    for row in grid:
        if len({d.process_index for d in row}) > 1:
            raise ValueError(f"fast = {fast} devices per row straddles processes (each process has "
                             f"{jax.local_device_count()} devices): choose a fast size that divides it")
    return Mesh(grid, (slow_axis, fast_axis))


def _worker_axes(mesh: Mesh, axis_name: str, fast_axis: str | None) -> tuple[int, Any]:
    """``(n, spec entry)``: the number of workers and the mesh axes the worker axis is sharded over."""
    if fast_axis is None:
        return mesh.shape[axis_name], axis_name
    return mesh.shape[axis_name] * mesh.shape[fast_axis], (axis_name, fast_axis)


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Host or device value ``x`` (the same on every process) as a global array with ``sharding``."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(tree: Any, mesh: Mesh, axis_name: str = "data", *, fast_axis: str | None = None,
              specs: Any = None) -> Any:
    """Stack ``n`` copies of every leaf on a new leading axis, sharded ``P(axis_name)``.

    Args:
      tree: pytree of arrays of any shapes (one worker's values; the same on
        every process).
      mesh: the mesh; ``n = mesh.shape[axis_name]``.
      axis_name: the data axis (the slow axis of a 2-D mesh).
      fast_axis: the fast axis of a 2-D mesh (:func:`make_2d_mesh`), or None:
        then ``n = slow x fast`` workers, sharded ``P((axis_name, fast_axis))``.
        Ignored with ``specs``.
      specs: sharded parameters: a tree like ``tree`` of ``PartitionSpec``s
        (or None, a leaf held whole) over each leaf's own dimensions, naming one
        fast mesh axis (:func:`fsdp_specs`).  The worker axis then runs over
        ``axis_name`` only and leaf ``x`` is placed ``P(axis_name, *spec)``: each
        device holds ``1/fast`` of it.

    Returns:
      The same tree with leaves of shape ``(n, *shape)``, one slice per device
      (or its shard, with ``specs``), each leaf in buffers of its own (safe to
      donate).

    Raises:
      ValueError: bad ``specs`` (see :func:`fsdp_specs` for the rules), named by leaf.
    """
    if specs is not None:
        leaf_specs = _leaf_specs(tree, specs, mesh, axis_name)
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [_stack_copies(x, mesh, axis_name, None, spec)
                                            for x, spec in zip(leaves, leaf_specs)])
    return jax.tree.map(lambda x: _stack_copies(x, mesh, axis_name, fast_axis), tree)


def _stack_copies(x: Any, mesh: Mesh, axis_name: str, fast_axis: str | None = None,
                  spec: P | None = None) -> jax.Array:
    """``n`` copies of ``x`` stacked on a new leading axis, in a new buffer, sharded over the worker axes.

    The spec names the worker axes only (``P(axis_name)``), as the step
    builders return their outputs (``out_shardings``): the same sharding on the
    first and later calls, so the step's second call does not compile again.
    With ``spec`` (sharded parameters) the leaf's own dimensions follow it.
    """
    n, axes = _worker_axes(mesh, axis_name, fast_axis)
    x = jnp.asarray(x) if jax.process_count() == 1 else np.asarray(x)
    sharding = NamedSharding(mesh, _stacked_spec(axes, spec))
    stacked = jnp.broadcast_to(x[None], (n, *x.shape)) if jax.process_count() == 1 else \
        np.broadcast_to(x[None], (n, *x.shape))
    return _put(stacked, sharding)


def unreplicate(tree: Any) -> Any:
    """This process's first worker's slice of a worker-stacked tree, as host NumPy arrays.

    In a single process that is worker 0; with several processes, the first
    worker this process holds (parameters and other replicated values are the
    same on every worker).  A leaf sharded over a fast axis (``specs=``) comes
    back whole.
    """
    def first(x):
        if not hasattr(x, "addressable_shards"):
            return np.asarray(x)[0]
        spec = getattr(x.sharding, "spec", None)
        if spec is not None and any(e is not None for e in tuple(spec)[1:]):  # a shard is not the whole worker
            return np.asarray(gather(x))[0]
        return np.asarray(x.addressable_shards[0].data)[0]

    return jax.tree.map(first, tree)


def local_view(tree: Any) -> Any:
    """This process's first worker slice of a worker-stacked tree, kept on its device, shape ``(1, ...)``.

    No copy to the host: for reading small fields (byte counters, flags) of a
    state whose arrays span several processes, e.g.
    ``cj.payload_bytes(parallel.local_view(opt_state))[0]``.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x[:1], tree)


def gather(tree: Any) -> Any:
    """A worker-stacked (or any sharded) tree as whole host NumPy arrays, on every process.

    With one process this is ``np.asarray`` per leaf; with several, every
    process must call it (it is a collective over processes:
    ``jax.experimental.multihost_utils.process_allgather``).
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def shard_batch(batch: Any, mesh: Mesh, axis_name: str = "data", *, fast_axis: str | None = None) -> Any:
    """Put a global batch on the mesh, split along its leading (batch) axis.

    Worker ``i`` (of ``n``) gets rows ``[i*b, (i+1)*b)``, ``b = rows / n``.  With
    several processes, every process passes the same global batch.

    Args:
      batch: pytree of arrays whose leading dimensions are the global batch.
      mesh, axis_name, fast_axis: as in :func:`replicate`.

    Raises:
      ValueError: a leading dimension not divisible by the number of workers.
    """
    n, axes = _worker_axes(mesh, axis_name, fast_axis)
    for x in jax.tree.leaves(batch):
        if jnp.shape(x)[0] % n:
            raise ValueError(f"batch leading dimension {jnp.shape(x)[0]} is not divisible by {n} workers")
    return jax.tree.map(lambda x: _put(x, NamedSharding(mesh, P(axes))), batch)


def init_worker_state(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh, axis_name: str = "data", *,
    fast_axis: str | None = None, specs: Any = None,
) -> Any:
    """``tx.init(params)`` replicated into the worker-stacked layout (every worker starts equal).

    With ``specs`` (sharded parameters, as given to :func:`replicate`), every
    part of the state shaped like the parameters (optimizer moments, residuals,
    DGC's velocity, DiLoCo's global parameters) is sharded like them
    (:func:`state_specs`); the rest (counters, keys, byte counts) is held
    whole by every fast device.
    """
    state = tx.init(params)
    if specs is not None:
        return replicate(state, mesh, axis_name, specs=state_specs(tx, params, specs, mesh))
    return replicate(state, mesh, axis_name, fast_axis=fast_axis)


def state_specs(tx: optax.GradientTransformation, params: Any, specs: Any, mesh: Mesh) -> Any:
    """PartitionSpecs for ``tx``'s state when the parameters are sharded by ``specs``.

    ``tx.init`` is evaluated abstractly on the whole parameters and on one
    device's shards (:func:`compjax.layout.scaled_dims`): a state leaf ``fast``
    times larger in one dimension for the whole parameters is sharded along it
    (optax's moments, a compressor's residual, DGC's velocity, DiLoCo's global
    parameters and outer momentum, delayed averaging's history); every other
    leaf (counters, keys, byte counts) is held whole by every fast device.

    Args:
      tx: the optimizer (its ``init`` is only traced, nothing is allocated).
      params: the parameters without the worker axis (arrays or ``jax.ShapeDtypeStruct``).
      specs: a tree like ``params`` of ``PartitionSpec`` (or None), one fast axis.
      mesh: the mesh the specs refer to.

    Returns:
      A tree like ``tx.init(params)`` of ``PartitionSpec``, without the worker axis.

    Raises:
      ValueError: bad ``specs`` (see :func:`replicate`).
    """
    leaf_specs = _leaf_specs(params, specs, mesh, None)
    dims, fast = _shard_dims(leaf_specs)
    leaves, treedef = jax.tree.flatten(params)
    whole = [jax.ShapeDtypeStruct(tuple(np.shape(x)), jnp.result_type(x)) for x in leaves]
    size = mesh.shape[fast] if fast is not None else 1
    shards = [w if d is None else jax.ShapeDtypeStruct(w.shape[:d] + (w.shape[d] // size,) + w.shape[d + 1:], w.dtype)
              for w, d in zip(whole, dims)]
    state = jax.eval_shape(tx.init, jax.tree.unflatten(treedef, whole))
    state_dims = layout.scaled_dims(tx.init, jax.tree.unflatten(treedef, whole), jax.tree.unflatten(treedef, shards),
                                    size)
    out = [P() if d is None else P(*([None] * d + [fast])) for d in state_dims]
    return jax.tree.unflatten(jax.tree.structure(state), out)


def _spec_leaves(specs: Any, treedef: Any) -> list:
    """``specs`` flattened against ``treedef`` (PartitionSpec and None leaves)."""
    try:
        return treedef.flatten_up_to(specs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"specs must have the structure of the tree it describes ({treedef}), with one "
                         f"PartitionSpec (or None) per leaf, e.g. parallel.fsdp_specs(params, mesh): {e}") from None


def _stacked_spec(axes: Any, spec: P | None) -> P:
    """The spec of a worker-stacked leaf: the worker axes, then the leaf's own."""
    return P(axes) if spec is None else P(axes, *tuple(spec))


def _leaf_specs(tree: Any, specs: Any, mesh: Mesh, axis_name: str) -> list:
    """``specs`` checked against ``tree`` and ``mesh``: one ``PartitionSpec`` or None per leaf.

    Raises:
      ValueError: a spec naming an axis not in the mesh, the worker axis, an
        axis twice, more than one fast axis in all, more dimensions than the
        leaf has, or a dimension the axis size does not divide; named by leaf.
    """
    paths = jax.tree_util.tree_leaves_with_path(tree)
    leaves = _spec_leaves(specs, jax.tree.structure(tree))
    fast = set()
    for (path, x), spec in zip(paths, leaves):
        if spec is None:
            continue
        name = jax.tree_util.keystr(path) or "<root>"
        if not isinstance(spec, P):
            raise ValueError(f"specs{name} must be a PartitionSpec or None, got {spec!r}")
        shape = np.shape(x)
        if len(spec) > len(shape):
            raise ValueError(f"specs{name} = {spec} has {len(spec)} entries for a leaf of shape {shape}")
        seen = []
        for dim, entry in enumerate(tuple(spec)):
            for ax in (entry if isinstance(entry, tuple) else (entry,)) if entry is not None else ():
                if ax not in mesh.axis_names:
                    raise ValueError(f"specs{name} = {spec} names axis {ax!r}, which is not an axis of the mesh "
                                     f"(axes {tuple(mesh.axis_names)})")
                if ax == axis_name:
                    raise ValueError(f"specs{name} = {spec} names {ax!r}, the worker axis: shard a leaf over the "
                                     "fast axis only (the worker axis is added in front)")
                if ax in seen:
                    raise ValueError(f"specs{name} = {spec} shards over axis {ax!r} twice")
                seen.append(ax)
                fast.add(ax)
            if isinstance(entry, tuple) and len(entry) > 1:
                raise ValueError(f"specs{name} = {spec} shards dimension {dim} over several axes {entry}: "
                                 "one fast axis per dimension")
            for ax in (entry if isinstance(entry, tuple) else (entry,)) if entry is not None else ():
                if shape[dim] % mesh.shape[ax]:
                    raise ValueError(f"specs{name} = {spec} shards dimension {dim} of shape {shape} over {ax!r} "
                                     f"of size {mesh.shape[ax]}, which does not divide it: shard another "
                                     "dimension or keep the leaf whole (None), as fsdp_specs does")
        if len(seen) > 1:
            raise ValueError(f"specs{name} = {spec} shards over several axes {tuple(seen)}: one fast axis only")
    if len(fast) > 1:
        raise ValueError(f"specs shard over several axes {sorted(fast)}: one fast axis only")
    return leaves


def _shard_dims(leaf_specs: Sequence) -> tuple[list, str | None]:
    """The sharded dimension of each leaf (None: whole) and the fast axis the specs name."""
    dims, fast = [], None
    for spec in leaf_specs:
        dim = None
        for d, entry in enumerate(tuple(spec) if spec is not None else ()):
            if entry is not None:
                dim, fast = d, entry[0] if isinstance(entry, tuple) else entry
        dims.append(dim)
    return dims, fast


def fsdp_specs(params: Any, mesh: Mesh, *, fast_axis: str = "fast", min_size: int = 1024) -> Any:
    """A default sharding rule for the parameters over the fast axis (FSDP, ZeRO-3 style).

    Each leaf of at least ``min_size`` elements is sharded over ``fast_axis``
    along its largest dimension that the axis size divides (the first such
    dimension on a tie); scalars, small leaves and leaves with no such
    dimension are held whole by every fast device (``P()``).

    Args:
      params: pytree of arrays (one worker's parameters, no worker axis) or
        ``jax.ShapeDtypeStruct``.
      mesh: a 2-D mesh (:func:`make_2d_mesh`).
      fast_axis: the mesh axis to shard over.
      min_size: leaves with fewer elements stay whole, an int >= 1.

    Returns:
      A tree like ``params`` of ``PartitionSpec`` (``P()``: whole), for :func:`replicate`,
      :func:`init_worker_state` and :func:`data_parallel_step`'s ``specs=``.

    Raises:
      ValueError: ``fast_axis`` not an axis of ``mesh``, or ``min_size`` < 1.

    Examples:
      >>> import jax.numpy as jnp
      >>> mesh = make_2d_mesh(2, 4)
      >>> fsdp_specs({"w": jnp.zeros((1024, 6)), "b": jnp.zeros(6)}, mesh)
      {'b': P(), 'w': P('fast', None)}
    """
    _check_axis(mesh, fast_axis)
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
    f = mesh.shape[fast_axis]

    def rule(x):
        shape = tuple(np.shape(x))
        if int(np.prod(shape, dtype=np.int64)) < min_size or not shape:
            return P()
        best = max((d for d in range(len(shape)) if shape[d] % f == 0), key=lambda d: (shape[d], -d), default=None)
        if best is None:
            return P()
        return P(*([None] * best + [fast_axis] + [None] * (len(shape) - best - 1)))

    return jax.tree.map(rule, params)


def data_parallel_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    fast_axis: str | None = None,
    specs: Any = None,
    has_aux: bool = False,
    rng: bool = False,
    donate: bool = False,
) -> Callable[..., tuple]:
    """Build a jitted data-parallel train step under ``jax.shard_map``.

    Each worker computes ``loss_fn(params, local_batch)`` and its gradient with
    respect to its own copy of the parameters, passes the local gradients to
    ``tx`` (whose compressor averages them over ``axis_name``) and applies the
    updates.

    On a 2-D mesh (``fast_axis`` given, :func:`make_2d_mesh`), the local
    gradients are first averaged densely over the fast axis (one bucketed
    float all-reduce inside each host, ``collectives.dense_mean_arrays``), and
    ``tx`` sees that host-level mean: its compressor, built with ``axis_name``
    (the slow axis), compresses only what crosses between hosts.  The workers of
    one fast row then hold the same gradients, compressor states and
    parameters.  With equal local batches this equals a 1-D run over the slow
    axis alone whose workers each take their row's whole batch.  Each fast
    device sends ``1/fast`` of its host's compressed payload over the slow
    axis (:mod:`compjax.collectives`), so the slow link carries it once per host.

    With ``specs`` (sharded parameters, FSDP), parameters and state are laid
    out by :func:`replicate` / :func:`init_worker_state` with the same
    ``specs``: the worker axis runs over ``axis_name`` only and each device
    holds a shard.  Each step all-gathers the parameters over the fast axis for
    ``loss_fn`` (inside the host), takes the gradient with respect to the
    shards (a reduce-scatter: the fast-axis sum, divided by its size: the
    host's mean gradient, as in the replicated layout), and ``tx`` updates each
    device's shard; its compressors see whole layers (:mod:`compjax.layout`),
    so the numbers equal the replicated 2-D layout's.

    A step of one's own (a Flax ``TrainState``, mutable collections, metrics)
    is :func:`worker_step` over it.

    Args:
      loss_fn: ``(params, batch) -> scalar loss`` for one worker's batch;
        ``-> (loss, aux)`` with ``has_aux``; ``(params, batch, key)`` with ``rng``.
      tx: an optax transformation whose compressor uses ``axis_name``.
      mesh: mesh with axis ``axis_name`` (n workers), or a 2-D mesh.
      axis_name: the data axis (the slow axis of a 2-D mesh).
      fast_axis: the fast axis of a 2-D mesh, averaged densely; None for a 1-D
        mesh (with ``specs``: the axis they name).
      specs: None, or a tree like the parameters (without the worker axis) of
        ``PartitionSpec`` over one fast axis (:func:`fsdp_specs`).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns each
        worker's ``aux`` too (e.g. logits or an accuracy).
      rng: the step takes a PRNG key (typed or raw, one for all workers) and
        passes ``loss_fn`` this worker's ``jax.random.fold_in(key, i)``
        (``i`` the worker index over all worker axes): different draws on
        every worker, the same on every run.
      donate: donate the params and state buffers to the step.

    Returns:
      ``step(params, opt_state, batch[, key]) -> (params, opt_state, loss[, aux])``;
      params and opt_state worker-stacked (:func:`replicate`,
      :func:`init_worker_state`), batch sharded along its leading axis
      (:func:`shard_batch`), loss of shape ``(n,)`` (each worker's local loss;
      ``n = slow x fast`` on a 2-D mesh), aux each worker's with a leading
      axis of n.

    Raises:
      ValueError: when built, ``axis_name`` or ``fast_axis`` not an axis of ``mesh``,
        or a flag (``has_aux``, ``rng``, ``donate``) not a bool; at the first
        call, ``specs`` that do not fit the parameters (named by leaf).
    """
    _check_axis(mesh, axis_name)
    _check_flags(has_aux=has_aux, rng=rng, donate=donate)
    if fast_axis is not None:
        _check_axis(mesh, fast_axis)
    if specs is not None:
        return _sharded_step(loss_fn, tx, mesh, axis_name, fast_axis, specs, has_aux, rng, donate)
    axes = _worker_axes(mesh, axis_name, fast_axis)[1]
    spec = P(axes)

    def local(x):
        return x[0]

    def stack(x):
        return x[None]

    def body(params, opt_state, batch, *key):
        params, opt_state = jax.tree.map(local, (params, opt_state))
        args = (batch, workers.fold_worker(key[0], axes)) if rng else (batch,)
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *args)
        loss, aux = out if has_aux else (out, None)
        if fast_axis is not None:
            grads = _fast_mean(grads, fast_axis)
            with layout.fast_layout(fast_axis):  # one host's devices share the slow-axis payload
                updates, opt_state = tx.update(grads, opt_state, params)
        else:
            updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        outs = (params, opt_state, loss) + ((aux,) if has_aux else ())
        return jax.tree.map(stack, outs)

    n_out = 4 if has_aux else 3
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec) + ((P(),) if rng else ()),
                            out_specs=(spec,) * n_out)
    # One sharding for every output, the one replicate() and shard_batch() place: the second call hits the cache.
    jitted = jax.jit(sharded, donate_argnums=(0, 1) if donate else (), out_shardings=NamedSharding(mesh, spec))
    return _keyed(jitted, mesh) if rng else jitted


def _keyed(jitted: Callable, mesh: Mesh) -> Callable:
    """``step(params, opt_state, batch, key)`` checking the key and placing it on every device."""
    def step(params, opt_state, batch, key):
        if not all(workers.is_key(k) for k in jax.tree.leaves(key)) or not jax.tree.leaves(key):
            raise ValueError(f"key must be a PRNG key (jax.random.key(seed) or a raw uint32[2] key), got {key!r}")
        return jitted(params, opt_state, batch, _put(key, NamedSharding(mesh, P())))

    step.lower = lambda params, opt_state, batch, key: jitted.lower(
        params, opt_state, batch, _put(key, NamedSharding(mesh, P())))
    step.jitted = jitted
    return step


def _logical(tree: Any) -> Any:
    """Shapes and dtypes of a worker-stacked tree without its worker axis."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], jnp.result_type(x)), tree)


def _sharded_step(loss_fn, tx, mesh, axis_name, fast_axis, specs, has_aux, rng, donate) -> Callable[..., tuple]:
    """:func:`data_parallel_step` over parameters sharded by ``specs`` (built at the first call, per tree)."""
    cache: dict = {}

    def build(params, opt_state):
        logical = _logical(params)
        leaf_specs = _leaf_specs(logical, specs, mesh, axis_name)
        dims, named = _shard_dims(leaf_specs)
        fast = fast_axis or named
        if fast is None:
            raise ValueError("specs shard no leaf: pass fast_axis= (or drop specs= for the replicated 2-D layout)")
        if named is not None and named != fast:
            raise ValueError(f"specs shard over {named!r} but fast_axis={fast!r}")
        treedef = jax.tree.structure(logical)
        pspecs = jax.tree.unflatten(treedef, [_stacked_spec(axis_name, s) for s in leaf_specs])
        sspecs = jax.tree.map(lambda s: _stacked_spec(axis_name, s),
                              state_specs(tx, logical, jax.tree.unflatten(treedef, leaf_specs), mesh),
                              is_leaf=lambda x: isinstance(x, P))
        per_device = P((axis_name, fast))
        size = mesh.shape[fast]

        def whole(ps):  # the forward pass's parameters, gathered inside the host
            return jax.tree.unflatten(treedef, _gather_whole(jax.tree.leaves(ps), dims, fast))

        def body(params, opt_state, batch, *key):
            params, opt_state = jax.tree.map(lambda x: x[0], (params, opt_state))
            args = (batch, workers.fold_worker(key[0], (axis_name, fast))) if rng else (batch,)
            out, grads = jax.value_and_grad(lambda ps, *a: loss_fn(whole(ps), *a), has_aux=has_aux)(params, *args)
            loss, aux = out if has_aux else (out, None)
            grads = jax.tree.unflatten(treedef, _host_mean(jax.tree.leaves(grads), size))
            with layout.fast_layout(fast, grads, dims):
                updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            outs = (params, opt_state, loss) + ((aux,) if has_aux else ())
            return jax.tree.map(lambda x: x[None], outs)

        out_specs = (pspecs, sspecs, per_device) + ((per_device,) if has_aux else ())
        sharded = jax.shard_map(body, mesh=mesh, in_specs=(pspecs, sspecs, per_device) + ((P(),) if rng else ()),
                                out_specs=out_specs)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(sharded, donate_argnums=(0, 1) if donate else (), out_shardings=shardings)

    def get(params, opt_state):
        key = (jax.tree.structure((params, opt_state)),
               tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves((params, opt_state))))
        if key not in cache:
            cache[key] = build(params, opt_state)
        return cache[key]

    def jitted(params, opt_state, batch, *key):
        return get(params, opt_state)(params, opt_state, batch, *key)

    jitted.lower = lambda params, opt_state, batch, *key: get(params, opt_state).lower(params, opt_state, batch, *key)
    jitted._cache_size = lambda: sum(f._cache_size() for f in cache.values())  # compilations, as jax.jit's
    return _keyed(jitted, mesh) if rng else jitted


def _gather_whole(leaves: Sequence, dims: Sequence, fast: str) -> list:
    """Each leaf whole: a shard (``dims`` entry an int) all-gathered over ``fast`` inside the host, else as it is."""
    return [x if d is None else collectives.gather_shards(x, fast, d) for x, d in zip(leaves, dims)]


def _host_mean(grads: Sequence, size: int) -> list:
    """The host's mean gradient from the gradient with respect to the shards (or to whole leaves).

    Through the all-gather (:func:`_gather_whole`: its transpose is a
    reduce-scatter) and through the implicit broadcast of a leaf held whole,
    the gradient is the sum over the host's ``size`` devices: divided by it.
    """
    return [g / jnp.asarray(size, g.dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g for g in grads]


def _fast_mean(grads: Any, fast_axis: str) -> Any:
    """Dense mean of the floating-point gradient leaves over ``fast_axis`` (one all-reduce per dtype)."""
    leaves, treedef = jax.tree.flatten(grads)
    idx = [i for i, g in enumerate(leaves)
           if jnp.issubdtype(jnp.result_type(g), jnp.floating) and jnp.size(g) > 0]
    with collectives.uncounted():  # the host's own dense mean: no compressor's payload
        means, _ = collectives.dense_mean_arrays([leaves[i] for i in idx], fast_axis)
    for i, m in zip(idx, means):
        leaves[i] = m
    return jax.tree.unflatten(treedef, leaves)


# --------------------------------------------------------------------------- Flax NNX


def _nnx():
    from flax import nnx  # imported on first use: the pure-pytree API does not need Flax

    return nnx


def nnx_replicate(mesh: Mesh, *nodes: Any, axis_name: str = "data", specs: Any = None) -> None:
    """Give every Variable of the NNX objects ``nodes`` the worker axis, in place.

    Each Variable's value ``x`` (any shape and dtype) becomes ``n`` stacked
    copies, shape ``(n, *x.shape)``, sharded ``P(axis_name)``: every worker
    starts equal.  Each leaf gets buffers of its own, so the state can be
    donated (``nnx_data_parallel_step(..., donate=True)``).  Variables shared
    between the nodes are stacked once.

    Build the optimizer *before* replicating: ``nnx.Optimizer`` must see one
    worker's parameter shapes (compressor state such as top-k's ``k`` depends
    on them), then replicate model and optimizer together.

    Args:
      mesh: the mesh; ``n = mesh.shape[axis_name]``.
      *nodes: NNX objects (``nnx.Module``, ``nnx.Optimizer``, ...) holding one
        worker's values.
      axis_name: the data axis (the slow axis of a 2-D mesh).
      specs: sharded parameters (FSDP): a tree like ``nnx.state(nodes[0])``
        (the model) of ``PartitionSpec`` over one fast mesh axis, e.g.
        ``parallel.fsdp_specs(nnx.state(model), mesh)`` or, to honour
        ``nnx.with_partitioning`` annotations,
        ``nnx.get_partition_spec(nnx.state(model))``.  Each model Variable
        ``x`` is placed ``P(axis_name, *spec)``; the state of every
        ``nnx.Optimizer`` among ``nodes`` shaped like the parameters is sharded
        like them (:func:`state_specs`); the rest (counters, keys, small
        leaves) is held whole by every fast device.  Train with
        :func:`nnx_data_parallel_step` and its ``fast_axis``.

    Raises:
      ValueError: a Variable is already sharded over ``axis_name`` of ``mesh``
        (replicated twice, or an optimizer built from a replicated model), or
        bad ``specs`` (named by leaf, as :func:`replicate` says); nothing is
        changed then.

    Examples:
      >>> import optax, compjax as cj
      >>> from flax import nnx
      >>> from compjax import parallel
      >>> mesh, model = parallel.make_mesh(), nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.chain(cj.topk(0.5, axis_name="data"), optax.sgd(0.1)),
      ...                           wrt=nnx.Param)
      >>> parallel.nnx_replicate(mesh, model, optimizer)
      >>> model.kernel.shape   # (workers, in, out)
      (8, 3, 2)
    """
    nnx = _nnx()
    state = nnx.state(nodes)  # one State for all nodes: shared Variables appear once
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == mesh and s.spec and s.spec[0] == axis_name:
            raise ValueError(
                f"{jax.tree_util.keystr(path)} is already sharded {s.spec} over {axis_name!r}: replicate once, "
                "after building the optimizer on one worker's model"
            )

    if specs is None:
        nnx.update(nodes, jax.tree.map(lambda x: _stack_copies(x, mesh, axis_name), state))
        return
    leaf_specs = _nnx_leaf_specs(nodes, specs, mesh, axis_name)
    leaves, treedef = jax.tree.flatten(state)
    nnx.update(nodes, jax.tree.unflatten(treedef, [_stack_copies(x, mesh, axis_name, None, spec)
                                                   for x, spec in zip(leaves, leaf_specs)]))


def _nnx_leaf_specs(nodes: Sequence, specs: Any, mesh: Mesh, axis_name: str) -> list:
    """One ``PartitionSpec`` (or None: whole) per array leaf of ``nnx.state(nodes)``, from the model's ``specs``.

    The model (``nodes[0]``) takes ``specs``; an ``nnx.Optimizer``'s state
    takes :func:`state_specs` of its ``tx`` over the model's ``wrt``
    parameters; every other Variable is whole.  Variables are matched by
    identity, so one shared between nodes gets one spec.
    """
    nnx = _nnx()

    def is_var(x):
        return isinstance(x, nnx.Variable)

    model = nodes[0]
    mstate = nnx.state(model)
    by_id = {id(v): s for v, s in zip(jax.tree.leaves(mstate, is_leaf=is_var),
                                      _leaf_specs(mstate, specs, mesh, axis_name))}
    for node in nodes[1:]:
        if not isinstance(node, nnx.Optimizer):
            continue
        params = nnx.state(model, node.wrt)
        pvars = jax.tree.leaves(params, is_leaf=is_var)
        pure = nnx.as_pure(params)
        pspecs = jax.tree.unflatten(jax.tree.structure(pure), [by_id.get(id(v)) for v in pvars])
        ospecs = jax.tree.leaves(state_specs(node.tx, pure, pspecs, mesh), is_leaf=lambda x: isinstance(x, P))
        ovars = jax.tree.leaves(node.opt_state, is_leaf=is_var)
        if len(ovars) != len(ospecs):  # pragma: no cover - nnx.Optimizer keeps tx.init's structure
            raise ValueError(f"the optimizer's state has {len(ovars)} leaves, its tx.init {len(ospecs)}: "
                             "build nnx.Optimizer(model, tx, wrt=...) from this model")
        by_id.update({id(v): s for v, s in zip(ovars, ospecs)})
    return [by_id.get(id(v)) for v in jax.tree.leaves(nnx.state(nodes), is_leaf=is_var)]


def nnx_unreplicate(node: Any) -> Any:
    """A regular (unstacked) copy of worker 0's ``node``, for evaluation or checkpointing.

    Args:
      node: an NNX object (or a tuple of them, which keeps references they
        share) replicated with :func:`nnx_replicate`.

    Returns:
      A new object of the same type whose Variables hold worker 0's values
      (shape without the worker axis, same dtype) as JAX arrays on worker 0's
      device, in buffers of their own; ``node`` is not changed.

    Examples:
      >>> from flax import nnx
      >>> from compjax import parallel
      >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> parallel.nnx_replicate(parallel.make_mesh(), model)
      >>> parallel.nnx_unreplicate(model).kernel.shape
      (3, 2)
    """
    nnx = _nnx()
    graphdef, state = nnx.split(node)

    def first(x):
        return x.addressable_shards[0].data[0] if hasattr(x, "addressable_shards") else jnp.asarray(x)[0]

    return nnx.merge(graphdef, jax.tree.map(first, state))


def _check_donatable(state: Any) -> None:
    """Refuse arrays that cannot be donated (XLA:CPU over several devices crashes on them rather than raising)."""
    leaves = jax.tree.leaves(state)
    if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
        raise ValueError(
            "a Variable holds an array already donated to an earlier step: keep the model and optimizer the "
            "step updated (not copies of their state taken before it), or build the step with donate=False"
        )
    if len({id(x) for x in leaves}) < len(leaves):
        raise ValueError(
            "two Variables hold the same array, which cannot be donated twice: give each its own copy "
            "(nnx_replicate does) or build the step with donate=False"
        )


def _check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def _argnums(name: str, value: Any) -> tuple[int, ...]:
    vals = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise ValueError(f"{name} must be an int or a tuple of ints (positions of the step's arguments), got {value!r}")
    return vals


def _check_axis(mesh: Mesh, axis_name: str) -> None:
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are {mesh.axis_names}")


def _is_graph_node(x: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return nnx.graph.is_graph_node(x)


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
    _check_axis(mesh, axis_name)
    _check_flags(worker_rngs=worker_rngs, donate=donate)
    batch_nums, rng_nums = _argnums("batch_argnums", batch_argnums), _argnums("rng_argnums", rng_argnums)
    names, types = workers.check_average(average)
    spec = P(axis_name)

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

    def body(graphdef, kinds, gstate, stacked, batches, keys):
        gstate, stacked = jax.tree.map(lambda x: x[0], (gstate, stacked))
        keys = [workers.fold_worker(k, axis_name) for k in keys]
        objs = _nnx().merge(graphdef, gstate) if graphdef is not None else ()
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
                _nnx().update(objs, saved)
            workers.nnx_average(objs, types, axis_name)
            gstate = _nnx().state(objs)
        return jax.tree.map(lambda x: x[None], (gstate, out))

    @functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3) if donate else (),
                       out_shardings=NamedSharding(mesh, spec))  # as replicate() places: one compilation
    def jitted(graphdef, kinds, gstate, stacked, batches, keys):
        sharded = jax.shard_map(functools.partial(body, graphdef, kinds), mesh=mesh,
                                in_specs=(spec, spec, spec, P()), out_specs=(spec, spec))
        return sharded(gstate, stacked, batches, keys)

    def prepare(args):
        kinds = kinds_of(len(args))
        for i, (a, k) in enumerate(zip(args, kinds)):
            if k != "s" and _is_graph_node(a):
                raise ValueError(f"argument {i} is an NNX object, but batch_argnums / rng_argnums list it: NNX "
                                 "objects are worker-stacked arguments (parallel.nnx_replicate)")
            if k == "k" and not all(workers.is_key(x) for x in jax.tree.leaves(a)):
                raise ValueError(f"argument {i} is listed in rng_argnums but is not a PRNG key "
                                 "(jax.random.key(seed) or a raw uint32[2] key)")
        kinds = tuple("g" if k == "s" and _is_graph_node(a) else k for a, k in zip(args, kinds))
        objs = tuple(a for a, k in zip(args, kinds) if k == "g")
        graphdef, gstate = _nnx().split(objs) if objs else (None, None)
        stacked = tuple(a for a, k in zip(args, kinds) if k == "s")
        n = mesh.shape[axis_name]
        unstacked = any(np.ndim(x) == 0 or np.shape(x)[0] != n for x in jax.tree.leaves((gstate, stacked)))
        for i, a in ((i, a) for i, (a, k) in enumerate(zip(args, kinds)) if unstacked and k in "gs"):  # name it
            for path, x in jax.tree_util.tree_leaves_with_path(_nnx().state(a) if _is_graph_node(a) else a):
                if np.ndim(x) == 0 or np.shape(x)[0] != n:
                    raise ValueError(
                        f"argument {i}{jax.tree_util.keystr(path)} has shape {np.shape(x)}, not the worker-stacked "
                        f"layout (a leading axis of {n} workers): give it the worker axis first "
                        f"(parallel.replicate for pytrees, parallel.nnx_replicate for NNX objects), or list it in "
                        "batch_argnums / rng_argnums"
                    )
        if donate:
            _check_donatable((gstate, stacked))
        batches = tuple(shard_batch(a, mesh, axis_name) for a, k in zip(args, kinds) if k == "b")
        keys = tuple(_put(a, NamedSharding(mesh, P())) for a, k in zip(args, kinds) if k == "k")
        return objs, (graphdef, kinds, gstate, stacked, batches, keys)

    def step(*args):
        objs, jargs = prepare(args)
        gstate, out = jitted(*jargs)
        if objs:
            _nnx().update(objs, gstate)
        return out

    step.lower = lambda *args: jitted.lower(*prepare(args)[1])
    step.jitted = jitted
    return step


def nnx_data_parallel_step(
    loss_fn: Callable[..., Any],
    mesh: Mesh,
    *,
    axis_name: str = "data",
    fast_axis: str | None = None,
    has_aux: bool = False,
    worker_rngs: bool = True,
    donate: bool = False,
) -> Callable[[Any, Any, Any], Any]:
    """Build a data-parallel train step for an NNX model and ``nnx.Optimizer``.

    On each worker's slice, under ``jax.shard_map`` and ``jax.jit`` (compiled
    once per graph structure and input shapes)::

        loss, grads = nnx.value_and_grad(loss_fn)(model, local_batch)  # w.r.t. optimizer.wrt
        optimizer.update(model, grads)   # the compressor in optimizer.tx averages over axis_name

    then the new worker-stacked state is written back into ``model`` and
    ``optimizer`` (``nnx.update``).  As in :func:`data_parallel_step`,
    gradients are local and the compiled step carries only the compressor's
    collectives.  Variables other than the optimized ones (batch statistics,
    RNG counters) are updated per worker from the local batch.  With
    ``worker_rngs`` each worker draws from its own streams (the worker index
    folded into the model's ``RngKey`` s, :func:`worker_step`): dropout masks
    differ across workers and repeat from the same seed.  A step of one's own
    (metrics, several models) is :func:`worker_step` over it.

    Args:
      loss_fn: ``(model, batch) -> scalar loss`` for one worker's batch, or
        ``-> (loss, aux)`` with ``has_aux``; it may update the model's
        non-optimized Variables.  An ``nnx.Rngs`` it uses must belong to the
        model (a closed-over one cannot be updated inside the step).
      mesh: mesh with axis ``axis_name`` (n workers).
      axis_name: the data axis; the compressor in the optimizer's ``tx`` must
        use the same name.
      fast_axis: the fast axis of a 2-D mesh (:func:`make_2d_mesh`), or None.
        Then model and optimizer come from :func:`nnx_replicate` over
        ``axis_name`` (the slow axis), with or without ``specs=``: each step
        all-gathers sharded parameters over the fast axis for ``loss_fn``
        (inside the host), each fast device takes its own slice of the batch,
        the gradient is the host's mean (a reduce-scatter for sharded
        parameters, an all-reduce for whole ones), and the optimizer updates
        each device's shard; its compressor sees whole layers, as in
        :func:`data_parallel_step` with ``specs``.  Non-optimized floating
        Variables (batch statistics) are averaged over the fast axis and must
        be held whole.
      has_aux: ``loss_fn`` returns ``(loss, aux)`` (e.g. logits for accuracy).
      worker_rngs: fold the worker index into the model's RNG streams for the
        step (False: every worker draws the same numbers).
      donate: donate the model's and optimizer's buffers to the step (the
        arrays held before the call are deleted; the objects get the new ones).

    Returns:
      ``train_step(model, optimizer, batch) -> loss`` (``-> (loss, aux)`` with
      ``has_aux``): model and optimizer replicated with :func:`nnx_replicate`
      (updated in place), batch a pytree of arrays split along their leading
      axis (put on the mesh with :func:`shard_batch` unless already there),
      loss a float array of shape ``(n,)`` (each worker's local loss) and aux
      each worker's, stacked.  ``train_step.lower(model, optimizer, batch)``
      lowers the underlying jitted function (so
      :func:`compjax.audit_collectives` accepts ``train_step``), and
      ``train_step.jitted`` is that function.

    Raises:
      ValueError: when built, ``axis_name`` not an axis of ``mesh`` or a flag not a bool; at call
        time, a batch leading dimension not divisible by n, a closed-over NNX
        object the loss updates, or (with ``donate``) a Variable holding an
        array already donated or the same array as another Variable.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, compjax as cj
      >>> from flax import nnx
      >>> from compjax import parallel
      >>> mesh, model = parallel.make_mesh(), nnx.Linear(4, 2, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.chain(cj.identity("data"), optax.sgd(0.1)), wrt=nnx.Param)
      >>> parallel.nnx_replicate(mesh, model, optimizer)
      >>> train_step = parallel.nnx_data_parallel_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), mesh)
      >>> batch = parallel.shard_batch((jnp.ones((16, 4)), jnp.zeros((16, 2))), mesh)
      >>> loss = jax.block_until_ready(train_step(model, optimizer, batch))   # one step in flight (CPU)
      >>> loss.shape, int(cj.payload_bytes(optimizer)[0])   # 10 parameters in float32 + the 4-byte vote
      ((8,), 44)
      >>> [op.op for op in cj.audit_collectives(train_step, model, optimizer, batch)]
      ['all-reduce', 'all-reduce']
    """
    _check_axis(mesh, axis_name)
    _check_flags(has_aux=has_aux, worker_rngs=worker_rngs, donate=donate)
    if fast_axis is not None:
        _check_axis(mesh, fast_axis)
        if fast_axis == axis_name:
            raise ValueError(f"fast_axis and axis_name must differ, both are {axis_name!r}")
        return _nnx_host_step(loss_fn, mesh, axis_name, fast_axis, has_aux, worker_rngs, donate)

    def single(model, optimizer, batch):
        grad_fn = _nnx().value_and_grad(loss_fn, argnums=_nnx().DiffState(0, optimizer.wrt), has_aux=has_aux)
        out, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return out

    return worker_step(single, mesh, axis_name=axis_name, worker_rngs=worker_rngs, donate=donate)



def _nnx_host_step(loss_fn, mesh, axis_name, fast_axis, has_aux, worker_rngs, donate) -> Callable[..., Any]:
    """:func:`nnx_data_parallel_step` on a 2-D mesh, parameters whole or sharded over ``fast_axis``.

    The layout is read from the arrays (:func:`nnx_replicate` placed them): a
    model parameter whose sharding names ``fast_axis`` after the worker axis
    is a shard along that dimension.  Compiled once per graph structure,
    shapes and shardings.
    """
    nnx = _nnx()
    size = mesh.shape[fast_axis]
    devices = (axis_name, fast_axis)

    def specs_dims(leaves, paths, what):
        specs, dims = [], []
        for x, path in zip(leaves, paths):
            s = getattr(x, "sharding", None)
            spec = tuple(s.spec) if isinstance(s, NamedSharding) and s.mesh == mesh else ()
            if not spec or spec[0] != axis_name:
                raise ValueError(f"{what}{jax.tree_util.keystr(path)} is not in the worker-stacked layout over "
                                 f"{axis_name!r} of this mesh: replicate model and optimizer together with "
                                 f"parallel.nnx_replicate(mesh, model, optimizer, axis_name={axis_name!r}[, specs=...])")
            own = [d for d, e in enumerate(spec[1:]) if e is not None]
            if own and spec[1 + own[0]] not in (fast_axis, (fast_axis,)):
                raise ValueError(f"{what}{jax.tree_util.keystr(path)} is sharded {P(*spec)}, over another axis "
                                 f"than fast_axis={fast_axis!r}")
            specs.append(P(*spec))
            dims.append(own[0] if own else None)
        return specs, dims

    def build(mdef, odef, wrt, trees, arrays):
        (ptree, rtree, otree), (pl, rl, ol) = trees, arrays
        paths = [[p for p, _ in jax.tree_util.tree_leaves_with_path(jax.tree.unflatten(t, a))]
                 for t, a in zip(trees, arrays)]
        pspecs, pdims = specs_dims(pl, paths[0], "model")
        rspecs, rdims = specs_dims(rl, paths[1], "model")
        ospecs, _ = specs_dims(ol, paths[2], "optimizer")
        for path, d in zip(paths[1], rdims):
            if d is not None:
                raise ValueError(f"model{jax.tree_util.keystr(path)} is sharded but not optimized (wrt): only the "
                                 "optimized parameters may be sharded; give its spec as None (whole)")

        def body(pl, rl, ol, batch):
            pl, rl, ol = ([x[0] for x in t] for t in (pl, rl, ol))
            optimizer = nnx.merge(odef, jax.tree.unflatten(otree, ol))

            def loss_of(shards):  # a model of this trace's own Variables (NNX refuses updates across traces)
                whole = jax.tree.unflatten(ptree, _gather_whole(shards, pdims, fast_axis))
                model = nnx.merge(mdef, whole, jax.tree.unflatten(rtree, rl))
                saved = workers.nnx_fold_rngs(model, devices) if worker_rngs else None
                out = loss_fn(model, batch)
                if saved is not None:
                    nnx.update(model, saved)
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, jax.tree.leaves(nnx.split(model, wrt, ...)[2]))

            (loss, (aux, new_rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(pl)
            grads = _host_mean(grads, size)
            params = nnx.as_pure(jax.tree.unflatten(ptree, pl))
            pure = jax.tree.structure(params)
            grads = jax.tree.unflatten(pure, grads)
            with layout.fast_layout(fast_axis, grads, pdims):
                updates, new_opt = optimizer.tx.update(grads, nnx.as_pure(optimizer.opt_state), params)
            params = optax.apply_updates(params, updates)
            nnx.update(optimizer.opt_state, nnx.state(new_opt))
            optimizer.step[...] += 1
            floats = [i for i, x in enumerate(new_rest) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
            means = workers._mean_floats([new_rest[i] for i in floats], fast_axis) if floats else []
            for i, m in zip(floats, means):  # batch statistics: the host's mean, held by each of its devices
                new_rest[i] = m
            outs = (jax.tree.leaves(params), new_rest, jax.tree.leaves(nnx.split(optimizer)[1]), loss)
            outs += (aux,) if has_aux else ()
            return jax.tree.map(lambda x: x[None], outs)

        out_specs = (pspecs, rspecs, ospecs, P(devices)) + ((P(devices),) if has_aux else ())
        sharded = jax.shard_map(body, mesh=mesh, in_specs=(pspecs, rspecs, ospecs, P(devices)), out_specs=out_specs)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(sharded, donate_argnums=(0, 1, 2) if donate else (), out_shardings=shardings)

    cache: dict = {}

    def prepare(model, optimizer, batch):
        if not isinstance(optimizer, nnx.Optimizer):
            raise ValueError(f"optimizer must be an nnx.Optimizer built on the model, got {type(optimizer).__name__}")
        mdef, params, rest = nnx.split(model, optimizer.wrt, ...)
        odef, ostate = nnx.split(optimizer)
        flat = [jax.tree.flatten(t) for t in (params, rest, ostate)]
        trees, arrays = tuple(t for _, t in flat), tuple(a for a, _ in flat)
        if donate:
            _check_donatable(arrays)
        key = (mdef, odef, trees, tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
                                        for x in jax.tree.leaves(arrays)))
        if key not in cache:
            cache[key] = build(mdef, odef, optimizer.wrt, trees, arrays)
        if not all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(batch)):
            batch = shard_batch(batch, mesh, axis_name, fast_axis=fast_axis)
        return cache[key], trees, arrays + (batch,)

    def train_step(model, optimizer, batch):
        jitted, (ptree, rtree, otree), args = prepare(model, optimizer, batch)
        pl, rl, ol, loss, *aux = jitted(*args)
        nnx.update(model, jax.tree.unflatten(ptree, pl), jax.tree.unflatten(rtree, rl))
        nnx.update(optimizer, jax.tree.unflatten(otree, ol))
        return (loss, aux[0]) if has_aux else loss

    def lower(model, optimizer, batch):
        jitted, _, args = prepare(model, optimizer, batch)
        return jitted.lower(*args)

    train_step.lower = lower
    train_step._cache_size = lambda: sum(f._cache_size() for f in cache.values())
    return train_step
