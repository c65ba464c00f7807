"""The two-level layout of the step being traced: the fast axis, and which gradient leaves are shards.

On a ``slow x fast`` mesh (:func:`compjax.parallel.make_2d_mesh`) the
compressors run over the slow axis, but the step builders of
:mod:`compjax.parallel` know more than the compressor does: the fast axis
inside each host, and (sharded parameters, ``specs=``) which gradient leaves
are each device's shard of a layer, along which dimension.  They say so here,
at trace time, around the optimizer's ``update``:

* :mod:`compjax.collectives` splits every slow-axis payload over the host's
  fast devices (each sends ``1/fast`` of it, then the pieces are all-gathered
  over the fast axis), so the slow link carries a host's payload once, not
  ``fast`` times; the non-finite vote spans both axes.
* a compressor built with ``compressor(..., on_shards=True)`` (every
  compressor of compjax) receives this device's shards of the gradient
  leaves and per-parameter state as they are, with a :class:`Shards` that
  says which leaves are shards along which dimension and maps flat indices
  between a shard and its layer.  It reduces its per-layer statistics over
  the fast axis (1-bit column sums, norms, maxima; PowerSGD's factors
  ``P = Σ_f M_f Q_f`` or ``Q = Σ_f M_fᵀ P̂_f``), finds a layer's top-k from
  the shards' candidates, and returns its shards: no layer crosses the fast
  axis, and the numbers are the replicated layout's (to rounding).  A
  compressor built without it gets whole layers:
  :func:`compjax.compressors.base.compressor` all-gathers the sharded
  gradient leaves and per-parameter state over the fast axis before its
  exchange and keeps its own shard of the results.

Nothing here issues a collective; outside such a step :func:`current` is None
and compjax behaves as on a one-level mesh.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Cut", "FastLayout", "Shards", "current", "fast_layout", "for_leaves", "scaled_dims", "shard_dims_for"]


class Cut(NamedTuple):
    """A leaf cut over the fast axes in its own layout, along one or several dimensions (a shard dimension entry).

    Where the optimizer works on a leaf laid out as a model annotates it over
    several fast axes (a ``(layers, d, 4d)`` kernel ``P(None, 'fsdp', 'tensor')``
    on a ``(data, fsdp, tensor)`` mesh), its entry in :attr:`FastLayout.dims`
    and :attr:`Shards.dims` is a ``Cut`` instead of an int: the leaf is a
    shard (the entry is not None), each device holds a distinct piece, and
    the pieces' geometry is the spec's.  Only transforms that need no more
    than that receive it (``compressor(..., any_cut=True)``: elementwise
    codecs whose per-layer statistics are sums or maxima over the host, and
    ``cj.diloco`` around them; :func:`compjax.compressors.chains.works_on_any_cut`).
    :meth:`Shards.whole_shape` and :meth:`Shards.own` take it; the flat index
    maps (:meth:`Shards.to_whole`, :meth:`Shards.to_shard`) need one dimension
    and refuse it.

    Attributes:
      entries: one per dimension of the leaf, as in a ``PartitionSpec``: None,
        a fast mesh axis, or a tuple of several (the first one major).
    """

    entries: tuple

    def size(self, d: int) -> int:
        """How many pieces dimension ``d`` is cut into (inside the ``shard_map`` that binds the fast axes)."""
        e = self.entries[d]
        return 1 if e is None else int(jax.lax.axis_size(e))


class FastLayout(NamedTuple):
    """The fast axis of the step being traced and the shard dimension of each gradient leaf.

    Attributes:
      axis: the fast mesh axis (devices inside one host), bound by the enclosing ``shard_map``, or a
        tuple of several (a host is their devices together; index ``c`` over the tuple, the last
        axis fastest, as ``jax.lax.axis_index`` gives it).
      treedef: the gradients' tree structure, or None (replicated layout: no leaf is a shard).
      dims: one entry per gradient leaf (flatten order): the dimension along which the
        leaf is sharded over ``axis``, a :class:`Cut` (sharded over the fast axes in its own
        layout), or None for a leaf every fast device holds whole.
    """

    axis: Any
    treedef: Any = None
    dims: tuple = ()


class Shards(NamedTuple):
    """What a compressor that works on its shards (``compressor(..., on_shards=True)``) is told about its leaves.

    Each leaf it receives is this device's shard of a layer, cut into equal
    pieces along ``dims[i]`` over the fast axis ``axis`` (device ``f`` holds
    the ``f``-th piece), or the whole leaf where ``dims[i]`` is None.  The
    methods map between a shard and its layer: shapes, and flat indices
    (row-major) in either.  They read the device's position on the fast axis
    (``jax.lax.axis_index``) and issue no collective.

    Attributes:
      axis: the fast mesh axis, or a tuple of several (every collective and
        ``axis_index`` then spans them all).
      dims: one entry per leaf: the dimension along which it is sharded, a
        :class:`Cut` (see there), or None.
    """

    axis: Any
    dims: tuple

    def fast(self) -> int:
        """The fast axis size (static int)."""
        return int(jax.lax.axis_size(self.axis))

    def whole_shape(self, x: Any, i: int) -> tuple:
        """The shape of the layer of which leaf ``i`` (``x``, one shard) is a piece."""
        d = self.dims[i]
        shape = tuple(x.shape)
        if isinstance(d, Cut):
            return tuple(n * d.size(k) for k, n in enumerate(shape))
        return shape if d is None else shape[:d] + (shape[d] * self.fast(),) + shape[d + 1:]

    def own(self, x: jnp.ndarray, i: int) -> jnp.ndarray:
        """This device's shard of ``x``, a whole layer laid out like leaf ``i`` (``x`` itself where it is whole)."""
        d = self.dims[i]
        if d is None:
            return x
        if isinstance(d, Cut):
            for k, e in enumerate(d.entries):
                if e is not None:
                    per = x.shape[k] // d.size(k)
                    x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(e).astype(jnp.int32) * per, per, axis=k)
            return x
        per = x.shape[d] // self.fast()
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axis).astype(jnp.int32) * per, per, axis=d)

    def _geometry(self, shape: Sequence[int], d: Any) -> tuple:
        if isinstance(d, Cut):
            raise TypeError(f"a leaf cut along several dimensions ({d}) has no flat index map between its shard and "
                             "its layer: only a compressor built with compressor(..., any_cut=True) takes such leaves "
                             "(the step gives the others each shard cut along one dimension)")
        inner = 1
        for n in shape[d + 1:]:
            inner *= int(n)
        n_d = int(shape[d])
        off = jax.lax.axis_index(self.axis).astype(jnp.int32) * n_d
        return inner, n_d, off

    def to_whole(self, idx: jnp.ndarray, shape: Sequence[int], i: int) -> jnp.ndarray:
        """Flat indices into the layer (int32) of flat indices ``idx`` into leaf ``i``'s shard of ``shape``.

        Inside a shard the row-major order is the layer's (the map only adds
        offsets), so ties broken by the lowest index agree in both.
        """
        d = self.dims[i]
        if d is None:
            return idx
        inner, n_d, off = self._geometry(shape, d)
        outer = idx // (n_d * inner)
        return idx + outer * (n_d * (self.fast() - 1) * inner) + off * inner

    def to_shard(self, g: jnp.ndarray, shape: Sequence[int], i: int) -> jnp.ndarray:
        """Flat indices into leaf ``i``'s shard (of ``shape``) of flat indices ``g`` into the layer (int32).

        An index outside this device's shard maps to the shard's size (past
        its end: scatters with ``mode="drop"`` skip it).
        """
        d = self.dims[i]
        if d is None:
            return g
        inner, n_d, off = self._geometry(shape, d)
        big = n_d * self.fast()
        outer, at, rest = g // (big * inner), (g // inner) % big - off, g % inner
        size = n_d * inner
        for n in shape[:d]:
            size *= int(n)
        inside = (at >= 0) & (at < n_d)
        return jnp.where(inside, (outer * n_d + at) * inner + rest, size)


_STATE = threading.local()


def current() -> FastLayout | None:
    """The layout set by the enclosing :func:`fast_layout`, or None."""
    return getattr(_STATE, "layout", None)


@contextlib.contextmanager
def fast_layout(axis: Any, grads: Any = None, dims: Sequence | None = None) -> Iterator[FastLayout]:
    """Declare, while tracing a step's ``update``, the fast axis and which gradient leaves are shards.

    Args:
      axis: the fast mesh axis, or a tuple of several.
      grads: the gradient tree the optimizer receives (its structure is kept), or None.
      dims: with ``grads``, one shard dimension (int) or None per leaf of ``grads``.

    Yields:
      the :class:`FastLayout` in force.

    Raises:
      ValueError: ``dims`` given without ``grads`` or of another length than its leaves.
    """
    treedef, entries = None, ()
    if grads is not None:
        leaves, treedef = jax.tree.flatten(grads)
        entries = tuple(dims) if dims is not None else (None,) * len(leaves)
        if len(entries) != len(leaves):
            raise ValueError(f"dims has {len(entries)} entries for {len(leaves)} gradient leaves")
    elif dims is not None:
        raise ValueError("dims needs the gradient tree it describes (grads=)")
    previous = current()
    _STATE.layout = FastLayout(axis, treedef, entries)
    try:
        yield _STATE.layout
    finally:
        _STATE.layout = previous


@contextlib.contextmanager
def for_leaves(leaves: Sequence, dims: Sequence | None) -> Iterator[FastLayout | None]:
    """Re-declare the layout for a list of leaves (a part of the gradients), e.g. one fragment of DiLoCo.

    Outside a two-level step (no layout in force) nothing changes.

    Args:
      leaves: the leaves a nested transform will receive, as a list.
      dims: their shard dimensions (None entries: whole), or None: none is a shard.
    """
    lay = current()
    if lay is None:
        yield None
        return
    with fast_layout(lay.axis, list(leaves), None if dims is None else list(dims)) as new:
        yield new


def shard_dims_for(tree: Any, who: str) -> tuple | None:
    """The shard dimension of each leaf of ``tree`` under the current layout (None entries: whole leaves).

    Returns None outside a sharded layout (no layout, or a replicated one).

    Raises:
      ValueError: a sharded layout is in force and ``tree`` does not have the
        structure of the gradients it describes (e.g. a compressor inside
        ``optax.masked``, which sees part of the tree): ``who`` is named.
    """
    lay = current()
    if lay is None or lay.treedef is None or not any(d is not None for d in lay.dims):
        return None
    treedef = jax.tree.structure(tree)
    if treedef != lay.treedef:
        raise ValueError(
            f"{who} runs on sharded parameters but receives a gradient tree of another structure than the "
            f"step's ({treedef} vs {lay.treedef}): under specs= a compressor must see the whole gradient tree "
            "(put it first in the chain, not inside optax.masked or optax.multi_transform)"
        )
    return lay.dims


def scaled_dims(init: Any, whole: Any, shards: Any, fast: int) -> list:
    """Which leaves of a state are shards: built for the whole layers and for the shards, what scales.

    ``init`` is evaluated abstractly (``jax.eval_shape``) on the whole leaves
    and on one device's shards.  A state leaf (matched by its key path) whose
    shape differs in exactly one dimension, ``fast`` times larger for the whole
    layers, is a shard along that dimension (optimizer moments, residuals, a
    history of ``(slots, *shape)``, PowerSGD's ``Q`` when the sharded dimension
    is among the columns); every other leaf (the same shape, no counterpart,
    any other change) is held whole by every fast device (None).  This one
    rule lays the step's state out (:func:`compjax.parallel.state_specs`) and
    tells the compressors which state fields to gather.

    Args:
      init: ``init(tree) -> state``.
      whole, shards: the same tree of arrays (or ``jax.ShapeDtypeStruct``),
        whole and as one device's shards.
      fast: the fast axis size.

    Returns:
      One entry per leaf of ``init(whole)`` (flatten order): an int dimension or None.
    """
    def struct(x):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)

    full = jax.tree_util.tree_flatten_with_path(jax.eval_shape(init, jax.tree.map(struct, whole)))[0]
    part = dict(jax.tree_util.tree_flatten_with_path(jax.eval_shape(init, jax.tree.map(struct, shards)))[0])
    out = []
    for path, a in full:
        b = part.get(path)
        diff = [] if b is None or len(a.shape) != len(b.shape) else \
            [d for d, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        out.append(diff[0] if len(diff) == 1 and a.shape[diff[0]] == fast * b.shape[diff[0]] else None)
    return out
