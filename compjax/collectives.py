"""The wire: every collective compjax issues goes through this module.

Each function takes a worker's local payload, moves it with one or two
``jax.lax`` collectives over ``axis_name`` and returns ``(result, payload_bytes)``:
the decompressed **mean over workers** and the number of bytes this worker put
into the collectives (the operand bytes of the collective ops in the compiled
program, as :func:`compjax.audit_collectives` reads them).

``axis_name=None`` means a single worker: no collective is issued and the
result is the worker's own payload decoded; ``payload_bytes`` still reports
the size of the payload the worker would send, so single-process simulations
can account bytes.

Every collective is issued inside ``jax.named_scope("compjax/<what>")``
(:data:`SCOPE`; ``<what>`` is ``vote``, ``dense_mean``, ``sparse_mean``,
``gathered_mean`` or ``max``).  The scope ends up in the compiled program's
op metadata (``metadata={op_name=".../compjax/dense_mean/psum"}``), where
:func:`compjax.audit_collectives` reads it to tell compjax's collectives from
those a model or XLA's SPMD partitioner issued.

All-gathers send floats narrower than 32 bits (bfloat16, float16, float8) as
unsigned integers of the same width (``jax.lax.bitcast_convert_type``, no data
moves): XLA:CPU widens a bfloat16 all-gather to float32 and a float8 one to
float16, an integer all-gather it sends as it is, so the wire carries exactly
``itemsize`` bytes per value on every backend.  All-reduces must add or
compare values and keep their float dtype; :func:`reduce_bytes` counts what
XLA:CPU makes of them.

The same code runs under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)``.

**Two-level meshes.** Inside a step of :mod:`compjax.parallel` on a ``slow x
fast`` mesh (:func:`compjax.layout.current` names the fast axis), every fast
device of a host holds the same payload.  Each then sends only its ``1/fast``
piece of it over the slow axis (the flat payload padded to a multiple of
``fast``), and the pieces are all-gathered back over the fast axis (inside the
host, :func:`uncounted`): the slow link carries each host's payload once.
``payload_bytes`` is then the bytes one host (one slow-axis worker) puts on
the slow link: ``fast`` times what each of its devices sends, the padding
included; a device's own share is ``payload_bytes / fast``.  The non-finite
vote is taken over the fast axis first (inside the host), then over the slow
axis (4 bytes from each device).  Under sharded parameters a device's shard
of a layer (or the codes of it) is already its part of the host's payload:
:func:`dense_mean_arrays` (``shards=``) and :func:`gathered_mean` (``own=``)
send it as it is, and a compressor working on shards reduces its per-layer
statistics with :func:`sum_over_fast`, :func:`max_over_fast` and
:func:`gather_over_fast` (inside the host, uncounted).

**Automatic axes.**  Under a ``jax.shard_map`` manual over the worker axis
only (``axis_names={axis_name}``: :func:`compjax.parallel.worker_step` on a
``slow x fast`` mesh, a user's step over parameters sharded by their own
annotations), the other mesh axes are automatic: XLA partitions the step
inside each worker, and a payload computed there is held whole by each of
the worker's devices.  Each device then sends only its own part of the flat
payload (padded to a multiple of the worker's devices; a slice inside a
``jax.shard_map`` manual over those axes), and the parts of the result are
all-gathered back inside the worker (:func:`uncounted`): the same
``payload_bytes`` as above, the bytes one worker puts on the link between
workers, each device's 4-byte vote included.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from compjax import layout
from compjax.codecs import ordering
from compjax.codecs.bucket import BUCKET_CAP_BYTES, group_by_size, make_bucket

AxisName = Hashable | None

__all__ = [
    "SCOPE",
    "UNCOUNTED_SCOPE",
    "any_over_fast",
    "any_over_workers",
    "capture",
    "cond_unified",
    "dense_mean",
    "dense_mean_arrays",
    "gather_inside_host",
    "gather_over_fast",
    "gather_shards",
    "gathered_mean",
    "like_varying",
    "match_varying",
    "max_over_fast",
    "max_over_workers",
    "num_workers",
    "reduce_bytes",
    "replay",
    "sparse_mean",
    "sparse_mean_segments",
    "sum_over_fast",
    "tapping",
    "typed_axis",
    "uncounted",
    "vary",
    "varying_axes",
    "worker_index",
]


#: Outermost ``jax.named_scope`` of every collective this module issues: the op
#: metadata of the compiled collectives reads ``.../compjax/<what>/<primitive>``.
SCOPE = "compjax"


#: ``jax.named_scope`` around the collectives compjax issues that no compressor counts in its
#: ``payload_bytes``: the dense gradient mean over a 2-D mesh's fast axis and model state averaged over
#: workers by the step builders (:mod:`compjax.parallel`, :mod:`compjax.workers`).
UNCOUNTED_SCOPE = "compjax_uncounted"


def uncounted():
    """``jax.named_scope`` marking the collectives traced inside it as compjax's but not a compressor's payload.

    :func:`compjax.audit_collectives` reports them with ``issuer ==
    "compjax-uncounted"``, apart from the payload (``"compjax"``) that
    :func:`compjax.payload_bytes` counts.
    """
    return jax.named_scope(UNCOUNTED_SCOPE)


def _scope(what: str):
    """``jax.named_scope("compjax/<what>")``: the name the compiled collective carries in its metadata."""
    return jax.named_scope(f"{SCOPE}/{what}")


def _nbytes(x: jnp.ndarray) -> int:
    return int(x.size) * jnp.dtype(x.dtype).itemsize


def _wire_uint(dtype) -> Any:
    """The unsigned integer dtype a narrow float travels as in an all-gather (None: sent as it is)."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or 8 * dtype.itemsize != jnp.finfo(dtype).bits:
        return None
    return {1: jnp.uint8, 2: jnp.uint16}.get(dtype.itemsize)


def _all_gather(x: jnp.ndarray, axis_name: AxisName, **kw: Any) -> jnp.ndarray:
    """``jax.lax.all_gather(x, axis_name)`` with 8- and 16-bit floats sent bitcast to unsigned integers.

    XLA:CPU widens bfloat16 all-gathers to float32 and float8 ones to float16
    (twice the bytes on the wire); integers of the same width it sends as they
    are.  The bitcasts move no data and the result is bit for bit the same.
    """
    wire = _wire_uint(x.dtype)
    if wire is None:
        return jax.lax.all_gather(x, axis_name, **kw)
    return jax.lax.bitcast_convert_type(jax.lax.all_gather(jax.lax.bitcast_convert_type(x, wire), axis_name, **kw),
                                        x.dtype)


def gather_shards(x: jnp.ndarray, fast: str, axis: int) -> jnp.ndarray:
    """The whole parameter of which ``x`` is this device's shard along ``axis``, for a forward pass.

    A tiled ``jax.lax.all_gather`` over ``fast``, typed varying: its transpose
    is a reduce-scatter, so the gradient with respect to the shard is the sum
    over the host's devices of their gradients of the whole parameter.  Issued
    under :func:`uncounted` (inside the host: no compressor's payload).
    """
    with uncounted():
        return jax.lax.all_gather(x, fast, axis=axis, tiled=True)


def gather_inside_host(x: jnp.ndarray, fast: str, axis: int | layout.Cut) -> jnp.ndarray:
    """The whole array of which ``x`` is this device's piece along ``axis``: a tiled all-gather over ``fast``.

    ``axis`` is a dimension, or a :class:`compjax.layout.Cut` (a piece cut
    along several dimensions: one tiled all-gather per cut dimension, over
    that dimension's axes).  Typed invariant over ``fast`` (every device of
    the host holds the same result), issued under :func:`uncounted` (inside
    the host: no compressor's payload).  Not for differentiation (its
    transpose is a slice, not a reduce-scatter).
    """
    with uncounted():
        if isinstance(axis, layout.Cut):
            for d, entry in enumerate(axis.entries):
                if entry is not None:
                    x = _all_gather(x, entry, axis=d, tiled=True, to="invarying")
            return x
        return _all_gather(x, fast, axis=axis, tiled=True, to="invarying")


def _host_axis(axis_name: AxisName) -> str | None:
    """The fast axis over which a slow-axis payload is split (None: sent whole by every device)."""
    lay = layout.current()
    if lay is None or axis_name is None:
        return None
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return None if lay.axis in names else lay.axis


def _piece(x: jnp.ndarray, fast: str) -> tuple[jnp.ndarray, int]:
    """This device's ``1/fast`` piece of the flat ``x`` (zero-padded to a multiple of ``fast``), and its length."""
    flat = jnp.ravel(x)
    f = int(jax.lax.axis_size(fast))
    per = -(-int(flat.size) // f)
    flat = jnp.pad(flat, (0, per * f - int(flat.size)))
    start = jax.lax.axis_index(fast).astype(jnp.int32) * per
    return jax.lax.dynamic_slice_in_dim(flat, start, per), f


def _join(piece: jnp.ndarray, like: jnp.ndarray, fast: str) -> jnp.ndarray:
    """The host's pieces all-gathered over ``fast`` (inside the host), trimmed and shaped like ``like``."""
    with uncounted():
        whole = _all_gather(piece, fast, to="invarying")  # (fast, ...piece): device f's piece at f
    whole = jnp.moveaxis(whole, 0, -2)  # (..., fast, per): the flat payload in order
    whole = whole.reshape(whole.shape[:-2] + (-1,))[..., : int(like.size)]
    return whole.reshape(whole.shape[:-1] + like.shape)


def _auto_axes(axis_name: AxisName) -> tuple:
    """The automatic mesh axes (of more than one device) over which a worker-axis payload is spread.

    Under a ``jax.shard_map`` manual over the worker axis only (``axis_names=
    {axis_name}``, :func:`compjax.parallel.worker_step` on a ``slow x fast``
    mesh), the other mesh axes are left to XLA's sharding propagation: a
    payload computed there is held whole by every device of the worker, and
    each would send all of it.  Empty outside such a region, without an axis,
    and in a two-level step of :mod:`compjax.parallel` (there :func:`_host_axis`
    splits the payload over the manual fast axis).
    """
    if axis_name is None or layout.current() is not None:
        return ()
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = set(mesh.manual_axes)
    if not manual or not set(names) <= manual:
        return ()
    return tuple(a for a in mesh.auto_axes if mesh.shape[a] > 1)


def _over_parts(collective: Callable, x: jnp.ndarray, auto: tuple) -> tuple[jnp.ndarray, jax.ShapeDtypeStruct]:
    """``collective`` over the worker axis on each device's disjoint part of the flat ``x``, the parts joined.

    ``x`` is raveled, zero-padded to a multiple of the devices of the
    automatic axes ``auto`` (:func:`_auto_axes`); inside a ``jax.shard_map``
    manual over ``auto``, each device of the worker (all of which hold the
    whole payload) slices out its own part (a slice, not a sharding
    constraint: XLA's propagation is left alone) and puts only that part into
    ``collective`` (``part -> (per,)`` for a reduction, ``-> (n, per)`` for
    an all-gather), so the worker's devices together send the payload once.  The parts of the result are then
    all-gathered over ``auto`` (inside the worker, :func:`uncounted`), so
    every device of the worker holds the whole result, and trimmed.

    Returns:
      ``(result, payload)``: the result shaped like ``x`` (``(n, *x.shape)``
      for an all-gather), and the shape and dtype of the flat padded payload
      (the worker's, all its devices' parts together).
    """
    mesh = jax.sharding.get_abstract_mesh()
    flat = jnp.ravel(x)
    f = 1
    for a in auto:
        f *= int(mesh.shape[a])
    per = -(-int(flat.size) // f)
    flat = jnp.pad(flat, (0, per * f - int(flat.size)))

    def on_part(whole):  # every device holds the whole payload: it takes its part, no data moves
        start = jax.lax.axis_index(auto).astype(jnp.int32) * per
        y = collective(jax.lax.dynamic_slice_in_dim(whole, start, per))
        with uncounted():  # the worker's parts of the result, joined inside the worker
            return _all_gather(y, auto, axis=y.ndim - 1, tiled=True, to="invarying")

    none = jax.sharding.PartitionSpec()
    y = jax.shard_map(on_part, mesh=mesh, in_specs=none, out_specs=none, axis_names=set(auto))(flat)
    y = y[..., : int(x.size)]
    return y.reshape(y.shape[:-1] + x.shape), jax.ShapeDtypeStruct(flat.shape, flat.dtype)


def rows_over_worker_devices(x: jnp.ndarray, axis_name: AxisName) -> jnp.ndarray:
    """``x`` laid out with its first dimension over the devices of its worker, where XLA lays out the worker's step.

    Under a ``jax.shard_map`` manual over the worker axis only
    (:func:`compjax.parallel.worker_step` on a mesh with more axes), XLA
    propagates the model's shardings into a compressor's arithmetic.  A layer
    sharded over two axes in two dimensions (``P('fsdp', 'tensor')``) reaches
    chunk top-k's per-tile selection with a layout on which XLA:CPU's SPMD
    partitioner (jaxlib 0.10.2) aborts (a check failure partitioning the
    gather); with the tiles' rows over the worker's devices it does not.
    Where the worker's devices do not divide the rows (a layer cut into fewer
    tiles than its worker has devices, e.g. a ``P('fsdp')`` leaf of 32 x 32 in
    two tiles on four devices), XLA:CPU's partitioner aborts the same way
    (``spmd_partitioner_util.cc``: ``Check failed:
    partition_group_list.num_replica_groups() * ...``) when it keeps the
    model's sharding into the per-row gather: ``x`` is then held whole by every
    device of its worker (such a layer's tiles are few).  Only the layout inside
    the worker changes, not the values.  Outside such a region ``x`` as it is.
    """
    auto = _auto_axes(axis_name)
    if not auto or x.ndim == 0:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    size = 1
    for a in auto:
        size *= int(mesh.shape[a])
    if int(x.shape[0]) % size:
        return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(auto))


def reduce_bytes(x: jnp.ndarray) -> int:
    """Bytes one worker puts into an all-reduce (sum or max) of ``x`` (a Python int, exact at any size).

    ``x.size * itemsize``, except on the CPU backend (``jax.default_backend()``),
    where XLA:CPU widens narrow floats before reducing them and sends the wide
    values (the compiled program's all-reduce operand has the wide dtype, as
    :func:`compjax.audit_collectives` shows): bfloat16 travels as float32 (4
    bytes per element) and 8-bit floats (checked: float8_e4m3fn, float8_e5m2)
    as float16 (2 bytes).  float16, float32 and integers travel as they are.
    Checked for ``psum``, ``pmax`` and ``pmin`` with jaxlib 0.10.2; other
    backends are taken to reduce every dtype natively.

    All-gathers never widen: this module sends narrow floats through them
    bitcast to unsigned integers (``x.size * itemsize`` bytes everywhere).
    Without a worker axis nothing is sent and the functions below report the
    payload's own size.

    Args:
      x: the all-reduce operand (an array, tracer or ``jax.ShapeDtypeStruct``).

    Returns:
      The operand's bytes on the wire, a Python int.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> reduce_bytes(jnp.zeros(10, jnp.float16))
      20
      >>> reduce_bytes(jnp.zeros(10, jnp.bfloat16)) == (40 if jax.default_backend() == "cpu" else 20)
      True
    """
    dtype = jnp.dtype(x.dtype)
    if jax.default_backend() == "cpu" and jnp.issubdtype(dtype, jnp.floating):
        if dtype == jnp.bfloat16:
            return int(x.size) * 4
        if jnp.finfo(dtype).bits == 8:
            return int(x.size) * 2
    return _nbytes(x)


def num_workers(axis_name: AxisName) -> int:
    """Number of workers along ``axis_name`` (1 when ``axis_name`` is None). Static int."""
    if axis_name is None:
        return 1
    return int(jax.lax.axis_size(axis_name))


def worker_index(axis_name: AxisName) -> jnp.ndarray:
    """This worker's index along ``axis_name`` as an int32 scalar (0 when None)."""
    if axis_name is None:
        return jnp.zeros((), jnp.int32)
    return jax.lax.axis_index(axis_name).astype(jnp.int32)


def varying_axes(x) -> frozenset:
    """Manual mesh axes over which ``x`` is typed as varying under ``shard_map`` (empty elsewhere).

    Accepts arrays, tracers and ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``).
    """
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # older JAX spelling


def typed_axis(axis: str) -> bool:
    """Whether ``axis`` (bound here) is one whose values JAX types as varying or invariant.

    True inside ``jax.shard_map`` with ``check_vma=True`` (the default) over a
    mesh that has ``axis``: there an array that came out of a ``psum`` or
    ``pmean`` over ``axis`` is typed invariant, one computed from per-worker
    data varying.  False under ``pmap``, ``vmap`` and ``shard_map(...,
    check_vma=False)``, where no type says it.  Read at trace time from the
    type of ``jax.lax.axis_index(axis)`` (varying wherever the types are
    tracked; unused, so it leaves no instruction in the compiled program).
    """
    return axis in varying_axes(jax.lax.axis_index(axis))


def vary(x: jnp.ndarray, axes) -> jnp.ndarray:
    """Type ``x`` as varying over ``axes`` too (``jax.lax.pcast(..., to="varying")``; no data moves)."""
    missing = tuple(sorted(set(axes) - varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def like_varying(x: jnp.ndarray, like: jnp.ndarray) -> jnp.ndarray:
    """Type ``x`` as varying over the manual axes over which ``like`` varies (no data moves).

    Under ``shard_map``'s varying-axes checks, a mean that came out of a
    collective is invariant while state passed in with ``P(axis)`` is varying;
    the two branches of a ``lax.cond`` must agree, so the invariant one is cast
    (``jax.lax.pcast(..., to="varying")``).  Elsewhere (pmap, vmap, no axis) this
    returns ``x`` unchanged.
    """
    return vary(x, varying_axes(like))


def match_varying(tree, like):
    """:func:`like_varying` leaf by leaf over two pytrees of the same structure (``None`` leaves kept)."""
    return jax.tree.map(like_varying, tree, like)


def cond_unified(pred: jnp.ndarray, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``jax.lax.cond(pred, true_fn, false_fn)`` whose branches agree on varying axes, leaf by leaf.

    Under ``jax.shard_map`` both branches of a ``lax.cond`` must type each output
    leaf as varying over the same manual axes; a mean that came out of a
    collective is invariant while state passed in with ``P(axis)`` is varying.
    Each leaf is cast (:func:`vary`, no data moves) to the union of the two
    branches' axes.  ``true_fn`` is traced **once** (``lax.cond`` traces it
    first and its output types are kept for the other branch) and ``false_fn``
    twice (once with ``jax.eval_shape``): put the costly branch first.
    Collectives inside the branches run only in the branch taken: ``pred``
    must be the same on every worker (e.g. from :func:`any_over_workers`).

    Args:
      pred: boolean scalar.
      true_fn, false_fn: functions of no arguments returning pytrees of the same
        structure, shapes and dtypes (``float0`` leaves are left as they are).

    Returns:
      The output of the branch ``pred`` selects.
    """
    false_types = jax.eval_shape(false_fn)
    seen: dict[str, Any] = {}

    def axes(tree):
        return [frozenset() if x.dtype == jax.dtypes.float0 else varying_axes(x) for x in jax.tree.leaves(tree)]

    def cast(tree, *others):
        leaves, treedef = jax.tree.flatten(tree)
        out = [x if x.dtype == jax.dtypes.float0 else vary(x, frozenset().union(*(o[i] for o in others)))
               for i, x in enumerate(leaves)]
        return jax.tree.unflatten(treedef, out)

    def first(_):
        out = true_fn()
        seen["true"] = axes(out)
        return cast(out, seen["true"], axes(false_types))

    def second(_):
        true_axes = seen.get("true")
        if true_axes is None:  # a JAX that traces the branches in another order: trace true_fn on its own
            true_axes = axes(jax.eval_shape(true_fn))
        return cast(false_fn(), axes(false_types), true_axes)

    return jax.lax.cond(pred, first, second, None)


def any_over_workers(flag: jnp.ndarray, axis_name: AxisName) -> tuple[jnp.ndarray, int]:
    """Whether ``flag`` is true on any worker: one int32 all-reduce (``pmax``) of 4 bytes.

    Every worker gets the same answer, so a decision taken on it (skip a
    step, take a branch) is taken by all workers together.

    Args:
      flag: boolean scalar, this worker's vote.
      axis_name: worker axis, or None (the own flag, 0 bytes).

    Returns:
      ``(any, payload_bytes)``: a boolean scalar, the same on every worker, and 4
      per device of the worker (4 on a 1-D mesh; ``4 * fast`` on a two-level
      mesh, fast axis manual or automatic), 0 without an axis.
    """
    if axis_name is None:
        return flag, 0
    vote = any_over_fast(flag).astype(jnp.int32) if _host_axis(axis_name) else flag.astype(jnp.int32)
    with _scope("vote"):
        total = jax.lax.pmax(vote, axis_name)
    fast = _host_axis(axis_name)
    devices = int(jax.lax.axis_size(fast)) if fast else 1
    mesh = jax.sharding.get_abstract_mesh()
    for a in _auto_axes(axis_name):  # every device of the worker votes (4 bytes each)
        devices *= int(mesh.shape[a])
    return total > 0, _nbytes(vote) * devices


def any_over_fast(flag: jnp.ndarray) -> jnp.ndarray:
    """Whether ``flag`` is true on any device of this host: a ``pmax`` over the fast axis, inside the host.

    On a two-level step (:func:`compjax.layout.current`) the devices of one
    host hold shards of the same worker's state, so a decision such as
    skipping a non-finite step must be theirs together.  Elsewhere ``flag``
    is returned as it is.  Sent inside the host (:func:`uncounted`), so no
    compressor counts it.

    Args:
      flag: boolean scalar.

    Returns:
      boolean scalar, the same on every device of the host.
    """
    lay = layout.current()
    if lay is None:
        return flag
    with uncounted():
        return jax.lax.pmax(flag.astype(jnp.int32), lay.axis) > 0


def _inside_host(x: jnp.ndarray, reduce: Callable) -> jnp.ndarray:
    """``reduce(x, fast axis)`` under :func:`uncounted` on a two-level step; ``x`` as it is elsewhere."""
    lay = layout.current()
    if lay is None:
        return x
    with uncounted():
        return reduce(x, lay.axis)


def sum_over_fast(x: jnp.ndarray) -> jnp.ndarray:
    """Sum of ``x`` over the devices of this host: a ``psum`` over the fast axis, inside the host.

    On a two-level step (:func:`compjax.layout.current`) a statistic of a
    sharded layer (a squared norm) is the sum of its shards' statistics.
    Elsewhere ``x`` is returned as it is.  Sent inside the host
    (:func:`uncounted`), so no compressor counts it.

    Args:
      x: an array (usually a float32 scalar).

    Returns:
      ``x`` summed over the fast axis: the same on every device of the host.
    """
    return _inside_host(x, jax.lax.psum)


def max_over_fast(x: jnp.ndarray) -> jnp.ndarray:
    """Elementwise max of ``x`` over the devices of this host: a ``pmax`` over the fast axis, inside the host.

    On a two-level step (:func:`compjax.layout.current`) the largest magnitude
    of a sharded layer is the largest of its shards'.  Elsewhere ``x`` is
    returned as it is.  Sent inside the host (:func:`uncounted`).

    Args:
      x: an array (usually a float32 scalar or a few per-layer statistics).

    Returns:
      ``x`` maxed over the fast axis: the same on every device of the host.
    """
    return _inside_host(x, jax.lax.pmax)


def gather_over_fast(x: jnp.ndarray) -> jnp.ndarray:
    """Every device's ``x`` of this host, stacked: ``(fast, *x.shape)``, an all-gather over the fast axis.

    For the few values a compressor working on shards needs from its
    neighbours (each shard's top-k candidates, per-shard statistics), not for
    a layer.  Typed invariant over the fast axis (every device of the host
    holds the same result), sent inside the host (:func:`uncounted`).
    Elsewhere (no two-level step) ``x[None]``.

    Args:
      x: an array of any shape and dtype.

    Returns:
      ``(fast, *x.shape)``, device ``f``'s ``x`` at ``f``.
    """
    lay = layout.current()
    if lay is None:
        return x[None]
    with uncounted():
        return _all_gather(x, lay.axis, to="invarying")


def dense_mean(x: jnp.ndarray, axis_name: AxisName, *, prescale: bool = False) -> tuple[jnp.ndarray, int]:
    """Mean of ``x`` over workers with one all-reduce (``psum`` then ``/ n``).

    Args:
      x: this worker's array, any shape and float dtype.
      axis_name: worker axis, or None for one worker.
      prescale: divide by ``n`` before the sum instead of after, so a sum in a
        narrow dtype (float16) cannot overflow: ``|sum_i x_i / n| <= max_i |x_i|``.

    Returns:
      ``(mean, payload_bytes)``: the mean, same shape and dtype as ``x``, and
      the all-reduce operand's bytes (:func:`reduce_bytes`).
    """
    (x,) = _tap(axis_name, (x,))  # capture() / replay(): one worker's payload as arrays of its own
    if axis_name is None:  # nothing on the wire: the payload as it would be sent
        return x, _nbytes(x)
    n = jnp.asarray(num_workers(axis_name), x.dtype)
    if prescale:
        x = x / n
    fast = _host_axis(axis_name)
    if fast is not None:  # each device of the host reduces its piece; the pieces come back inside the host
        piece, f = _piece(x, fast)
        with _scope("dense_mean"):
            piece = jax.lax.psum(piece, axis_name)
        total = _join(piece, x, fast)
        return (total if prescale else total / n), f * reduce_bytes(piece)
    auto = _auto_axes(axis_name)
    if auto:  # each device of the worker reduces its own part of the payload
        with _scope("dense_mean"):
            total, sent = _over_parts(lambda p: jax.lax.psum(p, axis_name), x, auto)
        return (total if prescale else total / n), reduce_bytes(sent)
    with _scope("dense_mean"):
        total = jax.lax.psum(x, axis_name)
    return (total if prescale else total / n), reduce_bytes(x)


def dense_mean_arrays(
    arrays: Sequence[jnp.ndarray], axis_name: AxisName, *, prescale: bool = False,
    shards: Sequence[bool] | None = None,
) -> tuple[list[jnp.ndarray], int]:
    """Mean over workers of several arrays, bucketed: per dtype, buckets of at most 64 MiB.

    The arrays of each dtype are raveled into flat buffers of at most
    :data:`compjax.codecs.bucket.BUCKET_CAP_BYTES` (64 MiB) each, consecutive
    arrays together (:func:`compjax.codecs.bucket.group_by_size`; an array
    larger than that is reduced on its own, without a copy), each reduced with
    :func:`dense_mean` and split back: no buffer the size of the whole model
    is built, and ``payload_bytes`` is the sum over the buffers, the bytes one
    buffer per dtype would carry.  Under a two-level step's fast axis
    (:func:`compjax.layout.current`), the arrays every fast device holds whole
    stay in one bucket per dtype, so their padding to a multiple of the fast
    size (and the bytes) is that of one buffer.  float16 buffers are always
    prescaled (divided by ``n`` before the sum) so their sum cannot overflow.

    Args:
      arrays: this worker's arrays, any shapes; an empty sequence issues nothing.
      axis_name: worker axis, or None.
      prescale: as in :func:`dense_mean`, for every dtype.
      shards: one flag per array, or None (all False): the array is this
        device's shard of a layer (parameters sharded over a two-level step's
        fast axis), not a payload every fast device holds.  A shard is already
        this device's part of the host's payload: it goes over ``axis_name``
        as it is, beside this device's piece of the other arrays' bucket, in
        the same all-reduce.  The host then sends the same bytes as with
        whole layers (shards divide by the fast size, so the padding is the
        whole arrays').

    Returns:
      ``(means, payload_bytes)``: the means in the input order and shapes, and
      the total bytes of the all-reduce operands.
    """
    out: list[jnp.ndarray | None] = [None] * len(arrays)
    total = 0
    by_dtype: dict[jnp.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(jnp.dtype(a.dtype), []).append(i)
    fast = _host_axis(axis_name)
    for idxs in by_dtype.values():
        own = [i for i in idxs if shards is not None and shards[i]] if fast is not None else []
        if own:
            rest = [i for i in idxs if i not in own]
            means, nbytes = _dense_mean_with_shards([arrays[i] for i in own], [arrays[i] for i in rest], axis_name,
                                                    fast, prescale)
            total += nbytes
            for i, m in zip(own + rest, means):
                out[i] = m
            continue
        groups = [idxs] if fast is not None else [[idxs[j] for j in g] for g in group_by_size(
            [_nbytes(arrays[i]) for i in idxs], BUCKET_CAP_BYTES)]
        mean = None
        for group in groups:
            bucket = make_bucket([arrays[i].shape for i in group])
            flat = bucket.flatten([arrays[i] for i in group])
            # One all-reduce after the other: XLA combines independent all-reduces into one instruction, whose
            # operands and results are then all alive at once (a whole model's gradients twice, however capped).
            if mean is not None and axis_name is not None:
                flat = ordering.after(flat, ordering.zero_after(mean))
            mean, nbytes = dense_mean(flat, axis_name, prescale=prescale or flat.dtype == jnp.float16)
            total += nbytes
            for i, m in zip(group, bucket.unflatten(mean)):
                out[i] = m
    return out, total  # type: ignore[return-value]


def _in_place_slices(x: jnp.ndarray, axis_name: AxisName, n: int, prescale: bool) -> tuple[jnp.ndarray, int]:
    """Mean over workers of the flat ``x`` in slices of at most :data:`BUCKET_CAP_BYTES`, each written back in place.

    One all-reduce per slice, one after the other (each slice is read from
    the array the previous one was written into), so only one slice's
    operand and result (and, on XLA:CPU, their float32 copies for a 16-bit
    ``x``) are alive beside ``x``.  Returns ``(mean, payload_bytes)``: the
    bytes are those of ``x`` (the slices together).
    """
    per = max(1, BUCKET_CAP_BYTES // jnp.dtype(x.dtype).itemsize)
    size = int(x.size)
    div = jnp.asarray(n, x.dtype)
    sent = 0
    for a in range(0, size, per):
        piece = jax.lax.slice_in_dim(x, a, min(a + per, size))
        if prescale:
            piece = piece / div
        with _scope("dense_mean"):
            piece = jax.lax.psum(piece, axis_name)
        if not prescale:
            piece = piece / div
        sent += reduce_bytes(piece)
        x = jax.lax.dynamic_update_slice_in_dim(x, like_varying(piece, x), a, axis=0)
    return x, sent


def _dense_mean_with_shards(own, rest, axis_name, fast, prescale):
    """:func:`dense_mean_arrays` of one dtype: shards ``own`` sent as they are, the bucket of ``rest`` in pieces.

    The shards and this device's piece of the ``rest`` bucket go in buffers of
    at most :data:`BUCKET_CAP_BYTES`, one all-reduce each: the bytes of one
    buffer holding them all.  A shard above the cap is reduced in slices of
    the cap, each written back into the shard in place
    (:func:`_in_place_slices`): XLA:CPU reduces 16-bit floats in float32,
    through a float32 copy of the operand and of the result, which for a
    whole stacked layer would be two float32 copies of it.
    """
    n = num_workers(axis_name)
    dtype = own[0].dtype
    prescale = prescale or dtype == jnp.float16
    parts = [jnp.ravel(x) for x in own]
    if rest:
        bucket = make_bucket([x.shape for x in rest])
        whole = bucket.flatten(rest)
        piece, _ = _piece(whole, fast)
        parts.append(piece)
    f = int(jax.lax.axis_size(fast))
    out: list = [None] * len(parts)
    last, nbytes = None, 0
    for group in group_by_size([_nbytes(p) for p in parts], BUCKET_CAP_BYTES):
        if len(group) == 1 and _nbytes(parts[group[0]]) > BUCKET_CAP_BYTES:
            x = parts[group[0]]
            if last is not None:
                x = ordering.after(x, ordering.zero_after(last))
            x, sent = _in_place_slices(x, axis_name, n, prescale)
            nbytes += f * sent
            out[group[0]] = last = x
            continue
        buf = parts[group[0]] if len(group) == 1 else jnp.concatenate([parts[j] for j in group])
        if last is not None:  # one all-reduce after the other: XLA would combine them, all operands and results alive
            buf = ordering.after(buf, ordering.zero_after(last))
        if prescale:
            buf = buf / jnp.asarray(n, dtype)
        with _scope("dense_mean"):
            buf = jax.lax.psum(buf, axis_name)
        if not prescale:
            buf = buf / jnp.asarray(n, dtype)
        nbytes += f * reduce_bytes(buf)
        at = 0
        for j in group:
            out[j] = buf[at: at + int(parts[j].size)]
            at += int(parts[j].size)
        last = buf
    means = [r.reshape(x.shape) for r, x in zip(out, own)]
    if rest:
        means += bucket.unflatten(_join(out[-1], whole, fast))
    return means, nbytes


def sparse_mean(
    indices: jnp.ndarray, values: jnp.ndarray, size: int, axis_name: AxisName
) -> tuple[jnp.ndarray, int]:
    """Mean over workers of sparse vectors: all-gather (indices, values), then scatter-add.

    Every worker's ``k`` indices and values travel through ``jax.lax.all_gather``;
    each worker then scatter-adds all ``n * k`` pairs into a dense buffer and
    divides by ``n`` (Lin et al. 2018, Sec. 3: exchange of sparse gradients).
    Duplicate indices (within or across workers) add up.

    Args:
      indices: int32 ``(k,)`` flat indices into a vector of ``size`` elements.
      values: ``(k,)`` values at those indices, float dtype.
      size: length of the dense vector (static).
      axis_name: worker axis, or None.

    Returns:
      ``(mean, payload_bytes)``: the dense ``(size,)`` mean in ``values.dtype`` and
      ``k * (4 + itemsize)`` bytes (the two all-gather operands).

    Raises:
      ValueError: ``indices`` and ``values`` not 1-D of the same shape.
    """
    (mean,), nbytes = sparse_mean_segments(indices, values, [(0, int(indices.shape[0]), 0, size)], axis_name)
    return mean, nbytes


def sparse_mean_segments(
    indices: jnp.ndarray, values: jnp.ndarray, segments: Sequence[tuple[int, int, int, int]], axis_name: AxisName,
    *, maps: Sequence[Callable | None] | None = None, dtypes: Sequence | None = None,
) -> tuple[list[jnp.ndarray], int]:
    """:func:`sparse_mean` scatter-added into several dense buffers, one per segment of the pairs.

    One all-gather of the indices and one of the values, whatever the number
    of segments; then segment ``(lo, hi, base, size)`` scatter-adds every
    worker's pairs ``lo:hi`` at ``index - base`` into a ``(size,)`` buffer.
    Buffers of a few MB each instead of one of every parameter: a large buffer
    is memory the allocator maps afresh at every step (page faults cost more
    than the scatter).

    Args:
      indices: int32 ``(k,)`` flat indices; pairs ``lo:hi`` lie in ``[base, base + size)``.
      values: ``(k,)`` values at those indices, float dtype.
      segments: static ``(lo, hi, base, size)`` tuples of ints.
      axis_name: worker axis, or None.
      maps: one entry per segment, or None: ``map(index - base) -> buffer
        index`` (int32 arrays), indices at or past ``size`` dropped (e.g. the
        pairs that fall in this device's shard of a layer, the others mapped
        past its end); None entries: ``index - base`` as it is.
      dtypes: one dtype per segment, or None: each mean is cast to its dtype
        as soon as it is made, and the next segment's buffer is made after
        that cast (its zero reads one word of it; with ``maps``, among the
        segments with a map only), so that one buffer in
        ``values.dtype`` exists at a time (e.g. float32 sums of layers whose
        gradients are bfloat16; left alone, XLA may make every buffer before
        it casts any).

    Returns:
      ``(means, payload_bytes)``: one dense ``(size,)`` mean over workers per
      segment, in ``values.dtype`` (``dtypes[s]`` when given), and
      ``k * (4 + itemsize)`` bytes.

    Raises:
      ValueError: ``indices`` and ``values`` not 1-D of the same shape, or a
        segment outside ``[0, k]``.

    Examples:
      >>> import jax.numpy as jnp
      >>> means, nbytes = sparse_mean_segments(
      ...     jnp.array([1, 4, 5], jnp.int32), jnp.array([1.0, 2.0, 3.0]), [(0, 1, 0, 3), (1, 3, 3, 3)], None)
      >>> [m.tolist() for m in means], nbytes
      ([[0.0, 1.0, 0.0], [0.0, 2.0, 3.0]], 24)
    """
    indices, values = _tap(axis_name, (indices, values))  # capture() / replay()
    if indices.shape != values.shape or indices.ndim != 1:
        raise ValueError(
            f"indices and values must be 1-D of the same shape, got {indices.shape} and {values.shape}"
        )
    k = int(indices.shape[0])
    for lo, hi, _, _ in segments:
        if not 0 <= lo <= hi <= k:
            raise ValueError(f"segments must lie in [0, {k}] pairs, got {lo}:{hi}")
    nbytes = _nbytes(indices) + _nbytes(values)
    n = num_workers(axis_name)
    if axis_name is not None:  # (n, k): worker by worker
        with _scope("sparse_mean"):
            (indices, values), sent = _gather_workers((indices, values), axis_name)
        nbytes = sent
    else:
        indices, values = indices[None], values[None]
    if n != 1:  # divide the k n pairs, not the dense buffers: no extra pass over them
        values = values / jnp.asarray(n, values.dtype)
    if dtypes is not None and len(dtypes) != len(segments):
        raise ValueError(f"one dtype per segment: {len(segments)} segments, {len(dtypes)} dtypes")
    means, prev = [], None
    for s, (lo, hi, base, size) in enumerate(segments):
        fn = maps[s] if maps is not None else None
        at = (indices[:, lo:hi] - base).reshape(-1)
        tag = indices[0, min(lo, k - 1)]
        # With maps, only the mapped segments wait for each other: their means vary over the same mesh axes
        # (a 0 read from a shard's mean would type an unmapped segment's mean as varying over the fast axis).
        chained = dtypes is not None and (maps is None or fn is not None)
        if chained and prev is not None:  # after the previous mean's cast (a 0 read from it)
            token = ordering.zero_after(prev)
            tag = tag if token is None else tag + token.astype(tag.dtype)
        buf = _zeros(size, values.dtype, tag)
        if fn is None:
            mean = buf.at[at].add(values[:, lo:hi].reshape(-1))
        else:
            mean = buf.at[fn(at)].add(values[:, lo:hi].reshape(-1), mode="drop")
        mean = mean if dtypes is None else mean.astype(dtypes[s])
        prev = mean if chained else prev
        means.append(mean)
    return means, nbytes


def _gather_workers(arrays: Sequence[jnp.ndarray], axis_name: AxisName) -> tuple[list[jnp.ndarray], int]:
    """Every worker's ``arrays`` through all-gathers over ``axis_name``: ``(n, *shape)`` each, and the bytes sent.

    On a two-level step each device of a host sends its ``1/fast`` piece of
    each array and the host's pieces are all-gathered back over the fast axis.
    """
    fast = _host_axis(axis_name)
    auto = _auto_axes(axis_name)
    if auto:  # each device of the worker sends its own part of each array
        done = [_over_parts(lambda p: _all_gather(p, axis_name), a, auto) for a in arrays]
        return [y for y, _ in done], sum(_nbytes(sent) for _, sent in done)
    if fast is None:
        return [_all_gather(a, axis_name) for a in arrays], sum(_nbytes(a) for a in arrays)
    out, nbytes = [], 0
    for a in arrays:
        piece, f = _piece(a, fast)
        nbytes += f * _nbytes(piece)
        out.append(_join(_all_gather(piece, axis_name), a, fast))  # (n, per) -> (n, *a.shape)
    return out, nbytes


def _zeros(size: int, dtype, tag: jnp.ndarray) -> jnp.ndarray:
    """``jnp.zeros((size,), dtype)`` that XLA cannot share with another buffer of the same size.

    XLA merges equal broadcasts of 0 into one buffer and then copies it for
    every scatter that writes into it (one more pass per buffer).  Here the 0
    is computed from ``tag``, a non-negative int32 scalar known only at run time
    (a different one per buffer), so each buffer is a broadcast of its own and
    the scatter writes into it in place.  (The barrier keeps the scalar out of
    the broadcast's loop, which would otherwise recompute it per entry.)
    """
    zero = jax.lax.optimization_barrier((tag < 0).astype(dtype))
    return jnp.broadcast_to(zero, (size,))


def gathered_mean(
    payload: Sequence[jnp.ndarray], decode: Callable[..., list[jnp.ndarray]], axis_name: AxisName,
    *, own: Sequence[jnp.ndarray] = (),
) -> tuple[list[jnp.ndarray], int]:
    """Mean over workers of quantized payloads: all-gather them, decode every worker's, average.

    Packed words and scales cannot be summed on the wire, so every worker's
    payload arrays travel through ``jax.lax.all_gather`` (one collective per
    payload array, e.g. one uint32 word buffer and one float32 scale buffer for
    all layers) and each worker decodes all ``n`` payloads, accumulating in
    float32 one worker at a time (``lax.fori_loop``: memory of one decoded copy).
    Every worker ends with the same mean.

    Args:
      payload: this worker's payload arrays (any shapes/dtypes; empty ones are not sent).
      decode: ``decode(*payload, *own) -> list of arrays``, the decoder of one worker's payload.
      axis_name: worker axis, or None (decode the own payload).
      own: payload arrays that are this device's own part of its host's
        payload (codes of its shards of layers sharded over a two-level
        step's fast axis): each device sends them as they are (no piece of
        them, no join inside the host) and decodes every worker's part of the
        same shards.  Counted ``fast`` times, the host's bytes.

    Returns:
      ``(means, payload_bytes)``: float32 means of the decoded arrays and the
      bytes of the all-gather operands.
    """
    payload = tuple(payload) + tuple(own)
    payload = _tap(axis_name, payload)  # capture() / replay()
    nbytes = sum(_nbytes(p) for p in payload)
    if axis_name is None:
        return [d.astype(jnp.float32) for d in decode(*payload)], nbytes
    n = num_workers(axis_name)
    first_own = len(payload) - len(own)
    sent = [i for i, p in enumerate(payload[:first_own]) if p.size]
    mine = [i for i in range(first_own, len(payload)) if payload[i].size]
    with _scope("gathered_mean"):
        arrays, nbytes = _gather_workers([payload[i] for i in sent], axis_name)
        fast = _host_axis(axis_name)
        for i in mine:
            arrays.append(_all_gather(payload[i], axis_name))
            nbytes += _nbytes(payload[i]) * (int(jax.lax.axis_size(fast)) if fast else 1)
    gathered = dict(zip(sent + mine, arrays))

    def one(w):
        return [
            d.astype(jnp.float32)
            for d in decode(*[gathered[i][w] if i in gathered else p for i, p in enumerate(payload)])
        ]

    # Zeros typed like the decoded values (varying over the axes they vary over
    # under shard_map), so the loop carry keeps one type; the decoder appears
    # once in the program.
    zeros = [_zeros_like_typed(s) for s in jax.eval_shape(lambda: one(0))]
    total = jax.lax.fori_loop(0, n, lambda w, acc: [a + d for a, d in zip(acc, one(w))], zeros)
    return [t / n for t in total], nbytes


def _zeros_like_typed(s: jax.ShapeDtypeStruct) -> jnp.ndarray:
    """Zeros of ``s``'s shape and dtype, varying over the manual axes ``s`` varies over."""
    return vary(jnp.zeros(s.shape, s.dtype), varying_axes(s))


def max_over_workers(x: jnp.ndarray, axis_name: AxisName) -> tuple[jnp.ndarray, int]:
    """Elementwise max over workers with one all-reduce (``pmax``), e.g. TernGrad's shared scalers.

    Returns:
      ``(max, payload_bytes)``: same shape and dtype as ``x``; the operand's bytes
      (:func:`reduce_bytes`).
    """
    (x,) = _tap(axis_name, (x,))  # capture() / replay()
    if axis_name is None:
        return x, _nbytes(x)
    fast = _host_axis(axis_name)
    if fast is not None:
        piece, f = _piece(x, fast)
        with _scope("max"):
            piece = jax.lax.pmax(piece, axis_name)
        return _join(piece, x, fast), f * reduce_bytes(piece)
    auto = _auto_axes(axis_name)
    if auto:
        with _scope("max"):
            total, sent = _over_parts(lambda p: jax.lax.pmax(p, axis_name), x, auto)
        return total, reduce_bytes(sent)
    with _scope("max"):
        return jax.lax.pmax(x, axis_name), reduce_bytes(x)


# --- one worker's payload as arrays of its own: capture and replay ---------------------------------------------


class _Tap(threading.local):
    """This thread's :func:`capture` or :func:`replay` in progress (``mode`` None: neither)."""

    def __init__(self):
        self.mode: str | None = None
        self.arrays: list = []
        self.at = 0


_TAP = _Tap()


def tapping() -> bool:
    """Whether this thread is inside :func:`capture` or :func:`replay` (one worker's message, on purpose alone)."""
    return _TAP.mode is not None


class Captured:
    """What :func:`capture` recorded.

    Attributes:
      arrays: the payload arrays handed to the collectives, in call order (tracers
        when the compressor was traced, e.g. inside ``jax.jit``).
    """

    def __init__(self):
        self.arrays: list = []


@contextlib.contextmanager
def _tapping(mode: str, arrays: list):
    if _TAP.mode is not None:
        raise ValueError(f"{mode}() inside {_TAP.mode}(): one at a time per thread")
    _TAP.mode, _TAP.arrays, _TAP.at = mode, arrays, 0
    try:
        yield
    finally:
        _TAP.mode, _TAP.arrays, _TAP.at = None, [], 0


@contextlib.contextmanager
def capture():
    """Record the payload one worker (``axis_name=None``) hands to this module's collectives.

    Inside ``with capture() as cap:`` every call with ``axis_name=None`` of
    :func:`dense_mean` (so of :func:`dense_mean_arrays`), :func:`sparse_mean_segments`
    (so of :func:`sparse_mean`), :func:`gathered_mean` and :func:`max_over_workers`
    appends the arrays it would send (its operands: ``x``; ``indices, values``;
    ``payload`` then ``own``) to ``cap.arrays`` and goes on unchanged.  A
    compressor's ``update`` traced inside (e.g. in a ``jax.jit``-ed function that
    returns ``cap.arrays``) thus yields its encoded message as arrays: with
    ``axis_name=None`` their bytes are what :func:`compjax.message_bytes` counts
    (the non-finite vote is 0 bytes there).  :func:`replay` decodes them.  Calls
    with a worker axis are not recorded.  The mode is this thread's own; record
    only calls traced at the level the arrays are used (not inside a
    ``lax.cond`` branch or a loop body).

    Yields:
      :class:`Captured`.

    Raises:
      ValueError: a capture or replay is already in progress in this thread.

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.topk(0.5, skip_nonfinite=False)
      >>> g = [jnp.array([1.0, -3.0, 2.0, 0.5])]
      >>> with capture() as cap:
      ...     out, _ = tx.update(g, tx.init(g))
      >>> [(a.dtype.name, a.tolist()) for a in cap.arrays]   # the indices, then the values
      [('int32', [1, 2]), ('float32', [-3.0, 2.0])]
    """
    cap = Captured()
    with _tapping("capture", cap.arrays):
        yield cap


@contextlib.contextmanager
def replay(arrays: Sequence):
    """Decode given payload arrays: the functions of :func:`capture` use them in place of their own operands.

    Inside ``with replay(arrays):`` the same calls (``axis_name=None``) take, in
    order, the next of ``arrays`` instead of the operands they were given, each
    of the operand's shape and dtype, and decode those.  Tracing the compressor's
    ``update`` on any input of the right shapes (zeros, from its ``init`` state)
    inside then returns the decoding of the captured message, as the sender's
    compressor decoded it.

    Args:
      arrays: the payload arrays (NumPy or JAX arrays, or tracers), in the order
        :func:`capture` recorded them.

    Raises:
      ValueError: (inside) an array whose shape or dtype is not the operand's, or
        more operands than arrays; (on leaving without another error) arrays left
        unused; a capture or replay already in progress in this thread.
    """
    given = list(arrays)
    with _tapping("replay", given):
        yield
        if _TAP.at != len(given):
            raise ValueError(f"replay: {len(given)} payload arrays given, {_TAP.at} used")


def _tap(axis_name: AxisName, arrays: tuple) -> tuple:
    """The payload arrays a collective goes on with: its own (recorded under :func:`capture`) or replayed ones."""
    if axis_name is not None or _TAP.mode is None:
        return arrays
    if _TAP.mode == "capture":
        _TAP.arrays.extend(arrays)
        return arrays
    at = _TAP.at
    given = _TAP.arrays[at:at + len(arrays)]
    if len(given) != len(arrays):
        raise ValueError(f"replay: the payload has {len(_TAP.arrays)} arrays, the decoder asks for more")
    for j, (g, a) in enumerate(zip(given, arrays)):
        if tuple(g.shape) != tuple(a.shape) or jnp.dtype(g.dtype) != jnp.dtype(a.dtype):
            raise ValueError(f"replay: payload array {at + j} is {tuple(g.shape)} {jnp.dtype(g.dtype)}, "
                             f"the decoder expects {tuple(a.shape)} {jnp.dtype(a.dtype)}")
    _TAP.at = at + len(arrays)
    return tuple(jnp.asarray(g) for g in given)
