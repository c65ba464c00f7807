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
read a worker-stacked tree back.  A leaf none of whose dimensions the fast
axis size divides can be stored padded (:class:`Padded`, chosen by
:func:`fsdp_specs` for large leaves): zeros appended along one dimension to a
multiple of the fast size, sharded like any leaf, its logical shape kept in
its spec; :func:`logical` (and :func:`unreplicate` / :func:`gather` with
``specs=``) read the logical arrays back.

(:mod:`compjax.layout` is another thing: the trace-time context that tells a
compressor, inside a step, how its gradients are sharded over the fast axis.)
"""

from __future__ import annotations

import functools
import weakref
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


class Padded:
    """The spec of a leaf stored padded: zeros appended along one dimension so that the fast axis divides it.

    A leaf none of whose dimensions the fast axis size divides (a ``(6, 10)``
    kernel on a fast axis of 4) is stored as ``padded_shape`` (``(6, 12)``),
    sharded by ``spec`` like any leaf, and is read back as its logical
    ``shape``: the sharded step slices it before the loss (the gradient of the
    padding is zero) and before the optimizer, so the loss, the compressors'
    per-layer statistics (top-k's k, norms, means, PowerSGD's factors),
    ``payload_bytes`` and checkpoints (:class:`compjax.checkpoint.Checkpointer`
    with ``specs=``) see the logical entries only, and pads the results again
    (zeros) to store them.  :func:`fsdp_specs` chooses it for large leaves;
    :func:`replicate`, :func:`init_worker_state`, :func:`state_specs` and
    :func:`data_parallel_step` take it in ``specs``.

    Args:
      spec: a ``PartitionSpec`` over ``padded_shape`` naming the fast axis on one dimension.
      shape: the leaf's logical shape (ints >= 0).
      padded_shape: ``shape`` with the sharded dimension raised (a multiple of the fast size).

    Raises:
      ValueError: ``spec`` not a ``PartitionSpec`` sharding exactly one
        dimension, shapes of different lengths, or ``padded_shape`` differing
        from ``shape`` elsewhere than on that dimension or smaller there.
    """

    __slots__ = ("padded_shape", "shape", "spec")

    def __init__(self, spec: P, shape: Sequence[int], padded_shape: Sequence[int]):
        if not isinstance(spec, P):
            raise ValueError(f"spec must be a PartitionSpec, got {spec!r}")  # noqa: TRY004
        shape, padded_shape = tuple(int(n) for n in shape), tuple(int(n) for n in padded_shape)
        sharded = [d for d, e in enumerate(tuple(spec)) if e is not None]
        if len(sharded) != 1:
            raise ValueError(f"spec must shard exactly one dimension of a padded leaf, got {spec}")
        d = sharded[0]
        if len(shape) != len(padded_shape) or d >= len(shape) or any(
                a != b for i, (a, b) in enumerate(zip(shape, padded_shape)) if i != d) or padded_shape[d] < shape[d]:
            raise ValueError(f"padded_shape {padded_shape} must equal shape {shape} except on the sharded dimension "
                             f"{d} of {spec}, where it is at least as large")
        self.spec, self.shape, self.padded_shape = spec, shape, padded_shape

    @property
    def dim(self) -> int:
        """The padded (and sharded) dimension."""
        return next(d for d, e in enumerate(tuple(self.spec)) if e is not None)

    def _key(self) -> tuple:  # trailing None entries of the spec do not matter: P("fast") == P("fast", None) here
        entries = list(self.spec)
        while entries and entries[-1] is None:
            entries.pop()
        return tuple(entries), self.shape, self.padded_shape

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Padded) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((Padded, self._key()))

    def __repr__(self) -> str:
        return f"Padded({self.spec!r}, shape={self.shape}, padded_shape={self.padded_shape})"


def as_spec(entry: Any) -> P | None:
    """The ``PartitionSpec`` an entry of ``specs`` places its leaf by (a :class:`Padded`'s ``spec``)."""
    return entry.spec if isinstance(entry, Padded) else entry


def is_spec_entry(x: Any) -> bool:
    """True for a leaf of a ``specs`` tree: a ``PartitionSpec``, a :class:`Padded` or None."""
    return x is None or isinstance(x, (P, Padded))


def unpad(x: Any, entry: Any, lead: int = 0) -> Any:
    """``x`` cut to its logical shape when ``entry`` is a :class:`Padded` (``lead`` leading axes kept), else ``x``."""
    if not isinstance(entry, Padded):
        return x
    d = lead + entry.dim
    if np.shape(x)[d] == entry.shape[entry.dim]:
        return x
    return jax.lax.slice_in_dim(x, 0, entry.shape[entry.dim], axis=d)


def pad(x: Any, entry: Any, lead: int = 0) -> Any:
    """``x`` (logical shape) with zeros appended to its :class:`Padded` shape (``lead`` leading axes kept), else ``x``."""
    if not isinstance(entry, Padded):
        return x
    d = lead + entry.dim
    extra = entry.padded_shape[entry.dim] - np.shape(x)[d]
    if extra == 0:
        return x
    widths = [(0, 0)] * np.ndim(x)
    widths[d] = (0, extra)
    return jnp.pad(x, widths) if isinstance(x, jax.Array) else np.pad(np.asarray(x), widths)


#: The arrays this package handed out stored padded (a :class:`Padded` entry's leaf): ``id -> weak reference``.
_PADDED: dict[int, weakref.ref] = {}


def mark_padded(x: Any) -> Any:
    """Remember the ``jax.Array`` ``x`` as stored padded (:func:`is_padded_array`); returns ``x``.

    :func:`replicate`, :func:`init_worker_state`, the sharded step's outputs
    and checkpoint restores mark their padded leaves, so that a step that
    would hand them to a user's code padded (:func:`compjax.parallel.worker_step`)
    can refuse them.  Only a weak reference is kept.
    """
    if isinstance(x, jax.Array):
        key = id(x)

        def forget(ref, key=key):
            if _PADDED.get(key) is ref:
                del _PADDED[key]

        _PADDED[key] = weakref.ref(x, forget)
    return x


def is_padded_array(x: Any) -> bool:
    """Whether ``x`` is an array this package handed out stored padded (:func:`mark_padded`)."""
    ref = _PADDED.get(id(x))
    return ref is not None and ref() is x


def unpad_leaves(leaves: Sequence, entries: Sequence) -> list:
    """Inside a sharded step: each padded leaf (one worker's, no worker axis) cut to its logical shape, held whole.

    A padded leaf comes out laid out ``P()`` (every device of the host holds
    it whole, as a leaf ``specs`` keeps whole), the others as they are.
    Traced under :func:`compjax.collectives.uncounted`: the gather of a padded
    leaf's shards that XLA inserts for it runs inside the host and is no
    compressor's payload.
    """
    from compjax import collectives

    with collectives.uncounted():
        return [jax.lax.with_sharding_constraint(unpad(x, e), P()) if isinstance(e, Padded) else x
                for x, e in zip(leaves, entries)]


def check_stored(tree: Any, entries: Sequence, what: str) -> None:
    """Raise a ValueError naming the first leaf of ``tree`` (no worker axis) not stored in its :class:`Padded` shape.

    ``entries`` holds one entry per leaf of ``tree``; ``what`` names the tree
    (``"params"``, ``"opt_state"``) in the message.
    """
    for (path, x), e in zip(jax.tree_util.tree_leaves_with_path(tree), entries):
        if isinstance(e, Padded) and tuple(np.shape(x)) != e.padded_shape:
            raise ValueError(f"{what}{jax.tree_util.keystr(path)} has shape {tuple(np.shape(x))} per worker, but its "
                             f"spec {e} stores it padded: place it with parallel.replicate(..., specs=specs) / "
                             "parallel.init_worker_state(..., specs=specs)")


def pad_leaves(leaves: Sequence, entries: Sequence) -> list:
    """Inside a sharded step: each padded leaf (logical, no worker axis) padded with zeros and laid out by its spec."""
    from compjax import collectives

    with collectives.uncounted():
        return [jax.lax.with_sharding_constraint(pad(x, e), e.spec) if isinstance(e, Padded) else x
                for x, e in zip(leaves, entries)]


def map_padded(fn: Any, tree: Any, specs: Any) -> Any:
    """``fn(leaf, entry)`` on each leaf of ``tree`` whose ``specs`` entry is a :class:`Padded`; other leaves as they are.

    ``specs`` is a prefix of ``tree`` whose leaves are ``PartitionSpec``, :class:`Padded` or None.

    Raises:
      ValueError: ``specs`` not a prefix of ``tree``, or a :class:`Padded` over a subtree.
    """
    def one(entry, sub):
        if not isinstance(entry, Padded):
            return sub
        if not hasattr(sub, "shape"):
            raise ValueError(f"a Padded spec must describe one array, got {type(sub).__name__}")
        return fn(sub, entry)

    try:
        return jax.tree.map(one, specs, tree, is_leaf=is_spec_entry)
    except ValueError as e:
        if "Padded" in str(e):
            raise
        raise ValueError(f"specs must be a prefix of the tree it describes, with PartitionSpec, Padded or None "
                         f"leaves: {e}") from None


def logical(tree: Any, specs: Any) -> Any:
    """A worker-stacked tree with each padded leaf (:class:`Padded` in ``specs``) cut to its logical shape.

    Args:
      tree: worker-stacked arrays (leading worker axis), as :func:`replicate`
        / :func:`init_worker_state` / the sharded step return them, or host arrays.
      specs: the ``specs`` the tree was placed with, without the worker axis
        (for an optimizer state: :func:`state_specs`), or a prefix of ``tree``
        (None leaves: subtrees that hold no padded leaf).

    Returns:
      The same tree, padded leaves of shape ``(n, *entry.shape)`` (a device
      array placed over the worker axis only, or a NumPy array for NumPy input).

    Raises:
      ValueError: ``specs`` does not fit ``tree``.
    """
    def cut(x, entry):
        if not isinstance(x, jax.Array):
            return np.asarray(x)[(slice(None),) * (1 + entry.dim) + (slice(0, entry.shape[entry.dim]),)]
        mesh = x.sharding.mesh if isinstance(x.sharding, NamedSharding) else None
        if mesh is None:
            return unpad(x, entry, lead=1)
        worker = next(iter(x.sharding.spec), None)
        return _cut_fn(entry, NamedSharding(mesh, P(worker)))(x)

    return map_padded(cut, tree, specs)


@functools.lru_cache(maxsize=256)
def _cut_fn(entry: Padded, sharding: NamedSharding) -> Any:
    """The jitted cut of a worker-stacked padded leaf to its logical shape, placed by ``sharding`` (one per pair)."""
    return jax.jit(lambda a: unpad(a, entry, lead=1), out_shardings=sharding)


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
        fast mesh axis (:func:`fsdp_specs`), or several for :func:`worker_step`
        (a model's own annotations on a mesh such as ``(data, fsdp, tensor)``).  The worker axis then runs over
        ``axis_name`` only and leaf ``x`` is placed ``P(axis_name, *spec)``: each
        device holds ``1/fast`` of it.  A :class:`Padded` entry stores its leaf
        (of the entry's logical ``shape``) padded with zeros to ``padded_shape``.

    Returns:
      The same tree with leaves of shape ``(n, *shape)`` (``(n, *padded_shape)``
      for a :class:`Padded` entry), one slice per device (or its shard, with
      ``specs``), each leaf in buffers of its own (safe to donate).

    Raises:
      ValueError: bad ``specs`` (see :func:`fsdp_specs` for the rules), named by leaf.
    """
    if specs is not None:
        leaf_specs = checked_leaf_specs(tree, specs, mesh, axis_name, padded=True, several=True)
        leaves, treedef = jax.tree.flatten(tree)
        stored = [stack_copies(pad(x, spec), mesh, axis_name, None, as_spec(spec)) for x, spec in zip(leaves, leaf_specs)]
        return jax.tree.unflatten(treedef, [mark_padded(x) if isinstance(spec, Padded) else x
                                            for x, spec in zip(stored, leaf_specs)])
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


def unreplicate(tree: Any, *, specs: Any = None) -> Any:
    """This process's first worker's slice of a worker-stacked tree, as host NumPy arrays.

    In a single process that is worker 0; with several processes, the first
    worker this process holds (parameters and other replicated values are the
    same on every worker).  A leaf sharded over a fast axis (``specs=``) comes
    back whole; with ``specs`` (the tree's specs or a prefix, see
    :func:`logical`) a padded leaf comes back in its logical shape.
    """
    def first(x):
        if not hasattr(x, "addressable_shards"):
            return np.asarray(x)[0]
        spec = getattr(x.sharding, "spec", None)
        if spec is not None and any(e is not None for e in tuple(spec)[1:]):  # a shard is not the whole worker
            return np.asarray(gather(x))[0]
        return np.asarray(x.addressable_shards[0].data)[0]

    out = jax.tree.map(first, tree)
    return out if specs is None else map_padded(lambda x, e: unpad(x, e), out, specs)


def local_view(tree: Any) -> Any:
    """This process's first worker slice of a worker-stacked tree, kept on its device, shape ``(1, ...)``.

    No copy to the host: for reading small fields (byte counters, flags) of a
    state whose arrays span several processes, e.g.
    ``cj.payload_bytes(parallel.local_view(opt_state))[0]``.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x[:1], tree)


def gather(tree: Any, *, specs: Any = None) -> Any:
    """A worker-stacked (or any sharded) tree as whole host NumPy arrays, on every process.

    With one process this is ``np.asarray`` per leaf; with several, every
    process must call it (it is a collective over processes:
    ``jax.experimental.multihost_utils.process_allgather``).  With ``specs``
    (see :func:`logical`) padded leaves come back in their logical shapes.
    """
    if jax.process_count() == 1:
        out = jax.tree.map(np.asarray, tree)
    else:
        from jax.experimental import multihost_utils

        out = jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return out if specs is None else logical(out, specs)


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
    (:func:`state_specs`), padded where they are (:class:`Padded`); the rest
    (counters, keys, byte counts) is held whole by every fast device.
    ``params`` are the logical parameters (not padded).
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
    For a padded parameter (:class:`Padded`) the rule is read on its padded
    shape, and a state leaf sharded along a dimension the fast size does not
    divide is padded too (a :class:`Padded` entry with its logical shape); a
    state leaf whose shape depends on the padding otherwise is held whole.

    Args:
      tx: the optimizer (its ``init`` is only traced, nothing is allocated).
      params: the logical parameters without the worker axis (arrays or ``jax.ShapeDtypeStruct``).
      specs: a tree like ``params`` of ``PartitionSpec``, :class:`Padded` (or None): one fast axis, or
        several (a model's own annotations, e.g. ``P('fsdp', 'tensor')``, for :func:`worker_step`; a state
        leaf is then sharded like the parameter it is shaped like).
      mesh: the mesh the specs refer to.

    Returns:
      A tree like ``tx.init(params)`` of ``PartitionSpec`` (or :class:`Padded`), without the worker axis.

    Raises:
      ValueError: bad ``specs`` (see :func:`replicate`).
    """
    leaf_specs = checked_leaf_specs(params, specs, mesh, None, padded=True, several=True)
    groups = _spec_groups(leaf_specs, mesh)
    if len(groups) > 1 or any(isinstance(g, tuple) for g in groups):
        return _several_axes_state_specs(tx, params, leaf_specs, groups)
    dims, fast = shard_dims(leaf_specs)
    leaves, treedef = jax.tree.flatten(params)
    real = [jax.ShapeDtypeStruct(e.shape if isinstance(e, Padded) else tuple(np.shape(x)), jnp.result_type(x))
            for x, e in zip(leaves, leaf_specs)]
    whole = [jax.ShapeDtypeStruct(e.padded_shape, r.dtype) if isinstance(e, Padded) else r
             for r, e in zip(real, leaf_specs)]
    size = mesh.shape[fast] if fast is not None else 1
    shards = [w if d is None else jax.ShapeDtypeStruct(w.shape[:d] + (w.shape[d] // size,) + w.shape[d + 1:], w.dtype)
              for w, d in zip(whole, dims)]
    state = jax.eval_shape(tx.init, jax.tree.unflatten(treedef, real))
    state_dims = layout.scaled_dims(tx.init, jax.tree.unflatten(treedef, whole), jax.tree.unflatten(treedef, shards),
                                    size)
    if not any(isinstance(e, Padded) for e in leaf_specs):
        out = [P() if d is None else P(*([None] * d + [fast])) for d in state_dims]
        return jax.tree.unflatten(jax.tree.structure(state), out)
    # Padded parameters: the rule was read on the padded shapes; each leaf of the logical state keeps the dimension
    # its padded counterpart (same key path) is sharded along, padded where the fast size does not divide it.
    padded_state = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, jax.tree.unflatten(treedef, whole)))[0]
    proxy = {p: d for (p, _), d in zip(padded_state, state_dims)}
    proxy_shapes = {p: tuple(a.shape) for p, a in padded_state}
    out = []
    for path, a in jax.tree_util.tree_flatten_with_path(state)[0]:
        d, shape = proxy.get(path), tuple(a.shape)
        spec = None if d is None else P(*([None] * d + [fast]))
        if spec is None or d >= len(shape):
            out.append(P())
        elif shape == proxy_shapes[path]:
            out.append(spec)
        elif shape[d] % size and proxy_shapes[path] == shape[:d] + (-(-shape[d] // size) * size,) + shape[d + 1:]:
            out.append(Padded(spec, shape, proxy_shapes[path]))
        else:
            out.append(P())
    return jax.tree.unflatten(jax.tree.structure(state), out)


def _entry_key(entry: Any) -> Any:
    """A spec entry as one key: ``("fsdp",)`` is ``"fsdp"``; a tuple of several axes stays a tuple."""
    return entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry


def _spec_groups(leaf_specs: Sequence, mesh: Mesh) -> dict:
    """The sharding entries the specs use (an axis name, or a tuple of several for one dimension) -> their size."""
    groups = {}
    for spec in map(as_spec, leaf_specs):
        for entry in tuple(spec) if spec is not None else ():
            if entry is not None:
                key = _entry_key(entry)
                groups[key] = int(np.prod([mesh.shape[a] for a in (key if isinstance(key, tuple) else (key,))]))
    return groups


def _several_axes_state_specs(tx: optax.GradientTransformation, params: Any, leaf_specs: Sequence,
                              groups: dict) -> Any:
    """:func:`state_specs` for specs over several axes (no :class:`Padded` entry: those name one axis).

    For each sharding entry in turn, ``tx.init`` is evaluated abstractly on
    the parameters with only the dimensions that entry shards divided by its
    size (:func:`compjax.layout.scaled_dims`): a state leaf that scales along
    a dimension then is sharded along it by that entry.  A state leaf two
    entries would shard along the same dimension is held whole.
    """
    leaves, treedef = jax.tree.flatten(params)
    whole = [jax.ShapeDtypeStruct(tuple(np.shape(x)), jnp.result_type(x)) for x in leaves]
    state = jax.eval_shape(tx.init, jax.tree.unflatten(treedef, whole))
    found: list[dict] = [{} for _ in jax.tree.leaves(state)]
    for key, size in groups.items():
        shards = []
        for w, spec in zip(whole, map(as_spec, leaf_specs)):
            entries = [_entry_key(e) for e in (tuple(spec) if spec else ())]
            shape = tuple(n // size if d < len(entries) and entries[d] == key else n for d, n in enumerate(w.shape))
            shards.append(jax.ShapeDtypeStruct(shape, w.dtype))
        dims = layout.scaled_dims(tx.init, jax.tree.unflatten(treedef, whole), jax.tree.unflatten(treedef, shards),
                                  size)
        for at, d in zip(found, dims):
            if d is not None:
                at.setdefault(d, []).append(key)
    out = []
    for at in found:
        if not at or any(len(keys) > 1 for keys in at.values()):
            out.append(P())
        else:
            out.append(P(*[at[d][0] if d in at else None for d in range(max(at) + 1)]))
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


#: Where a model annotated over several fast axes goes (a step built for one of them refuses it with this).
SEVERAL_AXES_HINT = ("name every fast axis the specs use: data_parallel_step(specs=) takes specs over several axes "
                     "as they are (e.g. P('fsdp', 'tensor') on a (data, fsdp, tensor) mesh), "
                     "nnx_data_parallel_step takes fast_axis=('fsdp', 'tensor'), and parallel.worker_step runs a "
                     "step of one's own on such a model")


def checked_leaf_specs(tree: Any, specs: Any, mesh: Mesh, axis_name: str, *, padded: bool = False,
                       several: bool = False) -> list:
    """``specs`` checked against ``tree`` and ``mesh``: one ``PartitionSpec``, :class:`Padded` or None per leaf.

    With ``padded`` a :class:`Padded` entry is taken: its leaf has the entry's
    logical ``shape`` or its ``padded_shape``, and its spec is checked against
    the padded shape.  With ``several`` the specs may name several axes
    besides the worker axis, in several dimensions of a leaf or together in
    one (a model's own annotations, for :func:`compjax.parallel.worker_step`);
    a :class:`Padded` entry still names one.

    Raises:
      ValueError: a spec naming an axis not in the mesh, the worker axis, an
        axis twice, more than one fast axis in all, more dimensions than the
        leaf has, or a dimension the axis size does not divide; a
        :class:`Padded` entry where ``padded`` is False, or one whose shapes
        do not fit its leaf or pad more than needed; named by leaf.
    """
    paths = jax.tree_util.tree_leaves_with_path(tree)
    leaves = _spec_leaves(specs, jax.tree.structure(tree))
    fast = set()
    for (path, x), given in zip(paths, leaves):
        if given is None:
            continue
        name = jax.tree_util.keystr(path) or "<root>"
        spec = as_spec(given)
        if isinstance(given, Padded):
            if not padded:
                raise ValueError(f"specs{name} = {given} pads its leaf, which this step does not take: use "
                                 "data_parallel_step(specs=...), or fsdp_specs(..., pad_min_size=None) to keep "
                                 "such leaves whole")
            if tuple(np.shape(x)) not in (given.shape, given.padded_shape):
                raise ValueError(f"specs{name} = {given} is for a leaf of shape {given.shape} (stored "
                                 f"{given.padded_shape}), got {tuple(np.shape(x))}")
        if not isinstance(spec, P):
            raise ValueError(f"specs{name} must be a PartitionSpec, parallel.Padded or None, got {given!r}")
        shape = given.padded_shape if isinstance(given, Padded) else np.shape(x)
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
            if isinstance(entry, tuple) and len(entry) > 1 and not several:
                raise ValueError(f"specs{name} = {spec} shards dimension {dim} over several axes {entry}: "
                                 f"one fast axis per dimension ({SEVERAL_AXES_HINT})")
            if entry is not None:
                axes = entry if isinstance(entry, tuple) else (entry,)
                size = int(np.prod([mesh.shape[ax] for ax in axes]))
                if shape[dim] % size:
                    where = repr(axes[0]) if len(axes) == 1 else str(axes)
                    raise ValueError(f"specs{name} = {spec} shards dimension {dim} of shape {shape} over {where} "
                                     f"of size {size}, which does not divide it: shard another "
                                     "dimension or keep the leaf whole (None), as fsdp_specs does")
        if len(seen) > 1 and (not several or isinstance(given, Padded)):
            raise ValueError(f"specs{name} = {spec} shards over several axes {tuple(seen)}: one fast axis only "
                             f"({SEVERAL_AXES_HINT}; a parallel.Padded entry names one axis)")
        if isinstance(given, Padded):
            d, size = given.dim, mesh.shape[seen[0]]
            if given.padded_shape[d] != -(-given.shape[d] // size) * size:
                raise ValueError(f"specs{name} = {given} pads dimension {d} to {given.padded_shape[d]}: the next "
                                 f"multiple of the fast size {size} is {-(-given.shape[d] // size) * size}")
    if len(fast) > 1 and not several:
        raise ValueError(f"specs shard over several axes {sorted(fast)}: one fast axis only ({SEVERAL_AXES_HINT})")
    return leaves


def shard_dims(leaf_specs: Sequence) -> tuple[list, str | None]:
    """The sharded dimension of each leaf (None: whole) and the fast axis the specs name (:class:`Padded` entries too)."""
    dims, fast = [], None
    for spec in map(as_spec, leaf_specs):
        dim = None
        for d, entry in enumerate(tuple(spec) if spec is not None else ()):
            if entry is not None:
                dim, fast = d, entry[0] if isinstance(entry, tuple) else entry
        dims.append(dim)
    return dims, fast


def named_fast_axes(leaf_specs: Sequence, mesh: Mesh) -> tuple:
    """Every mesh axis the specs shard over (:class:`Padded` entries too), in the mesh's order."""
    named = set()
    for spec in map(as_spec, leaf_specs):
        for entry in tuple(spec) if spec is not None else ():
            named.update(entry if isinstance(entry, tuple) else (entry,) if entry is not None else ())
    return tuple(a for a in mesh.axis_names if a in named)


def shard_view(tree: Any, leaf_specs: Sequence, fast: tuple, mesh: Mesh, *, own: bool = False) -> tuple[list, list]:
    """How the optimizer sees each leaf on a mesh of several fast axes: in its own layout, along one dimension, or whole.

    A sharded step's compressors work on shards cut along one dimension over
    the host's devices (:class:`compjax.layout.Shards`).  A leaf the specs
    shard over several axes in several dimensions (``P('fsdp', 'tensor')``),
    over some of the fast axes only, or in another order, is seen by the
    optimizer cut along one dimension over every fast axis together
    (``P(('fsdp', 'tensor'))`` on that dimension: the device of index ``c``
    over ``fast``, the last axis fastest, holds the ``c``-th piece): the first
    dimension the specs shard that the host's device count divides, else any
    such dimension, else the leaf is seen whole (``P()``).  XLA re-lays the
    leaf out inside the host where the optimizer takes it and gives it back:
    every step, a copy of the leaf each way (and of its gradient).

    With ``own`` (an optimizer whose compressors work on shards cut any way,
    :func:`compjax.compressors.chains.works_on_any_cut`), a leaf the specs
    shard over every fast axis is seen as the specs lay it out, with no
    re-layout: its dimension entry is a :class:`compjax.layout.Cut` (the
    spec's entries) unless the spec already cuts it along one dimension over
    ``fast`` in mesh order (then that dimension, as without ``own``).  Leaves
    sharded over some of the fast axes only (a LayerNorm's ``P(None,
    'fsdp')``, held twice over ``tensor``) are still seen along one
    dimension over all of them, so every device holds a distinct piece.

    Args:
      tree: the logical leaves (arrays or ``jax.ShapeDtypeStruct``), one per spec.
      leaf_specs: their specs (``PartitionSpec`` or None), over axes of ``fast``.
      fast: the fast axes, in mesh order.
      mesh: the mesh.
      own: keep the specs' own layout where they shard over every fast axis.

    Returns:
      ``(dims, specs)``: per leaf the dimension it is seen sharded along, a
      :class:`compjax.layout.Cut`, or None (whole), and its spec there
      (without the worker axis).
    """
    size = int(np.prod([mesh.shape[a] for a in fast], dtype=np.int64))
    dims, specs = [], []
    for x, spec in zip(jax.tree.leaves(tree), leaf_specs):
        shape = tuple(np.shape(x))
        entries = tuple(as_spec(spec)) if spec is not None else ()
        sharded = [d for d, e in enumerate(entries) if e is not None]
        named = {a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))}
        if own and sharded and named == set(fast):
            one = len(sharded) == 1 and tuple(entries[sharded[0]] if isinstance(entries[sharded[0]], tuple)
                                              else (entries[sharded[0]],)) == tuple(fast)
            dims.append(sharded[0] if one else
                        layout.Cut(tuple(entries) + (None,) * (len(shape) - len(entries))))
            specs.append(P(*entries))
            continue
        fits = [d for d in sharded + list(range(len(shape))) if shape[d] % size == 0]
        d = fits[0] if sharded and fits else None
        dims.append(d)
        specs.append(P() if d is None else P(*([None] * d + [tuple(fast)])))
    return dims, specs


def fsdp_specs(params: Any, mesh: Mesh, *, fast_axis: str = "fast", min_size: int = 1024,
               pad_min_size: int | None = 65536) -> Any:
    """A default sharding rule for the parameters over the fast axis (FSDP, ZeRO-3 style).

    Each leaf of at least ``min_size`` elements is sharded over ``fast_axis``
    along its largest dimension that the axis size divides (the first such
    dimension on a tie).  A leaf with no such dimension and at least
    ``pad_min_size`` elements is stored padded (:class:`Padded`): zeros
    appended along its largest dimension (the first on a tie) up to a
    multiple of the axis size, sharded along it.  Scalars, small leaves and
    the other leaves with no such dimension are held whole by every fast
    device (``P()``).

    Args:
      params: pytree of arrays (one worker's parameters, no worker axis) or
        ``jax.ShapeDtypeStruct``.
      mesh: a 2-D mesh (:func:`make_2d_mesh`).
      fast_axis: the mesh axis to shard over.
      min_size: leaves with fewer elements stay whole, an int >= 1.
      pad_min_size: leaves with no dimension the axis size divides are padded
        from this many elements on, an int >= 1, or None: never (such leaves
        stay whole, for the steps that take no :class:`Padded` spec: the NNX
        and user-step builders).

    Returns:
      A tree like ``params`` of ``PartitionSpec`` (``P()``: whole) or :class:`Padded`, for
      :func:`replicate`, :func:`init_worker_state` and :func:`data_parallel_step`'s ``specs=``.

    Raises:
      ValueError: ``fast_axis`` not an axis of ``mesh``, ``min_size`` < 1, or
        ``pad_min_size`` neither None nor an int >= 1.

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
    if pad_min_size is not None and (isinstance(pad_min_size, bool) or not isinstance(pad_min_size, int)
                                     or pad_min_size < 1):
        raise ValueError(f"pad_min_size must be None or an int >= 1, got {pad_min_size!r}")
    f = mesh.shape[fast_axis]

    def rule(x):
        shape = tuple(np.shape(x))
        if int(np.prod(shape, dtype=np.int64)) < min_size or not shape:
            return P()
        best = max((d for d in range(len(shape)) if shape[d] % f == 0), key=lambda d: (shape[d], -d), default=None)
        if best is not None:
            return P(*([None] * best + [fast_axis] + [None] * (len(shape) - best - 1)))
        if pad_min_size is None or int(np.prod(shape, dtype=np.int64)) < pad_min_size:
            return P()
        best = max(range(len(shape)), key=lambda d: (shape[d], -d))
        padded = shape[:best] + (-(-shape[best] // f) * f,) + shape[best + 1:]
        return Padded(P(*([None] * best + [fast_axis] + [None] * (len(shape) - best - 1))), shape, padded)

    return jax.tree.map(rule, params)
