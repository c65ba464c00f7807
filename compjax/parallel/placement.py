"""Where the arrays of a data-parallel run live: the worker-stacked layout and its sharded (FSDP) form.

Every parameter and optimizer-state leaf carries a leading worker axis of
size n (one slice per worker), sharded over the mesh's worker axes
(``P(axis_name)``, or ``P((axis_name, fast_axis))`` with one worker per device
of a 2-D mesh): :func:`replicate`, :func:`init_worker_state`; a global batch
is split along its leading axis (:func:`shard_batch`).  With ``specs=``
(sharded parameters) the worker axis runs over the slow axis only and each
leaf's own dimensions follow its ``PartitionSpec`` over the fast axis
(:func:`fsdp_specs` gives a default rule, :func:`state_specs` the rule for the
optimizer's state).  :func:`unreplicate`, :func:`local_view` and :func:`gather`
read a worker-stacked tree back.

(:mod:`compjax.layout` is another thing: the trace-time context that tells a
compressor, inside a step, how its gradients are sharded over the fast axis.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import layout
from compjax.parallel.mesh import check_axis, worker_axes


def put(x: Any, sharding: NamedSharding) -> jax.Array:
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
        leaf_specs = checked_leaf_specs(tree, specs, mesh, axis_name)
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, [stack_copies(x, mesh, axis_name, None, spec)
                                            for x, spec in zip(leaves, leaf_specs)])
    return jax.tree.map(lambda x: stack_copies(x, mesh, axis_name, fast_axis), tree)


def stack_copies(x: Any, mesh: Mesh, axis_name: str, fast_axis: str | None = None,
                  spec: P | None = None) -> jax.Array:
    """``n`` copies of ``x`` stacked on a new leading axis, in a new buffer, sharded over the worker axes.

    The spec names the worker axes only (``P(axis_name)``), as the step
    builders return their outputs (``out_shardings``): the same sharding on the
    first and later calls, so the step's second call does not compile again.
    With ``spec`` (sharded parameters) the leaf's own dimensions follow it.
    """
    n, axes = worker_axes(mesh, axis_name, fast_axis)
    x = jnp.asarray(x) if jax.process_count() == 1 else np.asarray(x)
    sharding = NamedSharding(mesh, stacked_spec(axes, spec))
    stacked = jnp.broadcast_to(x[None], (n, *x.shape)) if jax.process_count() == 1 else \
        np.broadcast_to(x[None], (n, *x.shape))
    return put(stacked, sharding)


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
    n, axes = worker_axes(mesh, axis_name, fast_axis)
    for x in jax.tree.leaves(batch):
        if jnp.shape(x)[0] % n:
            raise ValueError(f"batch leading dimension {jnp.shape(x)[0]} is not divisible by {n} workers")
    return jax.tree.map(lambda x: put(x, NamedSharding(mesh, P(axes))), batch)


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
    leaf_specs = checked_leaf_specs(params, specs, mesh, None)
    dims, fast = shard_dims(leaf_specs)
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


def stacked_spec(axes: Any, spec: P | None) -> P:
    """The spec of a worker-stacked leaf: the worker axes, then the leaf's own."""
    return P(axes) if spec is None else P(axes, *tuple(spec))


def checked_leaf_specs(tree: Any, specs: Any, mesh: Mesh, axis_name: str) -> list:
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


def shard_dims(leaf_specs: Sequence) -> tuple[list, str | None]:
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
      >>> from compjax import parallel
      >>> mesh = parallel.make_2d_mesh(2, 4)
      >>> parallel.fsdp_specs({"w": jnp.zeros((1024, 6)), "b": jnp.zeros(6)}, mesh)
      {'b': P(), 'w': P('fast', None)}
    """
    check_axis(mesh, fast_axis)
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
