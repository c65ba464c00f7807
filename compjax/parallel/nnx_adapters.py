"""Flax NNX on the worker-stacked layout: Variables stacked in place, and the NNX train step.

:func:`nnx_replicate` gives every Variable of NNX objects the worker axis (or
its sharded form with ``specs=``), :func:`nnx_unreplicate` takes one worker's
copy back as a regular object, and :func:`nnx_data_parallel_step` builds the
step for a model and an ``nnx.Optimizer``: on a 1-D mesh it is
:func:`compjax.parallel.worker_step` over the usual NNX step; on a 2-D mesh
(``fast_axis=``) its own body, on parameters whole or sharded over the fast
axis, through the same step cores (:func:`compjax.parallel.core.build_step`;
:func:`compjax.parallel.core.build_sharded_step` for sharded parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import collectives, layout, workers
from compjax.compressors import clip
from compjax.compressors.applying import apply_gradients
from compjax.compressors.chains import works_on_any_cut
from compjax.parallel.core import (
    build_sharded_step,
    build_step,
    check_donatable,
    check_flags,
    chunk_indices,
    constrain,
    fast_size,
    gather_whole,
    host_mean,
    load_nnx,
    on_shards,
    per_tree,
    warn_no_exchange,
)
from compjax.parallel.mesh import check_axis, check_fast_axes, fast_names
from compjax.parallel.placement import (
    SEVERAL_AXES_HINT,
    checked_leaf_specs,
    gather,
    shard_batch,
    shard_view,
    stack_copies,
    state_specs,
)
from compjax.parallel.userstep import worker_step


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

    Afterwards the objects hold every worker's copy: calling the model
    directly (an evaluation loop of one's own) fails inside its first layer
    with a shape error on the extra leading axis (``n`` workers, e.g. a conv
    kernel ``(8, 3, 3, 1, 32)``).  Evaluate :func:`nnx_unreplicate` ``(model)``
    (worker 0's regular model, sharded parameters gathered whole), or run the
    evaluation step on every worker with :func:`worker_step`.

    Args:
      mesh: the mesh; ``n = mesh.shape[axis_name]``.
      *nodes: NNX objects (``nnx.Module``, ``nnx.Optimizer``, ...) holding one
        worker's values.
      axis_name: the data axis (the slow axis of a 2-D mesh).
      specs: sharded parameters (FSDP): a tree like ``nnx.state(nodes[0])``
        (the model) of ``PartitionSpec`` over one fast mesh axis (or over
        several, e.g. ``P('fsdp', 'tensor')``, for :func:`worker_step` only), e.g.
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
    nnx = load_nnx()
    state = nnx.state(nodes)  # one State for all nodes: shared Variables appear once
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == mesh and s.spec and s.spec[0] == axis_name:
            raise ValueError(
                f"{jax.tree_util.keystr(path)} is already sharded {s.spec} over {axis_name!r}: replicate once, "
                "after building the optimizer on one worker's model"
            )

    if specs is None:
        nnx.update(nodes, jax.tree.map(lambda x: stack_copies(x, mesh, axis_name), state))
        return
    leaf_specs = _nnx_leaf_specs(nodes, specs, mesh, axis_name)
    leaves, treedef = jax.tree.flatten(state)
    nnx.update(nodes, jax.tree.unflatten(treedef, [stack_copies(x, mesh, axis_name, None, spec)
                                                   for x, spec in zip(leaves, leaf_specs)]))


def _nnx_leaf_specs(nodes: Sequence, specs: Any, mesh: Mesh, axis_name: str) -> list:
    """One ``PartitionSpec`` (or None: whole) per array leaf of ``nnx.state(nodes)``, from the model's ``specs``.

    The model (``nodes[0]``) takes ``specs``; an ``nnx.Optimizer``'s state
    takes :func:`state_specs` of its ``tx`` over the model's ``wrt``
    parameters; every other Variable is whole.  Variables are matched by
    identity, so one shared between nodes gets one spec.
    """
    nnx = load_nnx()

    def is_var(x):
        return isinstance(x, nnx.Variable)

    model = nodes[0]
    mstate = nnx.state(model)
    by_id = {id(v): s for v, s in zip(jax.tree.leaves(mstate, is_leaf=is_var),
                                      checked_leaf_specs(mstate, specs, mesh, axis_name, several=True))}
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
      device, in buffers of their own; ``node`` is not changed.  A Variable
      sharded over a fast axis (``nnx_replicate(..., specs=...)``) comes back
      whole (gathered from the host's devices; with several processes every
      process must call this, as :func:`gather`).

    Examples:
      >>> from flax import nnx
      >>> from compjax import parallel
      >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> parallel.nnx_replicate(parallel.make_mesh(), model)
      >>> parallel.nnx_unreplicate(model).kernel.shape
      (3, 2)
    """
    nnx = load_nnx()
    graphdef, state = nnx.split(node)

    def first(x):
        if not hasattr(x, "addressable_shards"):
            return jnp.asarray(x)[0]
        spec = getattr(x.sharding, "spec", None)
        if spec is not None and any(e is not None for e in tuple(spec)[1:]):  # a shard is not the whole worker
            return jax.device_put(np.asarray(gather(x))[0], x.addressable_shards[0].device)
        return x.addressable_shards[0].data[0]

    return nnx.merge(graphdef, jax.tree.map(first, state))


def nnx_data_parallel_step(
    loss_fn: Callable[..., Any],
    mesh: Mesh,
    *,
    axis_name: str = "data",
    fast_axis: str | None = None,
    has_aux: bool = False,
    worker_rngs: bool = True,
    donate: bool = False,
    independent: bool = False,
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
      fast_axis: the fast axis of a 2-D mesh (:func:`make_2d_mesh`), or None (on a 2-D mesh the step is
        then :func:`worker_step`'s: the loss on each worker's logical arrays, laid out inside the host by
        XLA from the arrays' own shardings, one loss per worker; the same parameters as with
        ``fast_axis``, whose step runs the optimizer and compressors on each device's shards).
        Then model and optimizer come from :func:`nnx_replicate` over
        ``axis_name`` (the slow axis), with or without ``specs=``: each fast
        device takes its own slice of the batch and the gradient is the host's
        mean.  With parameters whole, each device runs ``loss_fn`` on its slice
        and the gradients are averaged over the fast axis.  With sharded
        parameters, as in :func:`data_parallel_step` with ``specs``,
        ``loss_fn`` runs on each worker's logical parameters under
        ``jax.vmap`` over the devices' slices: XLA gathers each parameter where
        the model uses it (one layer at a time for blocks under
        ``jax.lax.scan``) and reduces its gradient to shards, and the optimizer
        updates each device's shard, its compressor working on the shards.
        Non-optimized floating Variables (batch statistics) are averaged over
        the fast axis and must be held whole.  A tuple of several fast axes
        (``fast_axis=('fsdp', 'tensor')``, a model annotated
        ``nnx.with_partitioning(init, ('fsdp', 'tensor'))`` on a
        ``(data, fsdp, tensor)`` mesh of ``Auto`` axes) makes a host of their
        devices together, as :func:`data_parallel_step` does for specs over
        several axes: the Variables keep their annotated layout and the
        optimizer sees each sharded leaf cut along one dimension over all of
        them.
      has_aux: ``loss_fn`` returns ``(loss, aux)`` (e.g. logits for accuracy).
      worker_rngs: fold the worker index into the model's RNG streams for the
        step (False: every worker draws the same numbers).
      donate: donate the model's and optimizer's buffers to the step (the
        arrays held before the call are deleted; the objects get the new ones).
        With parameters sharded over ``fast_axis``, the step updates them in
        place (:class:`compjax.parallel.core.MergedStep`).
      independent: the workers are meant to train apart: no warning when
        nothing crosses ``axis_name`` (on a 1-D mesh read from the traced step,
        as :func:`worker_step`'s ``independent``; on a 2-D mesh from the
        optimizer's ``tx``, which must hold a compjax compressor or algorithm).

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
      ValueError: when built, ``axis_name`` not an axis of ``mesh``, ``fast_axis`` naming
        an axis not of ``mesh``, the worker axis, or one of type ``Explicit``, or a flag not a bool; at call
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
    check_axis(mesh, axis_name)
    check_flags(has_aux=has_aux, worker_rngs=worker_rngs, donate=donate, independent=independent)
    if fast_axis is not None:
        if isinstance(fast_axis, (tuple, list)):
            fast_axis = check_fast_axes(mesh, fast_axis, axis_name)
            fast_axis = fast_axis[0] if len(fast_axis) == 1 else fast_axis
        else:
            check_axis(mesh, fast_axis)
            if fast_axis == axis_name:
                raise ValueError(f"fast_axis and axis_name must differ, both are {axis_name!r}")
        return _nnx_host_step(loss_fn, mesh, axis_name, fast_axis, has_aux, worker_rngs, donate, independent)

    def single(model, optimizer, batch):  # traced once per structure: the chain is checked then
        clip.warn_local_norms(optimizer.tx)
        grad_fn = load_nnx().value_and_grad(loss_fn, argnums=load_nnx().DiffState(0, optimizer.wrt), has_aux=has_aux)
        out, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return out

    return worker_step(single, mesh, axis_name=axis_name, batch_argnums=-1, worker_rngs=worker_rngs, donate=donate,
                       independent=independent)


def _nnx_host_step(loss_fn, mesh, axis_name, fast_axis, has_aux, worker_rngs, donate,
                   independent=False) -> Callable[..., Any]:
    """:func:`nnx_data_parallel_step` on a 2-D mesh, parameters whole or sharded over ``fast_axis``.

    The layout is read from the arrays (:func:`nnx_replicate` placed them): a
    model parameter whose sharding names ``fast_axis`` after the worker axis
    is a shard along that dimension.  With any parameter sharded the step is
    :func:`compjax.parallel.core.build_sharded_step`'s (the loss on logical
    arrays, XLA's gathers per use), else :func:`compjax.parallel.core.build_step`'s
    over every device.  Compiled once per graph structure,
    shapes and shardings.
    """
    nnx = load_nnx()
    names = fast_names(fast_axis)
    several = len(names) > 1
    size = fast_size(mesh, fast_axis)
    devices = (axis_name, *names)

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
            if several:  # any of the fast axes, in any dimensions: the optimizer sees shard_view's layout
                stray = [a for e in spec[1:] if e is not None for a in (e if isinstance(e, tuple) else (e,))
                         if a not in names]
                if stray:
                    raise ValueError(f"{what}{jax.tree_util.keystr(path)} is sharded {P(*spec)}, over {stray[0]!r}, "
                                     f"not one of fast_axis={fast_axis!r}")
                specs.append(P(*spec))
                dims.append(own[0] if own else None)
                continue
            if len(own) > 1 or (own and isinstance(spec[1 + own[0]], tuple) and len(spec[1 + own[0]]) > 1):
                raise ValueError(f"{what}{jax.tree_util.keystr(path)} is sharded {P(*spec)}, over several axes: "
                                 f"{SEVERAL_AXES_HINT}")
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

        if any(d is not None for d in pdims):
            if several:
                return sharded(mdef, odef, wrt, trees, pspecs, rspecs, ospecs, pdims,
                               view=several_view(odef, trees, arrays, pspecs))
            return sharded(mdef, odef, wrt, trees, pspecs, rspecs, ospecs, pdims)

        def body(pl, rl, ol, batch):  # this device's leaves (build_step slices them)
            optimizer = nnx.merge(odef, jax.tree.unflatten(otree, ol))

            def loss_of(shards):  # a model of this trace's own Variables (NNX refuses updates across traces)
                whole = jax.tree.unflatten(ptree, gather_whole(shards, pdims, fast_axis))
                model = nnx.merge(mdef, whole, jax.tree.unflatten(rtree, rl))
                saved = workers.nnx_fold_rngs(model, devices) if worker_rngs else None
                out = loss_fn(model, batch)
                if saved is not None:
                    nnx.update(model, saved)
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, jax.tree.leaves(nnx.split(model, wrt, ...)[2]))

            (loss, (aux, new_rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(pl)
            grads = host_mean(grads, size)
            params = nnx.as_pure(jax.tree.unflatten(ptree, pl))
            pure = jax.tree.structure(params)
            grads = jax.tree.unflatten(pure, grads)
            with layout.fast_layout(fast_axis, grads, pdims):
                params, new_opt = apply_gradients(optimizer.tx, grads, nnx.as_pure(optimizer.opt_state), params)
            nnx.update(optimizer.opt_state, nnx.state(new_opt))
            optimizer.step[...] += 1
            floats = [i for i, x in enumerate(new_rest) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
            means = workers.mean_floats([new_rest[i] for i in floats], fast_axis) if floats else []
            for i, m in zip(floats, means):  # batch statistics: the host's mean, held by each of its devices
                new_rest[i] = m
            outs = (jax.tree.leaves(params), new_rest, jax.tree.leaves(nnx.split(optimizer)[1]), loss)
            return outs + ((aux,) if has_aux else ())

        out_specs = (pspecs, rspecs, ospecs, P(devices)) + ((P(devices),) if has_aux else ())
        return build_step(body, mesh, devices, "sssb", in_specs=(pspecs, rspecs, ospecs, None), out_specs=out_specs,
                          donate=donate)

    def several_view(odef, trees, arrays, pspecs):
        """Over several fast axes: what the optimizer sees (:func:`shard_view`), parameters and state."""
        ptree, _, otree = trees
        pl, _, ol = arrays
        logical = [jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], jnp.result_type(x)) for x in pl]
        optimizer = nnx.merge(odef, jax.tree.unflatten(otree, ol))
        dims, view = shard_view(logical, [P(*tuple(s)[1:]) for s in pspecs], names, mesh,
                                own=works_on_any_cut(optimizer.tx))
        pure = nnx.as_pure(jax.tree.unflatten(ptree, logical))
        pure_def = jax.tree.structure(pure)
        state_view = jax.tree.leaves(state_specs(optimizer.tx, pure, jax.tree.unflatten(pure_def, view), mesh),
                                     is_leaf=lambda x: isinstance(x, P))

        def is_var(x):
            return isinstance(x, nnx.Variable)

        by_id = {id(v): sp for v, sp in zip(jax.tree.leaves(optimizer.opt_state, is_leaf=is_var), state_view)}
        oview = [by_id.get(id(v), P()) for v in jax.tree.leaves(nnx.state(optimizer), is_leaf=is_var)]
        if len(oview) != len(ol):  # pragma: no cover - nnx.state and nnx.split flatten alike
            raise ValueError(f"the optimizer has {len(ol)} arrays but {len(oview)} Variables")
        return dims, view, oview

    def sharded(mdef, odef, wrt, trees, pspecs, rspecs, ospecs, pdims, view=None):
        """The step over parameters sharded over ``fast_axis``: the loss on each worker's logical arrays.

        ``view``: over several fast axes, ``(dims, param specs, optimizer specs)`` as the optimizer sees them
        (:func:`several_view`); XLA re-lays the leaves out at the optimizer's boundary, inside the host.
        """
        ptree, rtree, otree = trees
        own = [P(*tuple(s)[1:]) for s in pspecs]
        oown = [P(*tuple(s)[1:]) for s in ospecs]
        if view is not None:
            pdims, own, oown = view

        def update(pl, ol, grads):  # this device's shards (and whole leaves)
            optimizer = nnx.merge(odef, jax.tree.unflatten(otree, ol))
            params = nnx.as_pure(jax.tree.unflatten(ptree, pl))
            grads = jax.tree.unflatten(jax.tree.structure(params), grads)
            with layout.fast_layout(fast_axis, grads, pdims):
                params, new_opt = apply_gradients(optimizer.tx, grads, nnx.as_pure(optimizer.opt_state), params)
            nnx.update(optimizer.opt_state, nnx.state(new_opt))
            optimizer.step[...] += 1
            return jax.tree.leaves(params), jax.tree.leaves(nnx.split(optimizer)[1])

        def body(pl, rl, ol, chunks):  # one worker's logical arrays; its batch in one chunk per device
            def chunk_loss(params, batch, index):  # one device's chunk: its own model, its streams folded
                model = nnx.merge(mdef, jax.tree.unflatten(ptree, params), jax.tree.unflatten(rtree, rl))
                saved = jax.tree.map(lambda k: k, nnx.state(model, nnx.RngKey)) if worker_rngs else None
                if saved is not None and jax.tree.leaves(saved):
                    nnx.update(model, jax.tree.map(lambda k: jax.random.fold_in(k, index), saved))
                out = loss_fn(model, batch)
                if saved is not None and jax.tree.leaves(saved):
                    nnx.update(model, saved)
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, jax.tree.leaves(nnx.split(model, wrt, ...)[2]))

            def mean_loss(params):
                losses, (aux, rest) = jax.vmap(chunk_loss, in_axes=(None, 0, 0))(params, chunks,
                                                                                  chunk_indices(axis_name, size))
                return jnp.mean(losses), (losses, aux, rest)

            with collectives.uncounted():  # XLA's gathers and gradient reductions inside the host
                grads, (losses, aux, rest) = jax.grad(mean_loss, has_aux=True)(pl)
                grads = [constrain(g, s) for g, s in zip(grads, own)]
            # batch statistics: the host's mean over its devices' chunks; other Variables (counters) as chunk 0's
            rest = [jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x[0]
                    for x in rest]
            pl, ol = on_shards(update, fast_axis, (own, oown, own), (own, oown))(pl, ol, grads)
            return (pl, rest, ol, losses) + ((aux,) if has_aux else ())

        out_specs = (pspecs, rspecs, ospecs, P(devices)) + ((P(devices),) if has_aux else ())
        return build_sharded_step(body, mesh, axis_name, fast_axis, "sssb", in_specs=(pspecs, rspecs, ospecs, None),
                                  out_specs=out_specs, donate=donate)

    get, cache_size = per_tree(build)
    checked: set = set()

    def prepare(model, optimizer, batch):
        if not isinstance(optimizer, nnx.Optimizer):
            raise ValueError(f"optimizer must be an nnx.Optimizer built on the model, got {type(optimizer).__name__}")
        mdef, params, rest = nnx.split(model, optimizer.wrt, ...)
        odef, ostate = nnx.split(optimizer)
        if id(optimizer.tx) not in checked:  # the chain, once per optimizer: see compjax.compressors.clip
            clip.warn_local_norms(optimizer.tx)
            if not independent:
                warn_no_exchange(optimizer.tx, "nnx_data_parallel_step", axis_name)
            if any(set(names) & set(jax.tree.leaves(tuple(getattr(getattr(x, "sharding", None), "spec", ()))[1:]))
                   for x in jax.tree.leaves(params)):
                clip.check_sharded_chain(optimizer.tx)
            checked.add(id(optimizer.tx))
        flat = [jax.tree.flatten(t) for t in (params, rest, ostate)]
        trees, arrays = tuple(t for _, t in flat), tuple(a for a, _ in flat)
        if donate:
            check_donatable(arrays)
        key = (mdef, odef, trees, tuple((np.shape(x), jnp.result_type(x), getattr(x, "sharding", None))
                                        for x in jax.tree.leaves(arrays)))
        jitted = get(key, mdef, odef, optimizer.wrt, trees, arrays)
        if not all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(batch)):
            batch = shard_batch(batch, mesh, axis_name, fast_axis=fast_axis)
        return jitted, trees, arrays + (batch,)

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
    train_step._cache_size = cache_size
    return train_step
