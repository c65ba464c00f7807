"""The pytree step builder: :func:`data_parallel_step` for ``loss_fn(params, batch)`` and an optax ``tx``.

Three layouts, one step core (:func:`compjax.parallel.core.build_step`): a 1-D
worker mesh; a 2-D mesh with every device a worker (``fast_axis=``, gradients
averaged densely over the fast axis before the compressor); and sharded
parameters (``specs=``, FSDP, :func:`compjax.parallel.core.build_sharded_step`:
the loss runs on each worker's logical arrays and XLA gathers each parameter
over the fast axis where it is used, one layer at a time for blocks under
``jax.lax.scan``, and reduces its gradient back to shards; the compressors
work on the shards through :mod:`compjax.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from compjax import collectives, layout
from compjax.compressors import clip
from compjax.compressors.applying import apply_gradients
from compjax.compressors.chains import works_on_any_cut
from compjax.parallel.core import (
    build_sharded_step,
    build_step,
    check_flags,
    keyed,
    on_shards,
    per_device_value_and_grad,
    per_tree,
    warn_no_exchange,
)
from compjax.parallel.mesh import check_axis, check_fast_axes, worker_axes
from compjax.parallel.placement import (
    SEVERAL_AXES_HINT,
    Padded,
    as_spec,
    check_stored,
    checked_leaf_specs,
    is_padded_array,
    mark_padded,
    named_fast_axes,
    pad_leaves,
    shard_dims,
    shard_view,
    stacked_spec,
    state_specs,
    unpad_leaves,
)
from compjax.parallel.precision import floating_dtype


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
    independent: bool = False,
    compute_dtype: Any = None,
) -> Callable[..., tuple]:
    """Build a jitted data-parallel train step under ``jax.shard_map``.

    Each worker computes ``loss_fn(params, local_batch)`` and its gradient with
    respect to its own copy of the parameters, passes the local gradients to
    ``tx`` (whose compressor averages them over ``axis_name``) and applies the
    updates.

    On a 2-D mesh (``fast_axis`` given, :func:`make_2d_mesh`), the local
    gradients are first averaged densely over the fast axis (bucketed float
    all-reduces inside each host, ``collectives.dense_mean_arrays``), and
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
    holds a shard.  ``loss_fn`` and its gradient run on each worker's logical
    parameters, which stay sharded over the fast axis: XLA's SPMD partitioner
    gathers each parameter inside the host where the loss uses it (for blocks
    under ``jax.lax.scan`` over stacked layer parameters, one layer at a time
    inside the loop; never the whole model up front) and reduces its gradient
    back to the device's shard.  The worker's batch is cut into one chunk per
    fast device (the rows that device holds) and ``loss_fn`` runs on each chunk
    under ``jax.vmap`` (with ``rng``, on the key that device folds): the
    gradient is that of the chunks' mean loss, the host's mean gradient as in
    the replicated layout.  ``tx`` then updates each device's shard (a
    ``shard_map`` over the fast axis); its compressors work on the shards and
    see whole layers through :mod:`compjax.layout`, so the numbers equal the
    replicated 2-D layout's (to rounding).  The collectives inside the host that
    XLA inserts for the loss read ``compjax-uncounted`` in
    :func:`compjax.audit_collectives` (they carry no payload); ``loss_fn``
    cannot itself issue collectives over the fast axis.

    With ``compute_dtype`` (mixed precision, e.g. ``jnp.bfloat16``), the
    parameters stay in their own dtype (the float32 master copy, updated by
    ``tx`` with float32 optimizer and error-feedback state) and the step casts
    every floating-point parameter leaf to ``compute_dtype`` before
    ``loss_fn`` sees it, differentiating with respect to that copy: the loss
    runs in ``compute_dtype`` and the gradient comes out in it (half the
    bytes of a float32 gradient for bfloat16; with ``specs``, the gathers
    inside the host carry ``compute_dtype`` too).  Each gradient leaf is cast
    back to its parameter's dtype where ``tx`` takes it (inside the update,
    on each device's shards with ``specs``), so the compressor and the
    optimizer see gradients of the parameters' dtype: what goes on the wire
    is whatever the compressor makes of them (its payload dtype:
    ``cj.cast(jnp.bfloat16)`` for a bfloat16 dense mean), as
    :func:`compjax.audit_collectives` shows.  On a 2-D mesh without ``specs``,
    the fast-axis mean runs in ``compute_dtype`` before the cast.  Integer
    leaves are passed as they are.  ``compute_dtype`` casts the whole tree
    before the loss: with ``specs``, that is a ``compute_dtype`` copy of every
    parameter shard.  A large model casts where each parameter is used
    instead, with :func:`compjax.parallel.compute_cast` inside its loss (one
    layer's parameters inside ``jax.lax.scan``) and ``compute_dtype=None``:
    the gradients then reach ``tx`` in the compute dtype, uncast (half the
    gradient's bytes for bfloat16; a compressor's error feedback keeps its
    own float32 residual, ``cj.identity`` sends them in bfloat16).

    A step of one's own (a Flax ``TrainState``, mutable collections, metrics)
    is :func:`worker_step` over it.

    Args:
      loss_fn: ``(params, batch) -> scalar loss`` for one worker's batch;
        ``-> (loss, aux)`` with ``has_aux``; ``(params, batch, key)`` with ``rng``.
      tx: an optax transformation whose compressor uses ``axis_name``.
      mesh: mesh with axis ``axis_name`` (n workers), or a 2-D mesh.
      axis_name: the data axis (the slow axis of a 2-D mesh).
      fast_axis: the fast axis of a 2-D mesh, averaged densely; None for a 1-D
        mesh (with ``specs``: the axis they name; specs over several axes
        take None).
      specs: None, or a tree like the parameters (without the worker axis) of
        ``PartitionSpec`` over one fast axis (:func:`fsdp_specs`), or
        :class:`~compjax.parallel.Padded` for a leaf stored padded: the loss
        and ``tx`` see its logical shape (held whole inside the step).  Or
        specs over several fast axes, as a model annotates them on a
        ``(data, fsdp, tensor)`` mesh (``P('fsdp', 'tensor')``: two
        dimensions over two axes; ``P(('fsdp', 'tensor'))``: one dimension
        over both; no :class:`~compjax.parallel.Padded` entry): a host is
        then those axes' devices together (the batch cut into one chunk per
        device, the chunks held whole by the host's devices: XLA:CPU's
        partitioner aborts on an embedding lookup of ids split over them),
        parameters and state keep the layout the specs give them, and ``tx``
        sees the leaves as :func:`compjax.parallel.placement.shard_view` gives
        them, its compressor reducing its per-layer statistics over every fast
        axis: when every compressor in ``tx`` works on shards cut any way
        (:func:`compjax.compressors.chains.works_on_any_cut`: ``cj.identity``,
        the casts, EF-signSGD, 2-bit, E3M0, and ``cj.diloco`` around them),
        each leaf sharded over every fast axis as the specs lay it out, with
        no re-layout; otherwise (flat indices, columns, tiles, draws per
        entry) each sharded leaf cut along one dimension over all the fast
        axes, which XLA re-lays out inside the host where ``tx`` takes it and
        gives it back (a copy of every such parameter each way and of its
        gradient, every step; 8B dense AdamW on ``2 x 2 x 2``: 6.5 GiB of
        temporaries per device with the view, 5.4 GiB without).  An
        optimizer state laid out as ``tx`` sees the parameters
        (``init_worker_state(tx, params, mesh, specs=view)`` with ``view``
        the specs ``shard_view`` gives) is kept so: otherwise the whole state
        is re-laid out in and out of every step too (8B dense AdamW with the
        one-dimensional view: 21.0 GiB of temporaries instead of 6.5).  The
        mesh's axes must then be ``Auto``
        (``jax.make_mesh(..., axis_types=(AxisType.Auto,) * 3)``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns each
        worker's ``aux`` too (e.g. logits or an accuracy).
      rng: the step takes a PRNG key (typed or raw, one for all workers) and
        passes ``loss_fn`` this worker's ``jax.random.fold_in(key, i)``
        (``i`` the worker index over all worker axes): different draws on
        every worker, the same on every run.
      donate: donate the params and state buffers to the step.  With
        ``specs``, the step then updates them in place: it carries each
        worker-stacked leaf merged into its first dimension
        (:class:`compjax.parallel.core.MergedStep`), so ``step.lower(...)``
        lowers a program over the merged leaves (for
        ``compile().memory_analysis()`` and :func:`compjax.audit_collectives`);
        run the step itself, which merges and splits back around it.
      independent: the workers are meant to train apart (local SGD, an
        ensemble): no warning when ``tx`` holds no compjax compressor or
        algorithm.
      compute_dtype: None (the default: the loss sees the parameters as they
        are and its gradients reach ``tx`` in the dtype differentiation gives
        them), or a floating-point dtype (``jnp.bfloat16``, ``jnp.float16``)
        the loss and its gradient run in, the parameters and ``tx``'s state
        kept in their own dtype (see above).

    Returns:
      ``step(params, opt_state, batch[, key]) -> (params, opt_state, loss[, aux])``;
      params and opt_state worker-stacked (:func:`replicate`,
      :func:`init_worker_state`), batch sharded along its leading axis
      (:func:`shard_batch`), loss of shape ``(n,)`` (each worker's local loss;
      ``n = slow x fast`` on a 2-D mesh), aux each worker's with a leading
      axis of n.

    Raises:
      ValueError: when built, ``axis_name`` or ``fast_axis`` not an axis of ``mesh``,
        or a flag (``has_aux``, ``rng``, ``donate``) not a bool, or
        ``compute_dtype`` neither None nor a floating-point dtype, or with
        ``specs`` a ``tx`` holding a transform that reduces over whole layers
        (``optax.clip_by_global_norm``: use :func:`compjax.clip_by_global_norm`;
        :func:`compjax.compressors.clip.check_sharded_chain`); at the first
        call, ``specs`` that do not fit the parameters (named by leaf).

    Warns:
      UserWarning: when built, a norm-based optax transform before the
        compressor, which sees each worker's local gradient
        (:func:`compjax.compressors.clip.warn_local_norms`); ``tx`` holding no
        compjax compressor or algorithm (nothing would cross the worker axis:
        each worker would train its own model) unless ``independent``.
    """
    check_axis(mesh, axis_name)
    check_flags(has_aux=has_aux, rng=rng, donate=donate, independent=independent)
    if fast_axis is not None:
        check_axis(mesh, fast_axis)
    compute_dtype = _check_compute_dtype(compute_dtype)
    if not independent:
        warn_no_exchange(tx, "data_parallel_step", axis_name)
    clip.warn_local_norms(tx)
    if specs is not None:
        clip.check_sharded_chain(tx)
        return _sharded_step(loss_fn, tx, mesh, axis_name, fast_axis, specs, has_aux, rng, donate, compute_dtype)
    axes = worker_axes(mesh, axis_name, fast_axis)[1]

    def body(params, opt_state, batch, *key):  # one worker's values, its key folded (build_step)
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(to_compute(params, compute_dtype), batch, *key)
        loss, aux = out if has_aux else (out, None)
        if fast_axis is not None:
            grads = like_params(_fast_mean(grads, fast_axis), params, compute_dtype)
            with layout.fast_layout(fast_axis):  # one host's devices share the slow-axis payload
                params, opt_state = apply_gradients(tx, grads, opt_state, params)
        else:
            params, opt_state = apply_gradients(tx, like_params(grads, params, compute_dtype), opt_state, params)
        return (params, opt_state, loss) + ((aux,) if has_aux else ())

    # Every output placed P(axes), as replicate() and shard_batch() place: the second call hits the cache.
    jitted = build_step(body, mesh, axes, "ssbk" if rng else "ssb", donate=donate)
    return keyed(jitted, mesh) if rng else jitted


def _check_compute_dtype(compute_dtype: Any) -> Any:
    """``compute_dtype`` as a ``jnp.dtype`` (or None); a ValueError naming it when it is not a floating-point dtype."""
    return floating_dtype(compute_dtype, "compute_dtype", none_ok=True)


def to_compute(params: Any, compute_dtype: Any) -> Any:
    """The floating-point leaves of ``params`` cast to ``compute_dtype`` (None: ``params`` as they are)."""
    if compute_dtype is None:
        return params
    return jax.tree.map(lambda p: p.astype(compute_dtype) if jnp.issubdtype(jnp.result_type(p), jnp.floating)
                        else p, params)


def like_params(grads: Any, params: Any, compute_dtype: Any) -> Any:
    """With ``compute_dtype``, each gradient leaf in its parameter's dtype (a no-op where they agree).

    Without it, the gradients are left as the loss's differentiation gives
    them: a loss using :func:`compjax.parallel.compute_cast` hands bfloat16
    gradients of float32 parameters to the optimizer on purpose.
    """
    if compute_dtype is None:
        return grads
    return jax.tree.map(lambda g, p: g if g.dtype == jnp.result_type(p) else g.astype(jnp.result_type(p)),
                        grads, params)


def _logical(tree: Any) -> Any:
    """Shapes and dtypes of a worker-stacked tree without its worker axis."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], jnp.result_type(x)), tree)


def _sharded_step(loss_fn, tx, mesh, axis_name, fast_axis, specs, has_aux, rng, donate,
                  compute_dtype=None) -> Callable[..., tuple]:
    """:func:`data_parallel_step` over parameters sharded by ``specs`` (built at the first call, per tree)."""
    def build(params, opt_state):
        stored = _logical(params)
        leaf_specs = checked_leaf_specs(stored, specs, mesh, axis_name, padded=True, several=True)
        if len(named_fast_axes(leaf_specs, mesh)) > 1:
            return _several_axes_step(stored, opt_state, leaf_specs)
        # A padded leaf (parallel.Padded) is stored padded and sharded; the step cuts it to its logical shape before
        # the loss and the optimizer (which see it whole, as a leaf held whole) and pads the results again.
        logical = jax.tree.unflatten(jax.tree.structure(stored), [
            jax.ShapeDtypeStruct(e.shape, x.dtype) if isinstance(e, Padded) else x
            for x, e in zip(jax.tree.leaves(stored), leaf_specs)])
        dims, named = shard_dims(leaf_specs)
        fast = fast_axis or named
        if fast is None:
            raise ValueError("specs shard no leaf: pass fast_axis= (or drop specs= for the replicated 2-D layout)")
        if named is not None and named != fast:
            raise ValueError(f"specs shard over {named!r} but fast_axis={fast!r}")
        treedef = jax.tree.structure(logical)
        pspecs = jax.tree.unflatten(treedef, [stacked_spec(axis_name, as_spec(s)) for s in leaf_specs])
        state_entries = jax.tree.leaves(state_specs(tx, logical, jax.tree.unflatten(treedef, leaf_specs), mesh),
                                        is_leaf=lambda x: isinstance(x, (P, Padded)))
        state_def = jax.tree.structure(opt_state)
        check_stored(stored, leaf_specs, "params")
        check_stored(_logical(opt_state), state_entries, "opt_state")
        sspecs = jax.tree.unflatten(state_def, [stacked_spec(axis_name, as_spec(s)) for s in state_entries])
        per_device = P((axis_name, fast))
        own_specs = jax.tree.unflatten(treedef, [P() if s is None or isinstance(s, Padded) else s for s in leaf_specs])
        dims = [None if isinstance(s, Padded) else d for s, d in zip(leaf_specs, dims)]
        state_own = jax.tree.unflatten(state_def, [P() if isinstance(s, Padded) else s for s in state_entries])
        value_and_grad = per_device_value_and_grad(loss_fn, fast, has_aux, own_specs)

        def update(params, opt_state, grads):  # this device's shards (and whole leaves)
            grads = like_params(grads, params, compute_dtype)  # cast where tx takes it
            with layout.fast_layout(fast, grads, dims):
                return apply_gradients(tx, grads, opt_state, params)

        def body(params, opt_state, chunks, *keys):  # one worker's logical arrays, sharded over the fast axis
            params = jax.tree.unflatten(treedef, unpad_leaves(jax.tree.leaves(params), leaf_specs))
            opt_state = jax.tree.unflatten(state_def, unpad_leaves(jax.tree.leaves(opt_state), state_entries))
            (loss, aux), grads = value_and_grad(to_compute(params, compute_dtype), chunks, *keys)
            params, opt_state = on_shards(update, fast, (own_specs, state_own, own_specs),
                                          (own_specs, state_own))(params, opt_state, grads)
            params = jax.tree.unflatten(treedef, pad_leaves(jax.tree.leaves(params), leaf_specs))
            opt_state = jax.tree.unflatten(state_def, pad_leaves(jax.tree.leaves(opt_state), state_entries))
            return (params, opt_state, loss) + ((aux,) if has_aux else ())

        out_specs = (pspecs, sspecs, per_device) + ((per_device,) if has_aux else ())
        return build_sharded_step(body, mesh, axis_name, fast, "ssbk" if rng else "ssb",
                                  in_specs=(pspecs, sspecs, None, None)[: 4 if rng else 3], out_specs=out_specs,
                                  donate=donate)

    def _several_axes_step(stored, opt_state, leaf_specs):
        """The step over parameters sharded over several fast axes: each host is their devices together."""
        fast = check_fast_axes(mesh, named_fast_axes(leaf_specs, mesh), axis_name)
        if fast_axis is not None:  # one axis named where the specs use several: say so rather than guess
            raise ValueError(f"specs shard over several fast axes {fast} but fast_axis={fast_axis!r} names one: "
                             f"drop fast_axis, the step shards over every axis the specs name ({SEVERAL_AXES_HINT})")
        paths = jax.tree_util.tree_leaves_with_path(stored)
        for (path, _), e in zip(paths, leaf_specs):
            if isinstance(e, Padded):
                raise ValueError(f"specs{jax.tree_util.keystr(path)} = {e} pads its leaf over {e.spec}, on specs "
                                 f"that shard over several fast axes {fast}: keep the leaf whole (P()) or shard "
                                 "a dimension every axis it names divides")
        treedef = jax.tree.structure(stored)
        specs_tree = jax.tree.unflatten(treedef, leaf_specs)
        pspecs = jax.tree.unflatten(treedef, [stacked_spec(axis_name, as_spec(s)) for s in leaf_specs])
        # What the optimizer and its compressors see (placement.shard_view), its state laid out to match: with
        # compressors that work on shards cut any way, the leaves sharded over every fast axis as the specs lay them
        # out (no re-layout); the others cut along one dimension over all the fast axes together, which XLA re-lays
        # out at the boundary, inside the host.
        dims, view = shard_view(stored, leaf_specs, fast, mesh, own=works_on_any_cut(tx))
        view_tree = jax.tree.unflatten(treedef, view)
        state_view = state_specs(tx, stored, view_tree, mesh)
        # The state is stored as the specs lay it out (init_worker_state(specs=specs)), or, where it arrives laid out
        # as the optimizer sees it (init_worker_state(specs=<the view>)), kept so: no re-layout of the whole
        # optimizer state in and out of every step.
        view_entries = jax.tree.leaves(state_view, is_leaf=lambda x: isinstance(x, P))
        state_entries = (view_entries if _arrives_as(opt_state, view_entries) else
                         jax.tree.leaves(state_specs(tx, stored, specs_tree, mesh), is_leaf=lambda x: isinstance(x, P)))
        state_def = jax.tree.structure(opt_state)
        check_stored(stored, leaf_specs, "params")
        check_stored(_logical(opt_state), state_entries, "opt_state")
        sspecs = jax.tree.unflatten(state_def, [stacked_spec(axis_name, as_spec(s)) for s in state_entries])
        per_device = P((axis_name, *fast))
        value_and_grad = per_device_value_and_grad(loss_fn, fast, has_aux, view_tree)

        def update(params, opt_state, grads):  # this device's pieces (and whole leaves)
            grads = like_params(grads, params, compute_dtype)
            with layout.fast_layout(fast, grads, dims):
                return apply_gradients(tx, grads, opt_state, params)

        def body(params, opt_state, chunks, *keys):  # one worker's logical arrays, sharded by their specs
            (loss, aux), grads = value_and_grad(to_compute(params, compute_dtype), chunks, *keys)
            params, opt_state = on_shards(update, fast, (view_tree, state_view, view_tree),
                                          (view_tree, state_view))(params, opt_state, grads)
            return (params, opt_state, loss) + ((aux,) if has_aux else ())

        out_specs = (pspecs, sspecs, per_device) + ((per_device,) if has_aux else ())
        return build_sharded_step(body, mesh, axis_name, fast, "ssbk" if rng else "ssb",
                                  in_specs=(pspecs, sspecs, None, None)[: 4 if rng else 3], out_specs=out_specs,
                                  donate=donate)

    get, cache_size = per_tree(build)

    def step_for(params, opt_state):
        key = (jax.tree.structure((params, opt_state)),
               tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves((params, opt_state))),
               tuple(_entries(x) for x in jax.tree.leaves(opt_state)))  # the state's layout (see _arrives_as)
        return get(key, params, opt_state)

    def jitted(params, opt_state, batch, *key):
        padded = [is_padded_array(x) for x in jax.tree.leaves((params, opt_state))]
        out = step_for(params, opt_state)(params, opt_state, batch, *key)
        if any(padded):  # the new arrays are stored as the old ones were
            for x, was in zip(jax.tree.leaves(out[:2]), padded):
                if was:
                    mark_padded(x)
        return out

    jitted.lower = lambda params, opt_state, batch, *key: step_for(params, opt_state).lower(params, opt_state, batch,
                                                                                           *key)
    jitted._cache_size = cache_size  # compilations, as jax.jit's
    return keyed(jitted, mesh) if rng else jitted


def _own_entries(entries: tuple, ndim: int) -> tuple:
    """Sharding entries padded to ``ndim`` dimensions, one axis as its name (``("a",)`` -> ``"a"``, ``()`` -> None)."""
    entries = tuple(entries) + (None,) * max(0, ndim - len(tuple(entries)))
    return tuple((e[0] if len(e) == 1 else tuple(e) or None) if isinstance(e, tuple) else e for e in entries)


def _entries(x: Any) -> tuple | None:
    """A worker-stacked leaf's own sharding entries (the worker axis dropped), or None without a ``NamedSharding``."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    return None if spec is None else _own_entries(tuple(spec)[1:], len(np.shape(x)) - 1)


def _arrives_as(opt_state: Any, entries: list) -> bool:
    """Whether every worker-stacked state leaf arrives laid out by ``entries`` (specs without the worker axis)."""
    leaves = jax.tree.leaves(opt_state)
    return len(leaves) == len(entries) and all(
        _entries(x) is not None and _entries(x) == _own_entries(tuple(as_spec(e)), len(np.shape(x)) - 1)
        for x, e in zip(leaves, entries))


def _fast_mean(grads: Any, fast_axis: str) -> Any:
    """Dense mean of the floating-point gradient leaves over ``fast_axis`` (buckets of at most 64 MiB per dtype)."""
    leaves, treedef = jax.tree.flatten(grads)
    idx = [i for i, g in enumerate(leaves)
           if jnp.issubdtype(jnp.result_type(g), jnp.floating) and jnp.size(g) > 0]
    with collectives.uncounted():  # the host's own dense mean: no compressor's payload
        means, _ = collectives.dense_mean_arrays([leaves[i] for i in idx], fast_axis)
    for i, m in zip(idx, means):
        leaves[i] = m
    return jax.tree.unflatten(treedef, leaves)
