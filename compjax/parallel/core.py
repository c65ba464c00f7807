"""The step cores every data-parallel step builder shares: ``jax.jit`` of ``jax.shard_map`` over the worker layout.

:func:`build_step` turns a function of one worker's values into the jitted
step over the worker-stacked layout (:mod:`compjax.parallel.placement`).  Each
positional argument of the step has a kind:

* ``"s"``, worker-stacked: a tree with the leading worker axis; the body gets
  this worker's slice ``x[0]``; donated with ``donate``;
* ``"b"``, batch: split along its leading axis over the worker axes; the body
  gets this worker's rows;
* ``"k"``, keys: one PRNG key (or a tree of keys) for all workers, placed
  whole on every device; the body gets ``jax.random.fold_in(key, i)`` with
  ``i`` this worker's index over the worker axes (on a 2-D mesh, the slow
  index and the shard index together: every device its own stream);
* ``"c"``, static: a hashable value (a graph definition, a layout) given to
  the body as it is; the step compiles once per value.

Whatever the body returns comes back worker-stacked (``x[None]`` on each
leaf), placed by ``out_specs`` through ``out_shardings``: the sharding the
layout's own placement gives (``replicate``), so the second call hits the
compilation cache and the outputs can be fed back.  :func:`keyed` checks and
places a step's key; :func:`check_donatable` guards donation (XLA:CPU crashes
on arrays donated twice rather than raising).

:func:`build_sharded_step` is the sharded (FSDP) layout's core: a
``shard_map`` manual over the slow axis only, whose body runs on each
worker's logical arrays (sharded over the fast axis, gathered by XLA where
they are used), with :func:`on_shards` for the part that works on each
device's shards and :func:`per_device_value_and_grad` for the loss of each
device's chunk of the batch.  Donated, it is a :class:`MergedStep`: the
worker-stacked leaves travel merged into their first dimension
(:func:`merged_spec`), so the program updates each donated buffer in place.

The step builders on top: :func:`compjax.parallel.data_parallel_step` (pytrees,
1-D and 2-D, whole or sharded parameters), :func:`compjax.parallel.worker_step`
(a user's own single-device step) and
:func:`compjax.parallel.nnx_data_parallel_step` (Flax NNX, through
``worker_step`` on a 1-D mesh, on its own body on a 2-D one).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import collectives, workers
from compjax.compressors import chains
from compjax.parallel.mesh import fast_names
from compjax.parallel.placement import put

#: The kinds of a step's positional arguments (see the module docstring).
KINDS = frozenset("sbkc")


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _checked_kinds(kinds: str | Sequence[str], in_specs: Sequence[Any] | None) -> tuple[tuple, tuple]:
    """``(kinds, in_specs)`` as tuples (``in_specs`` None: one None per argument), checked."""
    kinds = tuple(kinds)
    if not set(kinds) <= KINDS:
        raise ValueError(f"kinds must be letters of {sorted(KINDS)}, got {''.join(kinds)!r}")
    in_specs = (None,) * len(kinds) if in_specs is None else tuple(in_specs)
    if len(in_specs) != len(kinds):
        raise ValueError(f"in_specs has {len(in_specs)} entries for {len(kinds)} arguments")
    return kinds, in_specs


def build_step(
    body: Callable[..., Any],
    mesh: Mesh,
    worker_axes: Any,
    kinds: str | Sequence[str],
    *,
    in_specs: Sequence[Any] | None = None,
    out_specs: Any = None,
    donate: bool = False,
    manual_only: bool = False,
) -> Any:
    """``jax.jit(jax.shard_map(...))`` of ``body`` over the worker-stacked layout.

    Args:
      body: ``body(*args) -> outputs`` on one worker's values, the arguments in
        the step's order (static ones as they are, stacked ones sliced, batches
        local, keys folded); its outputs without the worker axis.
      mesh: the mesh.
      worker_axes: the mesh axis (a name) or axes (a tuple) the worker axis runs
        over: batches are split over them, keys folded over them, and they are
        the default spec ``P(worker_axes)`` of stacked arguments and outputs.
      kinds: one letter per positional argument of the step, from ``"sbkc"``.
      in_specs: one entry per argument: None (the default for its kind) or the
        ``PartitionSpec`` (or a tree of them, a prefix of the argument) of a
        stacked argument laid out otherwise (sharded parameters).
      out_specs: a ``PartitionSpec`` or a tree of them, a prefix of the outputs
        with their worker axis; default ``P(worker_axes)`` for every output.
      donate: donate the stacked arguments' buffers.
      manual_only: the ``shard_map`` is manual over ``worker_axes`` only
        (``axis_names=``): the mesh's other axes stay automatic, so each
        worker's arrays keep their own shardings over them (XLA's propagation
        lays ``body`` out inside the worker) and only the collectives ``body``
        issues over ``worker_axes`` cross between workers.  Outputs are then
        not placed by ``out_shardings`` (``body`` constrains them).

    Returns:
      The ``jax.jit`` function ``step(*args)`` (with ``.lower``, ``._cache_size``).

    Raises:
      ValueError: a kind not in ``"sbkc"``, or ``in_specs`` of another length than ``kinds``.
    """
    kinds, in_specs = _checked_kinds(kinds, in_specs)
    worker = P(worker_axes)
    default = {"s": worker, "b": worker, "k": P()}
    mapped_specs = tuple(default[k] if s is None else s for k, s in zip(kinds, in_specs) if k != "c")
    out_specs = worker if out_specs is None else out_specs
    static = tuple(i for i, k in enumerate(kinds) if k == "c")
    donated = tuple(i for i, k in enumerate(kinds) if k == "s") if donate else ()

    def local(kind: str, a: Any) -> Any:
        if kind == "s":
            return jax.tree.map(lambda x: x[0], a)
        if kind == "k":
            return jax.tree.map(lambda k: workers.fold_worker(k, worker_axes), a)
        return a

    def per_worker(consts: tuple, *mapped: Any) -> Any:
        it_c, it_m = iter(consts), iter(mapped)
        args = [next(it_c) if k == "c" else local(k, next(it_m)) for k in kinds]
        return jax.tree.map(lambda x: x[None], body(*args))

    def run(*args: Any) -> Any:
        consts = tuple(a for a, k in zip(args, kinds) if k == "c")
        mapped = tuple(a for a, k in zip(args, kinds) if k != "c")
        manual = {"axis_names": set(worker_axes if isinstance(worker_axes, tuple) else (worker_axes,))}
        sharded = jax.shard_map(functools.partial(per_worker, consts), mesh=mesh, in_specs=mapped_specs,
                                out_specs=out_specs, **(manual if manual_only else {}))
        return sharded(*mapped)

    if manual_only:
        return jax.jit(run, static_argnums=static, donate_argnums=donated)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=_is_spec)
    return jax.jit(run, static_argnums=static, donate_argnums=donated, out_shardings=shardings)


def build_sharded_step(
    body: Callable[..., Any],
    mesh: Mesh,
    worker_axis: str,
    fast: str,
    kinds: str | Sequence[str],
    *,
    in_specs: Sequence[Any],
    out_specs: Any,
    donate: bool = False,
) -> Any:
    """``jax.jit`` of a ``jax.shard_map`` manual over the worker axis only: the sharded (FSDP) layout's step core.

    Parameters and state are sharded over ``fast`` (``P(worker_axis, *spec)``,
    :func:`compjax.parallel.replicate` with ``specs=``).  The ``shard_map``
    takes the worker axis alone as manual (``axis_names={worker_axis}``): the
    body runs on one worker's *logical* arrays, which stay sharded over
    ``fast`` by their own specs, and XLA's SPMD partitioner inserts the
    collectives inside the host where the body uses them: a parameter is
    all-gathered where it is used (for blocks under ``jax.lax.scan`` over
    stacked layer parameters, one layer at a time inside the loop), its
    gradient reduced back to shards.  Nothing is gathered whole up front.
    :func:`on_shards` makes ``fast`` manual again for the part that works on
    each device's shards (the optimizer and its compressors).

    The kinds are :func:`build_step`'s, with these differences:

    * ``"s"``: the body gets this worker's slice ``x[0]``, constrained to the
      leaf's own spec (``in_specs`` without the worker axis);
    * ``"b"``: the body gets this worker's rows cut into ``fast`` chunks on a
      new leading axis (``(fast, rows / fast, ...)``, sharded over ``fast``):
      chunk ``c`` is the rows device ``c`` of the worker's host holds; over
      several fast axes the chunks are held whole by the host's devices and XLA
      partitions the loss's activations from there (token ids split over the
      automatic axes of this partly manual program make XLA:CPU's partitioner
      abort on an embedding lookup of a table sharded over two axes);
    * ``"k"``: the body gets the ``fast`` keys of the chunks, stacked:
      ``jax.random.fold_in(key, w * fast + c)`` for worker ``w`` and chunk
      ``c``, the key the device holding that chunk would fold on a 2-D mesh.

    Outputs: a leaf whose entry in ``out_specs`` runs over both axes
    (``P((worker_axis, fast), ...)``: one value per device, losses and aux) is
    returned by the body with the chunk axis leading, as it is; every other
    output is worker-stacked (``x[None]``) and placed by its spec.

    Args:
      body: ``body(*args) -> outputs`` on one worker's logical values.
      mesh: the 2-D mesh.
      worker_axis: the slow mesh axis (a name).
      fast: the fast mesh axis the specs shard over, or a tuple of several
        (``("fsdp", "tensor")``, in mesh order): a host is then their devices
        together, its batch cut into one chunk per device (chunk ``c`` on the
        device of index ``c`` over the tuple, the last axis varying fastest).
      kinds: one letter per positional argument, from ``"sbkc"``.
      in_specs: one entry per argument: None (the default for its kind) or the
        ``PartitionSpec`` (or a tree of them, a prefix of the argument) of a
        stacked argument, the worker axis first.
      out_specs: a tree of ``PartitionSpec``s, a prefix of the outputs, with the worker axis.
      donate: donate the stacked arguments' buffers.  The step then carries
        each stacked leaf of two or more dimensions merged into its first one
        (``(n, d, ...)`` reshaped in place to ``(n * d, ...)``, laid out by
        :func:`merged_spec`): each worker's block is the leaf's logical array,
        which the program updates in place (see :class:`MergedStep`).

    Returns:
      The ``jax.jit`` function ``step(*args)`` (with ``.lower``, ``._cache_size``);
      with ``donate``, a :class:`MergedStep` with the same three.

    Raises:
      ValueError: a kind not in ``"sbkc"``, or ``in_specs`` of another length
        than ``kinds``; when traced, a batch whose rows per worker the fast
        axis size does not divide.
    """
    kinds, in_specs = _checked_kinds(kinds, in_specs)
    size = fast_size(mesh, fast)
    worker = P(worker_axis)
    static = tuple(i for i, k in enumerate(kinds) if k == "c")
    donated = tuple(i for i, k in enumerate(kinds) if k == "s") if donate else ()
    per_device = (worker_axis, *fast_names(fast))

    def own(spec: P) -> P:  # a stacked leaf's spec without the worker axis
        return P(*tuple(spec)[1:])

    def leaf_specs(spec: Any, tree: Any) -> list:  # one stacked spec per leaf of ``tree`` (a prefix broadcast)
        if spec is None:
            return [worker] * len(jax.tree.leaves(tree))
        return jax.tree.leaves(jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), spec, tree,
                                            is_leaf=_is_spec), is_leaf=_is_spec)

    def local(kind: str, a: Any, spec: Any, merged: Any) -> Any:
        if kind == "s":
            leaves, treedef = jax.tree.flatten(a)
            return jax.tree.unflatten(treedef, [
                (x if m else x[0]) if spec is None else constrain(x if m else x[0], own(s))
                for x, s, m in zip(leaves, leaf_specs(spec, a), merged)])
        if kind == "b":
            return jax.tree.map(chunks, a)
        if kind == "k":
            index = chunk_indices(worker_axis, size)
            return jax.tree.map(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(index), a)
        return a

    def chunks(x: Any) -> Any:  # one worker's rows (sharded over fast) as (fast, rows / fast, ...)
        if x.shape[0] % size:
            raise ValueError(f"a batch leaf has {x.shape[0]} rows per worker, not divisible by the {size} devices "
                             f"of the fast axis {fast!r}: put the batch on the mesh with "
                             f"parallel.shard_batch(batch, mesh, fast_axis={fast!r})")
        # Over several fast axes the chunks are held whole by the host's devices: token ids split over the automatic
        # axes of this partly manual program make XLA:CPU's SPMD partitioner (jaxlib 0.10.2) abort the process on
        # an embedding lookup (a gather) of a table sharded over two axes, as in worker_step.
        spec = P(fast) if len(fast_names(fast)) == 1 else P()
        return constrain(x.reshape((size, x.shape[0] // size) + x.shape[1:]), spec)

    def is_per_device(spec: P) -> bool:
        first = next(iter(spec), None)
        return isinstance(first, tuple) and tuple(first) == per_device

    def per_worker(consts: tuple, merged_in: Any, merged_out: Any, *mapped: Any) -> Any:
        it_c, it_m = iter(consts), iter(mapped)
        args = []
        for i, (k, s) in enumerate(zip(kinds, in_specs)):
            if k == "c":
                args.append(next(it_c))
                continue
            a = next(it_m)
            flags = merged_in[i] if merged_in is not None and k == "s" else [False] * len(jax.tree.leaves(a))
            args.append(local(k, a, s, flags))
        outs = body(*args)
        leaves, treedef = jax.tree.flatten(outs)
        merged_out = [False] * len(leaves) if merged_out is None else merged_out
        return jax.tree.unflatten(treedef, [x if is_per_device(s) or m else x[None] for x, s, m
                                            in zip(leaves, leaf_specs(out_specs, outs), merged_out)])

    def run(merged_in: Any, merged_out: Any, *args: Any) -> Any:
        consts = tuple(a for a, k in zip(args, kinds) if k == "c")
        mapped = tuple(a for a, k in zip(args, kinds) if k != "c")
        specs = tuple(P() if k == "k" else worker for k in kinds if k != "c")
        sharded = jax.shard_map(functools.partial(per_worker, consts, merged_in, merged_out), mesh=mesh,
                                in_specs=specs, out_specs=worker, axis_names={worker_axis})
        return sharded(*mapped)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=_is_spec)
    plain = jax.jit(functools.partial(run, None, None), static_argnums=static, donate_argnums=donated,
                    out_shardings=shardings)
    if not donate:
        return plain
    return MergedStep(plain, run, mesh, kinds, in_specs, out_specs, leaf_specs, is_per_device)


def merged_spec(spec: P) -> P:
    """The spec of a worker-stacked leaf ``(n, d, ...)`` reshaped to ``(n * d, ...)``: the worker axis and ``d``'s axes merged.

    ``P("data", "fast", None)`` -> ``P(("data", "fast"), None)``; ``P("data")`` -> ``P("data")``.
    """
    parts = tuple(spec)
    first = parts[1] if len(parts) > 1 else None
    lead = parts[0] if first is None else (parts[0], *((first,) if isinstance(first, str) else tuple(first)))
    return P(lead, *parts[2:])


class MergedStep:
    """:func:`build_sharded_step`'s donated step: its worker-stacked leaves carried merged into their first dimension.

    A leaf ``(n, d, ...)`` (``n`` workers, laid out ``P(worker, *spec)``) is
    reshaped in place (a jitted, donated reshape: the same bytes on every
    device) to ``(n * d, ...)`` laid out by :func:`merged_spec`, so each
    worker's block is the leaf's logical ``(d, ...)`` and the step's program
    reads and writes the donated buffers in their own shape.  (Indexing
    ``x[0]`` of a ``(1, d, ...)`` block instead puts a reshape between each
    updated buffer and the program's output, and XLA:CPU then recomputes the
    optimizer's elementwise update in every consumer and copies each donated
    state leaf, a float32 copy of each AdamW moment, rather than updating it
    in place.)  Leaves of one logical dimension or none, and key arrays, go
    as they are.  The outputs come back worker-stacked, reshaped back the same
    way.  Built per argument structure, shapes and dtypes (one
    ``jax.eval_shape`` of the step for its outputs).

    ``step(*args)`` runs it (three programs: the merge, the step, the split
    back; the first and last move no data); ``step.lower(*args)`` lowers the
    step's own program for ``args`` (arrays or ``jax.ShapeDtypeStruct`` with
    shardings, worker-stacked as the caller holds them; nothing is donated);
    ``step._cache_size()`` counts its compilations, as ``jax.jit``'s.
    """

    def __init__(self, plain, run, mesh, kinds, in_specs, out_specs, leaf_specs, is_per_device):
        self._plain, self._run, self._mesh = plain, run, mesh
        self._kinds, self._in_specs, self._out_specs = kinds, in_specs, out_specs
        self._leaf_specs, self._is_per_device = leaf_specs, is_per_device
        self._cache: dict = {}

    @staticmethod
    def _mergeable(x: Any, spec: P) -> bool:
        dtype = jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype
        return (len(np.shape(x)) >= 2 and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
                and len(tuple(spec)) >= 1)

    def _prepared(self, args: tuple) -> tuple:
        key = tuple(a if k == "c" else (jax.tree.structure(a), tuple((np.shape(x), jnp.result_type(x))
                                                                       for x in jax.tree.leaves(a)))
                    for a, k in zip(args, self._kinds))
        if key in self._cache:
            return self._cache[key]
        merged_in, in_leaf = {}, []
        for i, (a, k, s) in enumerate(zip(args, self._kinds, self._in_specs)):
            if k != "s":
                continue
            specs = self._leaf_specs(s, a)
            merged_in[i] = tuple(self._mergeable(x, sp) for x, sp in zip(jax.tree.leaves(a), specs))
            in_leaf += [(x, sp) for x, sp, m in zip(jax.tree.leaves(a), specs, merged_in[i]) if m]
        merged_in_t = tuple(merged_in.get(i) for i in range(len(args)))
        outs = jax.eval_shape(self._plain, *args)
        specs_out = self._leaf_specs(self._out_specs, outs)
        merged_out = tuple(not self._is_per_device(sp) and self._mergeable(x, sp)
                           for x, sp in zip(jax.tree.leaves(outs), specs_out))
        shard = lambda sp: NamedSharding(self._mesh, sp)
        out_leaf_specs = [shard(merged_spec(sp)) if m else shard(sp) for sp, m in zip(specs_out, merged_out)]
        out_shardings = jax.tree.unflatten(jax.tree.structure(outs), out_leaf_specs)
        static = tuple(i for i, k in enumerate(self._kinds) if k == "c")
        donated = tuple(i for i, k in enumerate(self._kinds) if k == "s")
        main = jax.jit(functools.partial(self._run, merged_in_t, merged_out), static_argnums=static,
                       donate_argnums=donated, out_shardings=out_shardings)
        merge_specs = [merged_spec(sp) for _, sp in in_leaf]
        merge = jax.jit(lambda xs: [x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]) for x in xs],
                        donate_argnums=0, out_shardings=[shard(sp) for sp in merge_specs])
        split_specs = [(np.shape(x), sp) for x, sp, m in zip(jax.tree.leaves(outs), specs_out, merged_out) if m]
        split = jax.jit(lambda xs: [x.reshape(shape) for x, (shape, _) in zip(xs, split_specs)], donate_argnums=0,
                        out_shardings=[shard(sp) for _, sp in split_specs])
        self._cache[key] = (main, merge, split, merged_in_t, merge_specs, merged_out)
        return self._cache[key]

    def _merged_args(self, args: tuple, merged_in: tuple, merge: Any, merge_specs: list, abstract: bool) -> tuple:
        picked = [x for a, flags in zip(args, merged_in) if flags is not None
                  for x, m in zip(jax.tree.leaves(a), flags) if m]
        if abstract:
            new = [jax.ShapeDtypeStruct((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]), x.dtype,
                                        sharding=NamedSharding(self._mesh, sp)) for x, sp in zip(picked, merge_specs)]
        else:
            new = merge(picked) if picked else []
        it = iter(new)
        out = []
        for a, flags in zip(args, merged_in):
            if flags is None:
                out.append(a)
                continue
            leaves, treedef = jax.tree.flatten(a)
            out.append(jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, flags)]))
        return tuple(out)

    def __call__(self, *args: Any) -> Any:
        main, merge, split, merged_in, merge_specs, merged_out = self._prepared(args)
        outs = main(*self._merged_args(args, merged_in, merge, merge_specs, abstract=False))
        leaves, treedef = jax.tree.flatten(outs)
        picked = [x for x, m in zip(leaves, merged_out) if m]
        it = iter(split(picked) if picked else [])
        return jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, merged_out)])

    def lower(self, *args: Any) -> Any:
        """The step's program lowered for ``args`` (arrays or ``jax.ShapeDtypeStruct`` with shardings), merged."""
        main, merge, _, merged_in, merge_specs, _ = self._prepared(args)
        return main.lower(*self._merged_args(args, merged_in, merge, merge_specs, abstract=True))

    def _cache_size(self) -> int:
        return sum(main._cache_size() for main, *_ in self._cache.values())


def chunk_indices(worker_axis: str, size: int) -> jax.Array:
    """The device indices of a worker's ``size`` chunks, ``w * size + c`` (int32, shape ``(size,)``).

    Worker ``w`` is this worker's index on ``worker_axis``; chunk ``c`` is the
    part of its batch that device ``c`` of its host holds
    (:func:`build_sharded_step`): the index that device has over both axes
    of a 2-D mesh, which its key is folded with.
    """
    return collectives.worker_index(worker_axis) * size + jnp.arange(size, dtype=jnp.int32)


def constrain(x: Any, spec: P) -> Any:
    """``x`` laid out by ``spec`` over the mesh's automatic axes (``jax.lax.with_sharding_constraint``)."""
    return jax.lax.with_sharding_constraint(x, spec)


def fast_size(mesh: Mesh, fast: str | tuple) -> int:
    """The devices of one host: the size of the fast axis, or the product of the sizes of several."""
    return int(np.prod([mesh.shape[a] for a in fast_names(fast)], dtype=np.int64))


def on_shards(fn: Callable[..., Any], fast: str | tuple, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``fn`` on each device's shards: a ``jax.shard_map`` that makes ``fast`` manual inside :func:`build_sharded_step`.

    ``in_specs`` and ``out_specs`` are the leaves' own specs (without the
    worker axis; ``P()``: held whole by every device of the host).  ``fast``
    is one axis or a tuple of several, all made manual; a leaf whose sharding
    outside differs from its spec here is re-laid out by XLA at the boundary,
    inside the host.
    """
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(fast_names(fast)))


def per_device_value_and_grad(loss_fn: Callable[..., Any], fast: str, has_aux: bool,
                              grad_specs: Any = None) -> Callable[..., Any]:
    """The loss of every chunk of a worker's batch and the gradient of their mean, the parameters sharded or not.

    ``fn(params, chunks, *keys) -> ((losses, aux), grads)``: ``chunks`` and
    ``keys`` carry :func:`build_sharded_step`'s leading chunk axis (one chunk
    per device of the host); ``loss_fn(params, chunk[, key])`` runs on each
    under ``jax.vmap`` (``spmd_axis_name=fast``: chunk ``c`` on device ``c``),
    ``losses`` (and ``aux``) have the chunk axis leading, and ``grads`` (like
    ``params``) is the gradient of the chunks' mean loss: the host's mean
    gradient, as the replicated 2-D layout's fast-axis mean gives it, laid out
    by ``grad_specs`` (a tree of ``PartitionSpec`` like ``params``) when given.  Traced
    under :func:`compjax.collectives.uncounted`: the gathers and gradient
    reductions XLA inserts for it run inside the host and carry no payload.
    """
    def mean_loss(params, chunks, *keys):
        out = jax.vmap(lambda b, *k: loss_fn(params, b, *k))(chunks, *keys)
        losses, aux = out if has_aux else (out, None)
        return jnp.mean(losses), (losses, aux)

    def fn(params, chunks, *keys):
        with collectives.uncounted():
            grads, (losses, aux) = jax.grad(mean_loss, has_aux=True)(params, chunks, *keys)
            if grad_specs is not None:
                grads = jax.tree.map(lambda s, g: constrain(g, s), grad_specs, grads, is_leaf=_is_spec)
        return (losses, aux), grads

    return fn


def place_key(key: Any, mesh: Mesh) -> Any:
    """A step's key argument checked and placed whole on every device (``P()``).

    Raises:
      ValueError: ``key`` holds no PRNG key, or a leaf that is not one (typed or raw ``uint32[2]``).
    """
    if not jax.tree.leaves(key) or not all(workers.is_key(k) for k in jax.tree.leaves(key)):
        raise ValueError(f"key must be a PRNG key (jax.random.key(seed) or a raw uint32[2] key), got {key!r}")
    return put(key, NamedSharding(mesh, P()))


def keyed(jitted: Callable, mesh: Mesh) -> Callable:
    """``step(params, opt_state, batch, key)`` checking the key and placing it on every device (:func:`place_key`)."""
    def step(params, opt_state, batch, key):
        return jitted(params, opt_state, batch, place_key(key, mesh))

    step.lower = lambda params, opt_state, batch, key: jitted.lower(params, opt_state, batch, place_key(key, mesh))
    step.jitted = jitted
    return step


def per_tree(build: Callable[..., Callable]) -> tuple[Callable[..., Callable], Callable[[], int]]:
    """A cache of steps built per argument structure: ``(get(key, *args), cache_size())``.

    ``get(key, *args)`` returns ``build(*args)``, built once per hashable
    ``key`` (a tree structure, shapes, dtypes, shardings); ``cache_size()``
    sums the compilations of every step built, as ``jax.jit``'s ``_cache_size``.
    """
    cache: dict = {}

    def get(key: Any, *args: Any) -> Callable:
        if key not in cache:
            cache[key] = build(*args)
        return cache[key]

    return get, lambda: sum(f._cache_size() for f in cache.values())


def check_donatable(state: Any) -> None:
    """Refuse arrays that cannot be donated (XLA:CPU over several devices crashes on them rather than raising).

    Raises:
      ValueError: a leaf of ``state`` already donated (deleted), or the same array twice.
    """
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


def check_flags(**flags: Any) -> None:
    """Raise a ValueError naming the first flag (keyword) that is not True or False."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def gather_whole(leaves: Sequence, dims: Sequence, fast: str) -> list:
    """Each leaf whole: a shard (``dims`` entry an int) all-gathered over ``fast`` inside the host, else as it is.

    A leaf held whole is cast to varying over ``fast`` here, under
    :func:`compjax.collectives.uncounted`: the sum over the host's devices
    that its gradient takes (the transpose of that cast, an all-reduce inside
    the host) is then labelled compjax's in the audit, not a model's.
    """
    out = []
    for x, d in zip(leaves, dims):
        if d is not None:
            out.append(collectives.gather_shards(x, fast, d))
        elif jnp.issubdtype(jnp.result_type(x), jnp.floating):
            with collectives.uncounted():
                out.append(collectives.vary(x, fast_names(fast)))
        else:
            out.append(x)
    return out


def host_mean(grads: Sequence, size: int) -> list:
    """The host's mean gradient from the gradient with respect to the shards (or to whole leaves).

    Through the all-gather (:func:`gather_whole`: its transpose is a
    reduce-scatter) and through the implicit broadcast of a leaf held whole,
    the gradient is the sum over the host's ``size`` devices: divided by it.
    """
    return [g / jnp.asarray(size, g.dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g for g in grads]


#: Primitives that name a mesh axis but move nothing between devices.
NON_COMMUNICATING = frozenset({"pvary", "pcast", "axis_index"})


def crosses_axis(jaxpr: Any, axis_name: str) -> bool:
    """True when a collective over ``axis_name`` (any primitive naming it that moves data) is in ``jaxpr``.

    Walks the equations of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) and of
    every sub-jaxpr (``jit``, ``shard_map``, ``cond``, ``scan``, ``while``,
    custom derivatives): a compjax compressor's collectives, the model's own
    (sync BatchNorm) and the step's (``lax.pmean``) alike.  ``pvary`` and
    ``axis_index`` name the axis but send nothing.
    """
    def names(v: Any) -> tuple:
        return (v,) if isinstance(v, str) else tuple(x for x in v if isinstance(x, str)) \
            if isinstance(v, (tuple, list)) else ()

    def walk(j: Any) -> bool:
        j = getattr(j, "jaxpr", j)
        for eqn in j.eqns:
            if eqn.primitive.name not in NON_COMMUNICATING and any(
                    axis_name in names(eqn.params.get(k, ())) for k in ("axes", "axis_name")):
                return True
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(getattr(sub, "jaxpr", sub), "eqns") and walk(sub):
                        return True
        return False

    return walk(jaxpr)


def load_nnx():
    """``flax.nnx``, imported on first use: the pure-pytree API does not need Flax."""
    from flax import nnx

    return nnx


def is_graph_node(x: Any) -> bool:
    """True for a Flax NNX object (a graph node: ``nnx.Module``, ``nnx.Optimizer``, ...)."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return nnx.graph.is_graph_node(x)


def warn_no_exchange(tx: Any, builder: str, axis_name: str) -> None:
    """Warn (``UserWarning``) when ``tx`` holds no compjax compressor or algorithm: nothing crosses the workers.

    Such a step trains one model per worker without a word (a chain ported
    without its compressor).  Read from the chain's closures
    (:func:`compjax.compressors.chains.holds_exchange`) when the step is built.
    """
    if not chains.holds_exchange(tx):
        warnings.warn(
            f"{builder}: tx holds no compjax compressor or algorithm, so nothing crosses the worker axis "
            f"{axis_name!r} and each worker trains its own model. Put one first in the chain, e.g. "
            f"optax.chain(cj.identity(axis_name={axis_name!r}), ...) for the dense mean or cj.topk(0.01, "
            f"axis_name={axis_name!r}), or pass independent=True when independent workers are meant (local SGD)",
            UserWarning, stacklevel=3)
