"""What every compressor shares, written once: the optax transformation around an exchange.

A compressor is a function that turns this worker's gradients into their
mean over workers through some wire format (its *exchange*: codec +
collective).  :func:`compressor` wraps an exchange into an
``optax.GradientTransformationExtraArgs`` that behaves like any optax
transformation:

* **Leaves.** Floating-point leaves with at least one element are
  compressed; integer and boolean leaves, ``float0`` gradients (of integer
  parameters) and zero-size leaves pass through untouched.  Every output leaf
  keeps its input's dtype (float32, bfloat16, float16).
* **Error feedback** (optional): ``p = g + e`` before the exchange and
  ``e = p - sent`` after it (:mod:`compjax.compressors.error_feedback`).
* **Non-finite guard** (``skip_nonfinite=True``): each worker checks its
  local gradients; one 4-byte ``pmax`` over the worker axis tells every worker
  whether any worker saw a NaN or an infinity.  If so, all workers skip the
  step together: zero updates, the state (residuals, momenta, Q, keys, the
  step count) untouched, ``skipped`` up by one.  The exchange still runs, on
  finite data (with error feedback ``p = e``, the residual alone; without it,
  zeros), and its outputs are discarded by selects: every worker runs the
  same collectives whatever the vote, and a select fuses into the elementwise
  pass that produces its operand.  (A ``lax.cond`` around the exchange would
  send nothing on a skipped step, but its outputs are buffers of their own:
  on XLA:CPU they are mapped afresh and copied into donated state at every
  step, 2-3x the cost of a donated top-k training step; on GPU a conditional
  may wait for the host to read its predicate.)  A scatter is no elementwise
  pass, so the sparse exchanges (top-k, random-k, DGC) honour the vote
  themselves (``honours_skip``): they send zero values and keep their fields
  in the pass that computes them (without a residual they see the gradients
  as they are), and the guard adds no pass over their dense outputs.  A
  skipped step's ``payload_bytes`` counts that exchange and the vote.
* **Wire typing.** Under ``jax.shard_map`` every output leaf (updates and
  state) is typed varying over the same mesh axes as the corresponding input,
  whichever branch produced it, so the transform composes with ``lax.cond``,
  ``optax.apply_if_finite``, ``optax.MultiSteps`` and friends.
* **Byte counts** are exact at any size (:mod:`compjax.bytecount`).
* **Sharded parameters.** Inside a step whose parameters are sharded over a
  fast mesh axis (:mod:`compjax.layout`, ``specs=`` in :mod:`compjax.parallel`),
  an exchange built with ``on_shards=True`` (every compressor of compjax)
  works on this device's shards (:attr:`Context.shards`), reducing its
  per-layer statistics over the fast axis itself; for any other exchange the
  sharded gradient leaves and per-parameter fields are all-gathered over the
  fast axis (inside the host) before it and each device keeps its own shard
  of the results.  Either way every statistic is the whole layer's, so the
  numbers are those of the replicated layout, and the state stays sharded.

State layout: the compressor's own fields, then ``count`` (int32: updates
applied), ``skipped`` (int32: steps skipped for non-finite gradients) and
``payload_bytes`` (uint32 ``(2,)`` byte count of the last step, read with
:func:`compjax.payload_bytes`; with ``axis_name=None`` nothing is sent and
the count, marked :func:`compjax.bytecount.unsent`, is the size of the
message one worker would send, read with :func:`compjax.message_bytes`).
Per-parameter fields (the residual, DGC's velocity and accumulation) are
trees shaped like the parameters; leaves that pass through hold zeros there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import bytecount, collectives, layout
from compjax._checks import check_same_tree
from compjax.codecs import ordering
from compjax.collectives import AxisName
from compjax.compressors import error_feedback as ef

__all__ = [
    "COMMON_FIELDS",
    "GRADS_SCOPE",
    "Context",
    "Exchanged",
    "any_nonfinite",
    "check_axis",
    "compressor",
    "grads_scope",
    "is_compressible",
    "silenced",
    "update_with_sent",
]

#: The fields every compressor state ends with.
COMMON_FIELDS = ("count", "skipped", "payload_bytes")


class Context(NamedTuple):
    """What an exchange may read besides the leaves and its state fields.

    Attributes:
      count: int32 scalar, updates applied before this one (drives schedules
        and keys).
      axis_name: the worker axis, or None.
      skip: bool scalar, the same on every worker: this step is skipped (some
        worker's gradient was not finite); None without the non-finite guard.
        An exchange built with ``compressor(..., honours_skip=True)`` honours
        it itself (zeros in its payload, its fields kept), cheaper than the
        pipeline's selects over its dense outputs.
      shards: for an exchange built with ``compressor(..., on_shards=True)``
        inside a step with sharded parameters: which leaves (and state fields
        shaped like them) are this device's shards of a layer, along which
        dimension (:class:`compjax.layout.Shards`); None elsewhere (every leaf
        whole).
    """

    count: jnp.ndarray
    axis_name: AxisName
    skip: jnp.ndarray | None = None
    shards: layout.Shards | None = None


class Exchanged(NamedTuple):
    """What an exchange returns.

    Attributes:
      means: the mean over workers of the decoded leaves, one per input leaf
        (any float dtype: cast back to the gradients' dtypes).
      sent: what this worker sent (for error feedback and
        :func:`update_with_sent`): the decoded own payload per leaf, or
        :class:`compjax.compressors.error_feedback.SentAt` (``p`` exactly at
        those entries); None where the exchange cannot tell.
      fields: the compressor's updated state fields (per-parameter fields as
        lists aligned with the leaves); fields left out are kept.
      nbytes: bytes this worker put into collectives: a Python int, or a
        :mod:`compjax.bytecount` uint32 ``(2,)`` count (e.g. chosen by a branch).
    """

    means: list
    sent: Any
    fields: dict
    nbytes: Any


#: ``exchange(leaves, fields, context) -> Exchanged``.
Exchange = Callable[[list, dict, Context], Exchanged]


def is_compressible(x) -> bool:
    """Whether a leaf goes through the exchange: a floating dtype and at least one element."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and int(x.size) > 0


#: The named scope under which a compressor runs, holding the bytes of the gradients it was given.
GRADS_SCOPE = "grads_{}B"


def grads_scope(updates: Any) -> str:
    """``grads_<n>B``: the named scope a compressor's update runs under, ``n`` the bytes of its compressible leaves.

    ``n`` counts the floating-point leaves with at least one element
    (:func:`is_compressible`) as this device holds them.  The compiled
    program keeps the scope in its op names, where
    :func:`compjax.audit_collectives` reads it to tell a dense all-reduce of
    the gradients issued by someone else (a leftover ``lax.pmean`` of a pmap
    program) from a model's small collectives.
    """
    n = sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(updates) if is_compressible(x))
    return GRADS_SCOPE.format(n)


def any_nonfinite(xs: Sequence[jnp.ndarray]) -> jnp.ndarray:
    """Whether any entry of the floating-point arrays ``xs`` is NaN or infinite: a boolean scalar.

    One float32 sum of every entry first: a finite sum proves every entry
    finite (a NaN or an infinity makes the sum NaN or infinite), at the cost of
    one fast reduction.  Only when the sum is not finite -- a non-finite entry,
    or finite entries whose sum overflows -- the exact per-entry check runs
    (``lax.cond``), so the answer is exactly ``not all(isfinite(x))``.

    Args:
      xs: floating-point arrays of any shapes and dtypes (at least one).

    Returns:
      bool scalar.
    """
    total = sum(jnp.sum(x, dtype=jnp.float32) for x in xs)
    return collectives.cond_unified(
        jnp.isfinite(total),
        lambda: jnp.bool_(False),
        lambda: ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])),
    )


def silenced(state: Any) -> Any:
    """``state`` with its ``payload_bytes`` set to 0, for a step in which the compressor was not called.

    Methods that call a compressor only on some steps (in one branch of a
    ``lax.cond``) keep its state in the other branch through this, so that
    :func:`compjax.payload_bytes` counts only what the step really sent.  A
    state without a byte counter is returned unchanged.
    """
    if not hasattr(state, "payload_bytes"):
        return state
    return state._replace(payload_bytes=collectives.like_varying(bytecount.zeros(), state.payload_bytes))


def _pick(tree: Any, sel: Sequence[int]) -> list:
    leaves = jax.tree.leaves(tree)
    return [leaves[i] for i in sel]


def _put(tree: Any, sel: Sequence[int], part: Sequence) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    for i, x in zip(sel, part):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _like(new: Any, old: Any) -> Any:
    """``new`` with the dtype and the varying mesh axes of ``old``, leaf by leaf."""
    return jax.tree.map(lambda n, o: collectives.like_varying(jnp.asarray(n).astype(o.dtype), o), new, old)


def _gather_shard(x: jnp.ndarray, dim: int | None, fast: str) -> jnp.ndarray:
    """The whole layer of which ``x`` is this device's shard along ``dim`` (all-gathered over ``fast``)."""
    return x if dim is None else collectives.gather_inside_host(x, fast, dim)


def _own_shard(x: jnp.ndarray, dim: int | None, fast: str) -> jnp.ndarray:
    """This device's shard along ``dim`` of a whole layer ``x`` (the inverse of :func:`_gather_shard`)."""
    if dim is None:
        return x
    per = x.shape[dim] // int(jax.lax.axis_size(fast))
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(fast).astype(jnp.int32) * per, per, axis=dim)


def _map_dims(fn: Callable, tree: Any, dims: Sequence, fast: str) -> Any:
    """``fn(leaf, dim, fast)`` over the leaves of ``tree``, ``dims`` one per leaf (flatten order)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [fn(x, d, fast) for x, d in zip(leaves, dims)])


def _field_dims(old: dict, trees: Sequence[str], dims: list, init_fields: Callable | None, xs: list,
                shard_xs: list, fast: str) -> dict:
    """The shard dimension of every leaf of the state fields, one flat list per field (None: held whole).

    Per-parameter fields (``trees``) are shaped like the leaves.  Any other
    field's leaf is a shard along the one dimension in which ``init_fields``
    builds it ``fast`` times larger for the whole layers than for the shards
    (``compjax.layout.scaled_dims``: delayed averaging's history, PowerSGD's
    ``Q`` when the sharded dimension is among its rows), the rule
    :func:`compjax.parallel.state_specs` lays the state out by.
    """
    out = {name: list(dims) for name in trees if old[name] is not None}
    plain = [f for f in old if f not in out and jax.tree.leaves(old[f])]
    if plain and init_fields is not None:
        def fields_of(leaves):
            made = init_fields(list(leaves))
            return tuple(made[f] for f in plain)

        flat = layout.scaled_dims(fields_of, xs, shard_xs, int(jax.lax.axis_size(fast)))
        at = 0
        for f in plain:
            n = len(jax.tree.leaves(old[f]))
            out[f] = flat[at: at + n]
            at += n
    return out


def _bound_axes() -> tuple:
    """Names of the worker axes bound where this is traced (``shard_map``/``pmap`` mesh axes, ``vmap`` names)."""
    try:  # every binding (vmap included); private, so read defensively
        from jax._src import core

        return tuple(core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):  # pragma: no cover - the public view: manual mesh axes only
        return tuple(jax.sharding.get_abstract_mesh().axis_names)


def check_axis(axis_name: AxisName, leaves: Sequence[Any], who: str) -> None:
    """Refuse, at trace time, a worker axis that would silently send nothing or fail deep in ``jax.lax``.

    Two mistakes are caught before any collective is traced:

    * ``axis_name=None`` while the gradients vary over a manual mesh axis
      (inside ``jax.shard_map`` over workers): each worker would apply its own
      gradients and no byte would move, while a byte count is still reported.
    * an ``axis_name`` that no enclosing ``shard_map``/``pmap``/``vmap``
      binds (e.g. ``"batch"`` on a ``"data"`` mesh), which ``jax.lax`` reports
      as a bare ``AssertionError`` or ``NameError``.
    * gradients already averaged over the worker axis: inside
      ``jax.shard_map`` (with its varying-axes checks, the default) every
      floating-point leaf is typed invariant over ``axis_name`` -- a
      leftover ``lax.pmean(grads, axis)`` of a pmap program, or gradients of
      replicated parameters, which JAX all-reduces by itself.  The dense
      all-reduce has already sent them; compressing their mean would send
      again and change nothing.  (Under ``pmap`` and ``vmap`` no type says
      it: :func:`compjax.audit_collectives` flags such an all-reduce.)

    Args:
      axis_name: the transform's worker axis (a name, a tuple of names, or None).
      leaves: the gradient leaves the transform received.
      who: the transform, as users call it (e.g. ``"cj.topk"``).

    Raises:
      ValueError: naming ``who``, its ``axis_name``, the axes bound here (or the axis
        the gradients were already averaged over) and the fix.
    """
    bound = _bound_axes()
    if axis_name is None:
        varying = set()
        for x in leaves:
            varying |= collectives.varying_axes(x)
        if varying:
            axes = tuple(sorted(varying, key=str))
            raise ValueError(
                f"{who} has axis_name=None, but its gradients vary over the mesh axes {axes} of this shard_map: "
                f"every worker would keep its own gradients and nothing would be sent. Build it with "
                f"axis_name={axes[0]!r} (the axis the workers are laid out over)"
            )
        warn_if_spread(leaves, who)
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = [n for n in names if n not in bound]
    if missing:
        where = (f"the axes bound here are {bound}" if bound else
                 "no worker axis is bound here (called outside shard_map, pmap or vmap with an axis_name)")
        fix = (f"build it with axis_name={bound[0]!r}" if len(bound) == 1 else
               f"build it with one of {bound}" if bound else
               "call it inside the data-parallel step, or build it with axis_name=None for one worker")
        raise ValueError(f"{who} has axis_name={axis_name!r}, which is not an axis of this step: {where}; {fix}")
    if leaves:
        averaged = [n for n in names if collectives.typed_axis(n)
                    and not any(n in collectives.varying_axes(x) for x in leaves)]
        if averaged:
            raise ValueError(
                f"{who} (axis_name={axis_name!r}) was given gradients that are already invariant over the worker "
                f"axis {averaged[0]!r}: every floating-point leaf is typed as the same on every worker, so a psum or "
                f"pmean over {averaged[0]!r} (a leftover `grads = jax.lax.pmean(grads, {averaged[0]!r})` from a pmap "
                f"program, or gradients taken with respect to replicated parameters, which JAX all-reduces itself) "
                f"already sent them densely, and the compressor would compress a mean. Remove the user's pmean/psum "
                f"of the gradients (compjax averages them) and take the gradients of each worker's own copy of the "
                f"parameters (compjax.parallel's step builders do). Flax's DynamicScale(axis_name=...) pmeans the "
                f"gradients itself: build it without axis_name (DynamicScale() scales and checks each worker's own "
                f"gradients; the compressor averages them and its non-finite vote makes every worker skip together)"
            )


def warn_if_spread(leaves: Sequence[Any], who: str) -> None:
    """Warn, at trace time, when a compressor without a worker axis is given gradients spread over several devices.

    ``optax.chain(cj.topk(0.01), ...)`` (``axis_name=None``) inside a plain
    ``jax.jit`` step whose arguments are sharded over a mesh of several
    devices (``jax.device_put(x, NamedSharding(mesh, P("data")))``): XLA
    averages the gradients densely by itself, and the compressor compresses
    that mean; no byte crosses any wire through compjax.  The signal is the
    abstract mesh of the traced gradients (``jax.typeof(g).sharding.mesh``):
    more than one device over axes that are not manual (``Auto`` or
    ``Explicit``).  A one-device program (no mesh, or a mesh of one device),
    the body of a ``shard_map`` (manual axes) and :func:`compjax.collectives.capture`
    (a learner encoding its message alone) do not warn.

    Args:
      leaves: the floating-point gradient leaves the compressor received (tracers or arrays).
      who: the compressor, as users call it (e.g. ``"cj.topk"``).
    """
    if collectives.tapping():  # capture/replay: one learner's message, encoded on purpose
        return
    for x in leaves:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is None or not getattr(mesh, "axis_names", ()):
            continue
        types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
        spread = [a for a in mesh.axis_names
                  if mesh.shape[a] > 1 and types.get(a) != jax.sharding.AxisType.Manual]
        if spread:
            warnings.warn(
                f"{who} has axis_name=None, but its gradients are traced over a mesh of {mesh.size} devices "
                f"(axes {dict(mesh.shape)}): nothing is exchanged between workers through the compressor. In a "
                f"jit step over sharded arguments XLA averages the gradients densely by itself and {who} only "
                f"compresses that mean, so no byte is saved. Run the step with compjax.parallel "
                f"(data_parallel_step, worker_step) and build it with axis_name={spread[0]!r}",
                UserWarning, stacklevel=2)
            return


def _who(state_cls: type) -> str:
    """The factory a state type belongs to, as users call it (``TopkState`` -> ``cj.topk``)."""
    name = state_cls.__name__.removesuffix("State")
    return "cj." + {"DelayedAveraging": "delayed_averaging"}.get(name, name.lower())


def compressor(
    state_cls: type,
    exchange: Exchange,
    *,
    axis_name: AxisName,
    skip_nonfinite: bool = True,
    error_feedback: bool = False,
    init_fields: Callable[[list], dict] | None = None,
    tree_fields: Sequence[str] = (),
    honours_skip: bool = False,
    on_shards: bool = False,
    any_cut: bool = False,
    materialize: bool = False,
    residual_in_exchange: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Build a compressor's optax transformation from its exchange.

    Args:
      state_cls: the state NamedTuple; its fields are the compressor's own
        (``"residual"`` among them when it has error feedback), then
        :data:`COMMON_FIELDS`.
      exchange: ``exchange(leaves, fields, context) -> Exchanged`` over the
        compressible leaves (with error feedback: ``p = g + e``); ``fields``
        holds the state's own fields, per-parameter ones as lists aligned with
        the leaves.
      axis_name: worker axis, or None for one worker.
      skip_nonfinite: the non-finite guard (see the module docstring).
      error_feedback: keep ``residual = p - sent``.  With False, a
        ``residual`` field holds None.
      init_fields: ``init_fields(param_leaves) -> dict`` of the own fields'
        initial values (per-parameter fields as lists); new buffers on every
        call (no two state leaves may share one: states are donated).
      tree_fields: names of per-parameter fields besides ``"residual"``.
      honours_skip: the exchange honours :attr:`Context.skip`: on a skipped
        step its means are zeros and its fields the old values whatever the
        leaves hold (non-finite entries included), e.g. a sparse exchange that
        sends zero values.  The pipeline then adds no select over its dense
        outputs and fields, and without error feedback hands it the gradients
        as they are; a :class:`~compjax.compressors.error_feedback.SentAt` is
        still moved past the end (the residual keeps ``p = e``).
      on_shards: the exchange works on shards: under sharded parameters it
        receives this device's shards of the leaves and of the per-parameter
        fields as they are (nothing is gathered), learns which are shards from
        :attr:`Context.shards`, reduces its per-layer statistics over the fast
        axis itself and returns this device's shards of the means and fields
        (a :class:`~compjax.compressors.error_feedback.SentAt` holds indices
        into the shards).  Its other state fields must be held whole by every
        fast device.  Without it the pipeline gathers whole layers.
      any_cut: with ``on_shards``, the exchange works on shards cut any way:
        it reads of :attr:`Context.shards` only which leaves are shards (and
        :meth:`~compjax.layout.Shards.own`, :meth:`~compjax.layout.Shards.whole_shape`
        or ``collectives.gather_inside_host`` with their entry), its per-layer
        statistics are sums or maxima over the host (an elementwise codec:
        a dense mean, a cast, signs, 2-bit codes, E3M0).  A sharded step on
        several fast axes then lets the optimizer work on leaves in the
        layout the model annotates (a :class:`compjax.layout.Cut` entry), with
        no re-layout (:func:`compjax.compressors.chains.works_on_any_cut`).
        Without it (flat indices, columns, tiles, random draws per entry) each
        shard is cut along one dimension.
      materialize: with error feedback, write ``p = g + e`` to memory once
        (:func:`compjax.codecs.ordering.settled`) before the exchange reads it: for exchanges
        that read ``p`` in many passes (a sparse selection), which XLA would
        otherwise each recompute from ``g`` and ``e``, keeping the gradient
        alive beside ``p`` (a whole model's gradients twice).  Values are
        unchanged.
      residual_in_exchange: error feedback kept by the exchange itself (with
        ``error_feedback=False``): the pipeline builds the ``residual`` field
        (zeros like the parameters) and hands it over in ``fields``; the
        exchange receives the gradients as they are, forms ``p = g + e`` and
        ``e = p - sent`` with :mod:`compjax.compressors.error_feedback`'s
        functions where it chooses (e.g. in place, one layer at a time) and
        returns the new ``residual`` among its fields.

    Returns:
      ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
      params=None)`` returns ``(means, new_state)``.

    Raises:
      ValueError: at trace time, a gradient tree whose structure or shapes do
        not match the per-parameter fields built by ``init``; an
        ``axis_name`` no enclosing ``shard_map``/``pmap``/``vmap`` binds, or
        None while the gradients vary over a mesh axis (:func:`check_axis`).
    """
    own = tuple(f for f in state_cls._fields if f not in COMMON_FIELDS)
    if state_cls._fields[len(own):] != COMMON_FIELDS:
        raise TypeError(f"{state_cls.__name__} must end with the fields {COMMON_FIELDS}")
    if residual_in_exchange and (error_feedback or "residual" not in own):
        raise TypeError("residual_in_exchange needs error_feedback=False (the exchange keeps it) and a 'residual' "
                        f"field in {state_cls.__name__}")
    if any_cut and not on_shards:
        raise TypeError("any_cut=True needs on_shards=True: it says how the shards an exchange works on may be cut")
    trees = (("residual",) if "residual" in own else ()) + tuple(tree_fields)

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        leaves = [jnp.asarray(x) for x in leaves]
        sel = [i for i, x in enumerate(leaves) if is_compressible(x)]
        xs = [leaves[i] for i in sel]
        fields = dict(init_fields(xs)) if init_fields is not None else {}
        if "residual" in own:
            fields["residual"] = [jnp.zeros_like(x) for x in xs] if error_feedback or residual_in_exchange else None
        for name in trees:
            if fields[name] is not None:  # pass-through leaves hold (new) zeros
                fields[name] = _put(jax.tree.unflatten(treedef, [jnp.zeros_like(x) for x in leaves]), sel,
                                    fields[name])
        return state_cls(
            **fields, count=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32),
            payload_bytes=bytecount.zeros(),
        )

    who = _who(state_cls)

    def update_fn(updates, state, params=None, **extra_args):
        # The audit's op names then say whose collective it is and how large the gradients it was given are
        # (.../cj.topk/grads_4096B/compjax/...): compjax.audit_collectives flags a dense all-reduce of that size
        # that compjax did not issue (a leftover pmean of the gradients).
        with jax.named_scope(who), jax.named_scope(grads_scope(updates)):
            return _update(updates, state)[:2]

    def with_sent_fn(updates, state):
        with jax.named_scope(who), jax.named_scope(grads_scope(updates)):
            return _update(updates, state, with_sent=True)

    def _update(updates, state, with_sent=False):
        leaves, treedef = jax.tree.flatten(updates)
        sel = [i for i, g in enumerate(leaves) if is_compressible(g)]
        xs = [leaves[i] for i in sel]
        check_axis(axis_name, xs, who)
        old = {f: getattr(state, f) for f in own}
        for name in trees:
            if old[name] is not None:
                check_same_tree(updates, old[name], name)
                old[name] = _pick(old[name], sel)
                bad_ref = [i for i, r in zip(sel, old[name]) if not jnp.issubdtype(r.dtype, jnp.floating)]
                if bad_ref:
                    raise ValueError(
                        f"gradient leaves {bad_ref} are floating point but the {name} built by init holds "
                        "integer leaves there: was the state built for other parameters?"
                    )
        dims = layout.shard_dims_for(updates, who)
        split = None
        if dims is not None and on_shards:  # the exchange works on the shards: nothing gathered
            split, dims = layout.Shards(layout.current().axis, tuple(dims[i] for i in sel)), None
        if dims is not None:  # sharded parameters: whole layers in, this device's shards out (at the end)
            fast, dims = layout.current().axis, [dims[i] for i in sel]
            shard_xs = xs
            xs = [_gather_shard(x, d, fast) for x, d in zip(xs, dims)]
            fdims = _field_dims(old, trees, dims, init_fields, xs, shard_xs, fast)
            shards = {name: old[name] for name in fdims}
            old = {**old, **{name: _map_dims(_gather_shard, old[name], fd, fast) for name, fd in fdims.items()}}
        if not xs:  # nothing to send
            nbytes, new = 0, old
            outs, count, skipped, decoded = [], state.count + 1, state.skipped, []
        else:
            count, skipped = state.count + 1, state.skipped
            bad = None
            if skip_nonfinite:
                local_bad = any_nonfinite(xs)
                bad, flag_bytes = collectives.any_over_workers(local_bad, axis_name)
            ctx = Context(state.count, axis_name, bad, split)
            if error_feedback:
                ps = ef.accumulate(old["residual"], xs)
                if bad is not None:  # a skipped step exchanges the (finite) residual alone, in the same pass
                    ps = [jnp.where(bad, e, p) for p, e in zip(ps, old["residual"])]
                if materialize:
                    # XLA fuses p = g + e into every pass that reads it and recomputes it there, keeping its
                    # inputs alive until the last: written once, in place of the gradient where it dies.
                    ps = ordering.settled(list(ps), state.count)
            elif bad is None or honours_skip:
                ps = list(xs)
            else:
                ps = [jnp.where(bad, jnp.zeros_like(x), x) for x in xs]
            if dims is not None:  # whole layers from here on: a compressor nested in this one gathers nothing
                with layout.fast_layout(fast):
                    out = exchange(ps, old, ctx)
            elif split is not None:  # the exchange's leaves, this device's shards
                with layout.for_leaves(ps, split.dims):
                    out = exchange(ps, old, ctx)
            else:
                out = exchange(ps, old, ctx)
            outs = [m.astype(x.dtype) for m, x in zip(out.means, xs)]
            nbytes = bytecount.constant(out.nbytes) if isinstance(out.nbytes, int) else out.nbytes
            changed = {f: _like(v, old[f]) for f, v in out.fields.items()}
            sent = out.sent
            if bad is not None:
                # Selects, no branch: they fuse into the passes that produce or consume each array (a
                # lax.cond's outputs are buffers of their own, which XLA:CPU maps afresh at every step
                # and copies into donated state).  The residual keeps p = e: nothing sent leaves it.  An
                # exchange that honoured ctx.skip itself (zeros in a sparse payload) needs no dense select.
                if not honours_skip:
                    outs = [jnp.where(bad, jnp.zeros_like(o), o) for o in outs]
                    changed = {f: jax.tree.map(lambda n, o: jnp.where(bad, o, n), v, old[f])
                               for f, v in changed.items()}
                if isinstance(sent, ef.SentAt):  # indices past the end: the residual's scatter drops them
                    sent = ef.SentAt([jnp.where(bad, x.size, i) for i, x in zip(sent.indices, xs)])
                elif sent is not None and (error_feedback or with_sent):  # else nothing reads it: no select
                    sent = [jnp.where(bad, jnp.zeros_like(d), d) for d in sent]
                count = jnp.where(bad, state.count, count)
                skipped = skipped + bad.astype(jnp.int32)
                nbytes = bytecount.add(nbytes, flag_bytes)
            new = {**old, **changed}
            if error_feedback:
                new["residual"] = ef.remainder(ps, sent)
            decoded = _decoded_sent(ps, sent, who) if with_sent else None
            outs = [collectives.like_varying(o, x) for o, x in zip(outs, xs)]
            new = _like(new, old)
        if dims is not None:
            outs = [collectives.like_varying(_own_shard(o, d, fast), x) for o, d, x in zip(outs, dims, shard_xs)]
            for name, fd in fdims.items():
                new[name] = _like(_map_dims(_own_shard, new[name], fd, fast), shards[name])
        nbytes = bytecount.constant(nbytes) if isinstance(nbytes, int) else nbytes
        if axis_name is None:  # no worker axis: nothing crossed any wire; the count is the message's size only
            nbytes = bytecount.unsent(nbytes)
        fields = dict(new)
        for name in trees:
            if fields[name] is not None:
                fields[name] = _put(getattr(state, name), sel, fields[name])
        new_state = state_cls(
            **fields,
            count=_like(count, state.count),
            skipped=_like(skipped, state.skipped),
            payload_bytes=_like(nbytes, state.payload_bytes),
        )
        means = jax.tree.unflatten(treedef, _put(leaves, sel, outs))
        if not with_sent:
            return means, new_state, None
        if dims is not None:
            decoded = [_own_shard(o, d, fast) for o, d in zip(decoded, dims)]
        decoded = [collectives.like_varying(o.astype(x.dtype), x) for o, x in zip(decoded, _pick(updates, sel))]
        return means, new_state, jax.tree.unflatten(treedef, _put(leaves, sel, decoded))

    update_fn.with_sent = with_sent_fn  # read by update_with_sent
    update_fn.any_cut = any_cut  # read by chains.works_on_any_cut
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _decoded_sent(ps: Sequence[jnp.ndarray], sent: Any, who: str) -> list:
    """What an exchange reports as sent, as one dense array per leaf (:class:`~.error_feedback.SentAt`: ``p`` there, 0 elsewhere)."""
    if sent is None:
        raise ValueError(f"{who} does not report what it sent (its exchange gives sent=None: the decoded payload "
                         "needs the other workers' data, or the compressor does not say), so update_with_sent cannot "
                         "return it")
    if isinstance(sent, ef.SentAt):  # indices past the end (a skipped step) mark nothing
        marks = [jnp.zeros(p.size, jnp.bool_).at[i].set(True, mode="drop").reshape(p.shape) for p, i in zip(ps, sent.indices)]
        return [jnp.where(m, p, jnp.zeros_like(p)) for p, m in zip(ps, marks)]
    return list(sent)


def update_with_sent(tx: optax.GradientTransformation, updates: Any, state: Any) -> tuple[Any, Any, Any]:
    """``tx.update(updates, state)`` that also returns what this worker sent, as the receivers decode it.

    One exchange (the same collectives, bytes and new state as ``tx.update``)
    and, per worker, its own decoded message ``D(C(p))``: the payload that
    error feedback subtracts (``e = p - D(C(p))``, with ``p = g + e`` when
    the compressor has error feedback, else ``p = g``).  The mean over
    workers of these is the returned mean for the compressors whose payload
    each worker decodes alone (top-k and random-k: ``p`` at the sent entries,
    random-k without error feedback scaled by ``d / k``; the quantizers and
    casts: the dequantized values).  PowerSGD reports the rank-``r``
    approximation built from the averaged factors.  On a step skipped by the
    non-finite guard it is zeros.  Federated uplinks use it to tell each client
    what the server received from it.

    Args:
      tx: a compjax compressor (built on :func:`compressor`; not wrapped in another transformation).
      updates: this worker's gradients (a pytree), as for ``tx.update``.
      state: ``tx``'s state.

    Returns:
      ``(means, new_state, sent)``: ``means`` and ``new_state`` as ``tx.update``
      returns them; ``sent`` a pytree like ``updates`` (same shapes, dtypes and
      varying mesh axes): the decoded own payload of every compressed leaf, and
      the leaf itself where a leaf passes through (integer, boolean, empty).
      Under sharded parameters, this device's shard of it.

    Raises:
      ValueError: ``tx`` is not a compjax compressor, or its exchange does not
        report what it sent (TernGrad, DGC, SparseLoCo's chunk top-k: their
        decoding needs the other workers' data or keeps its own memory).

    References:
      Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and
      other Gradient Compression Schemes", ICML 2019 (Alg. 2: ``e = p - C(p)``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import compjax as cj
      >>> from compjax.compressors.base import update_with_sent
      >>> tx = cj.topk(0.5, error_feedback=False, axis_name="w")
      >>> g = jnp.array([[1.0, -3.0, 2.0, 0.5], [4.0, 0.0, -1.0, 0.0]])   # two workers
      >>> state = jax.vmap(tx.init)(g)
      >>> mean, _, sent = jax.vmap(lambda x, s: update_with_sent(tx, x, s), axis_name="w")(g, state)
      >>> sent.tolist()
      [[0.0, -3.0, 2.0, 0.0], [4.0, 0.0, -1.0, 0.0]]
      >>> mean[0].tolist()
      [2.0, -1.5, 0.5, 0.0]
    """
    with_sent = getattr(getattr(tx, "update", None), "with_sent", None)
    if with_sent is None:
        raise ValueError(f"tx must be a compjax compressor (built on compjax.compressors.base.compressor, not wrapped "
                         f"in another transformation), got {tx!r}")
    return with_sent(updates, state)
