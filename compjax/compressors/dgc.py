"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import bytecount, collectives, layout
from compjax._checks import check_range
from compjax.codecs import ordering
from compjax.codecs import random as cr
from compjax.codecs import select as csel
from compjax.codecs.sparse import layer_k, topk_select, zero_at
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.keys import as_key, step_stream
from compjax.compressors.sparsified import sparse_layers_mean, topk_on_shards

#: Densities of the four warm-up stages: sparsity 75%, 93.75%, 98.4375%, 99.6% (Lin et al., Sec. 3.4).
WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.00390625)


class DgcState(NamedTuple):
    """State of :func:`dgc`.

    Attributes:
      velocity: momentum ``u``, same tree/shapes/dtypes as the params.
      accumulator: gradient accumulation ``v`` (what was not sent yet), same tree.
      key: uint32 ``(2,)`` PRNG key of the threshold samples' starts, the same on every worker.
      count: int32 scalar, updates applied (drives the warm-up).
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``sum_layers k * (4 + itemsize)`` at that step's density, plus the
        dense vectors' bytes when ``sparsify_vectors=False``, plus 4 (the
        non-finite vote).
    """

    velocity: Any
    accumulator: Any
    key: jax.Array
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def dgc_stages(ratio: float, warmup_steps: int) -> tuple[tuple[int, float], ...]:
    """The static density stages of DGC's warm-up: ``((first step, density), ...)``.

    ``warmup_steps`` is split into four equal stages of density 25%, 6.25%,
    1.5625%, 0.390625% (each at least ``ratio``); from ``warmup_steps`` on the
    density is ``ratio``.  Stages of no steps and repeated densities are merged.

    Examples:
      >>> dgc_stages(0.001, 400)
      ((0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.00390625), (400, 0.001))
    """
    stages = [(-(-j * warmup_steps // 4), max(ratio, d)) for j, d in enumerate(WARMUP_DENSITIES)] if warmup_steps else []
    stages.append((warmup_steps, ratio))
    out: list[tuple[int, float]] = []
    for start, d in stages:
        if out and out[-1][0] == start:  # the stage before has no steps: drop it
            out.pop()
        if out and out[-1][1] == d:  # same density as the stage before: it goes on
            continue
        out.append((start, d))
    return tuple(out)


def _momentum(u: jnp.ndarray, g: jnp.ndarray, momentum, nesterov: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
    """DGC's momentum correction of one layer: ``(new u, what v accumulates)`` in ``u``'s dtype (Eq. 5)."""
    if nesterov:
        u = (momentum * (u + g)).astype(u.dtype)
        return u, (u + g).astype(u.dtype)
    u = (momentum * u + g).astype(u.dtype)
    return u, u


def _corrected(us: list, vs: list, gs: list, momentum, nesterov: bool, skip, count) -> tuple[list, list]:
    """``u <- m u + g`` and ``v <- v + u`` (Nesterov: as in :func:`_momentum`) of every layer, in place.

    Each layer is updated in a loop of one trip (none on a skipped step,
    ``skip`` true: ``u`` and ``v`` stay as they are) carrying ``(u, v)``: a
    loop's carry is written where it lies, so the new ``u`` and ``v`` go into
    the (donated) buffers of the old ones, and the passes after it (the
    selection's, the masking) read them there.  Computed as plain
    expressions, XLA fuses the new ``v`` into every pass that reads it and
    keeps the old ``u``, ``v`` and the gradient alive beside a copy of the
    new ones (a whole model's velocity and accumulation in float32 more).
    Each layer's loop starts after the one before ends (its trip count reads
    one entry of the previous ``v``): one layer's buffers in flight at a time.
    """
    trips = ordering.one_trip(count)  # 1, not known to the compiler: the loop stays
    if skip is not None:
        trips = jnp.where(skip, 0, trips)

    def step(g):
        def body(i, carry):
            u, v = carry
            # Through a barrier with the trip index: the gradient is read (and widened to u's dtype) inside the
            # loop's pass, not hoisted out of the loop as a float32 copy of it.
            x, _ = jax.lax.optimization_barrier((g, i))
            u, inc = _momentum(u, x, momentum, nesterov)
            return u, (v + inc).astype(v.dtype)

        return body

    out_u, out_v = [], []
    for u, v, g in zip(us, vs, gs):
        u, v = jax.lax.fori_loop(0, trips, step(g), (u, v))
        out_u.append(u)
        out_v.append(v)
        # The next layer's trip count waits for this layer's v (one word of it: always 0 added).
        trips = trips + ordering.zero_after(v).astype(jnp.int32)
    return out_u, out_v


def _stage_index(count: jnp.ndarray, stages) -> jnp.ndarray:
    starts = jnp.asarray([s for s, _ in stages[1:]], jnp.int32)
    return jnp.sum(count >= starts).astype(jnp.int32)


def _check(ratio, warmup_steps) -> None:
    check_range("ratio", ratio, 0.0, 1.0, lo_open=True, static=True)
    check_range("warmup_steps", warmup_steps, 0, None, integer=True, static=True)


def dgc_warmup_schedule(ratio: float = 0.001, warmup_steps: int = 0) -> optax.Schedule:
    """DGC's exponential sparsity warm-up as an optax schedule: step -> sparsity.

    Sparsity 75% -> 93.75% -> 98.4375% -> 99.6% over four equal stages of
    ``warmup_steps`` (density x1/4 per stage), then ``1 - ratio`` (99.9% for the
    default ratio) -- Lin et al., ICLR 2018, Sec. 3.4 ("warm-up training").
    Stages are at most as sparse as ``1 - ratio``.  :func:`dgc` sends
    ``k = max(1, ceil(density * size))`` entries per layer at each stage.

    Args:
      ratio: final density (kept fraction), in (0, 1].
      warmup_steps: steps of warm-up, an integer >= 0 (0: ``1 - ratio`` throughout).

    Returns:
      A callable ``count (int scalar) -> float32 sparsity``.

    Raises:
      ValueError: ``ratio`` outside (0, 1] or ``warmup_steps < 0``.

    Examples:
      >>> import compjax as cj
      >>> s = cj.dgc_warmup_schedule(0.001, 400)
      >>> [round(float(s(t)), 6) for t in (0, 100, 200, 300, 400)]
      [0.75, 0.9375, 0.984375, 0.996094, 0.999]
    """
    _check(ratio, warmup_steps)
    stages = dgc_stages(float(ratio), int(warmup_steps))
    sparsity = jnp.asarray([1.0 - d for _, d in stages], jnp.float32)

    def schedule(count):
        return sparsity[_stage_index(jnp.asarray(count), stages)]

    return schedule


def dgc(
    ratio: float = 0.001,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    clip_norm: float | None = None,
    warmup_steps: int = 0,
    sample_ratio: float | None = 0.01,
    momentum_masking: bool = True,
    sparsify_vectors: bool = True,
    key=0,
    skip_nonfinite: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """Deep Gradient Compression: momentum-corrected, clipped, masked top-k with warm-up.

    Chain it before a plain ``optax.sgd(lr)`` **without** momentum: DGC carries
    the momentum.  Per worker, with ``N`` workers and ``m = momentum`` (Lin et
    al., ICLR 2018, Sec. 3.2-3.4 and Algorithm 4)::

        g = g * min(1, clip_norm * N^(-1/2) / ||g||)   local gradient clipping (global norm)
        u = m * u + g;      v = v + u                  momentum correction (Eq. 5)
        (nesterov: u = m * (u + g); v = v + u + g,     as in the authors' code)
        send the k = max(1, ceil(density * size)) entries of largest |v| per layer
        v = v * ~mask;      u = u * ~mask              momentum factor masking (Sec. 3.3)
        output: mean over workers of the sent sparse v

    ``density`` follows :func:`dgc_warmup_schedule` (75% ... 99.6% sparsity over
    ``warmup_steps``, then ``1 - ratio``).  Shapes stay static: every stage is a
    branch of one ``lax.switch`` with its own static ``k`` per layer, so the
    compiled program holds one sparse exchange per stage and runs one per step.

    Selection: with ``sample_ratio`` the threshold is estimated from a strided
    sample of ``|v|`` with a random start (:func:`compjax.codecs.select.topk`:
    the threshold is moved until ``k`` to ``1.5 k + 64`` entries pass, then the
    exact ``k``-th magnitude among them is found -- exactly ``k`` entries, equal
    to exact top-k whenever the threshold settles; no sort of the layer); with
    ``sample_ratio=None``, exact ``jax.lax.top_k``.  The momentum correction
    and the accumulation update ``u`` and ``v`` in place, layer after layer
    (gradients in any float dtype, e.g. bfloat16, are widened to the state's
    dtype inside that pass: ``u`` and ``v`` keep the parameters' dtype); the
    selection's passes read the new ``v`` where it lies, masking writes zeros
    at the ``k`` indices, and each layer's mean is cast to its gradient's
    dtype as soon as it is summed.  Every layer is
    sparsified unless ``sparsify_vectors=False`` (the authors' code sends
    vectors dense).
    Indices and values travel in one int32 and one value all-gather per step
    (:mod:`compjax.compressors.sparsified`).

    ``ratio``, ``warmup_steps`` and ``sample_ratio`` fix shapes (list them in
    ``static_args`` of ``optax.inject_hyperparams``); ``momentum`` and
    ``clip_norm`` may be traced.

    Args:
      ratio: final density per layer, in (0, 1] (0.001: 99.9% sparsity).
      momentum: ``m`` in [0, 1).
      nesterov: Nesterov momentum correction.
      clip_norm: global-norm clipping threshold before scaling by ``N^(-1/2)``
        (positive), or None for no clipping.
      warmup_steps: steps of sparsity warm-up, integer >= 0.
      sample_ratio: fraction of ``|v|`` sampled for the threshold, in (0, 1], or
        None for exact top-k.
      momentum_masking: zero ``u`` where entries were sent (``v`` is always zeroed there).
      sparsify_vectors: sparsify every layer (default).  False follows the
        authors' code: leaves with ``ndim <= 1`` (biases, norm scales) skip the
        accumulation and send their momentum-corrected gradient (``u``, or
        ``u + g`` with Nesterov) dense, in one extra all-reduce.
      key: int seed, typed key or raw uint32 key of the samples' random starts,
        the same on every worker (drawn from the stream of the step and the
        worker index, :mod:`compjax.codecs.random`).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`):
        velocity and accumulation stay untouched on a skipped step.
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update`` takes local gradients
      and returns the averaged sparse ``v`` (same tree, shapes, dtypes).

    Raises:
      ValueError: ``ratio`` outside (0, 1], ``momentum`` outside [0, 1),
        ``sample_ratio`` outside (0, 1], ``warmup_steps < 0``, ``clip_norm <= 0``
        or a bad ``key`` (build time); a gradient tree that does not match the
        state (trace time).

    References:
      Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the
      Communication Bandwidth for Distributed Training", ICLR 2018;
      reference code github.com/synxlin/deep-gradient-compression.

    Examples:
      >>> import optax, compjax as cj
      >>> tx = optax.chain(cj.dgc(0.001, momentum=0.9, warmup_steps=400, axis_name="data"), optax.sgd(0.1))
    """
    _check(ratio, warmup_steps)
    check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
    if sample_ratio is not None:
        check_range("sample_ratio", sample_ratio, 0.0, 1.0, lo_open=True, static=True)
        sample_ratio = float(sample_ratio)
    if clip_norm is not None:
        check_range("clip_norm", clip_norm, 0.0, None, lo_open=True)
    stages = dgc_stages(float(ratio), int(warmup_steps))
    key0 = as_key(key)

    def init_fields(xs):
        return {"velocity": [jnp.zeros_like(x) for x in xs], "accumulator": [jnp.zeros_like(x) for x in xs],
                "key": jnp.array(key0)}

    def exchange(gs, fields, ctx):
        sh = ctx.shards
        if clip_norm is not None:
            bound = clip_norm / math.sqrt(collectives.num_workers(ctx.axis_name))
            if sh is None:
                norm = optax.tree.norm(gs)
            else:  # the layers' squares: the shards' summed over the fast axis
                whole = [x for i, x in enumerate(gs) if sh.dims[i] is None]
                cut = [x for i, x in enumerate(gs) if sh.dims[i] is not None]
                norm = jnp.sqrt(optax.tree.norm(whole, squared=True)
                                + collectives.sum_over_fast(optax.tree.norm(cut, squared=True)))
            scale = jnp.where(norm > bound, bound / jnp.where(norm > 0, norm, 1.0), 1.0)
            gs = [x * scale.astype(x.dtype) for x in gs]
        us, vs = list(fields["velocity"]), list(fields["accumulator"])
        skip = ctx.skip
        sparse = [i for i, x in enumerate(gs) if sparsify_vectors or x.ndim > 1]
        dense = [i for i, x in enumerate(gs) if not (sparsify_vectors or x.ndim > 1)]
        # Vectors sent dense (authors' code): the momentum-corrected gradient, all-reduced; nothing accumulates.
        incs = {}
        for i in dense:
            u, incs[i] = _momentum(us[i], gs[i], momentum, nesterov)
            if skip is not None:  # a skipped step keeps u (in the pass that computes it) and sends zeros
                u, incs[i] = jnp.where(skip, us[i], u), jnp.where(skip, jnp.zeros_like(incs[i]), incs[i])
            us[i] = u
        dense_means, dense_bytes = collectives.dense_mean_arrays(
            [incs[i] for i in dense], ctx.axis_name, shards=None if sh is None else [sh.dims[i] is not None for i in dense])
        # u and v of the sparsified layers are updated in place, one layer after the other (no step copies them).
        us_sparse, vs_sparse = _corrected([us[i] for i in sparse], [vs[i] for i in sparse],
                                          [gs[i] for i in sparse], momentum, nesterov, skip, ctx.count)
        st = step_stream(fields["key"], ctx.count, ctx.axis_name)

        cut = None if sh is None else layout.Shards(sh.axis, tuple(sh.dims[i] for i in sparse))

        def stage(density):
            def select_all(xs):
                if cut is not None:  # the layers' exact top-k from the shards' candidates
                    ks = [layer_k(math.prod(cut.whole_shape(x, i)), density) for i, x in enumerate(xs)]
                    return topk_on_shards(xs, ks, cut, sample_ratio=sample_ratio or 0.01)
                ks = [layer_k(x.size, density) for x in xs]
                if sample_ratio is None:
                    return [topk_select(x, k) for x, k in zip(xs, ks)]
                starts = [(cr.bits(st, jnp.uint32(sparse[i])) >> jnp.uint32(1)).astype(jnp.int32)
                          for i in range(len(xs))]
                return csel.topk_many(xs, ks, sample_ratio=sample_ratio, starts=starts)

            def run(us, vs):
                # The means in the gradients' dtypes, each cast as soon as it is summed (one float32 sum at a time).
                means, indices, nbytes = sparse_layers_mean(vs, None, ctx.axis_name, select_all=select_all, skip=skip,
                                                            shards=cut, dtypes=[gs[i].dtype for i in sparse])
                if skip is not None:  # nothing was sent: indices past the end leave u and v as they are
                    indices = [jnp.where(skip, x.size, i) for x, i in zip(vs, indices)]
                # The masking writes into v's buffer: it waits for the layer's mean (made from the values read from
                # v), so that XLA needs no copy of v to read the values from.
                indices = [i + ordering.zero_after(m).astype(i.dtype) for i, m in zip(indices, means)]
                new_vs = [zero_at(x, i) for x, i in zip(vs, indices)]
                new_us = [zero_at(x, i) for x, i in zip(us, indices)] if momentum_masking else us
                out = (means, new_us, new_vs)
                # Every branch returns the types of the first one (lax.switch needs equal types).
                return collectives.match_varying(out, (vs, us, vs)), bytecount.constant(nbytes)

            return run

        if len(stages) == 1:
            (means, us_sparse, vs_sparse), nbytes = stage(stages[0][1])(us_sparse, vs_sparse)
        else:
            branches = [stage(d) for _, d in stages]
            (means, us_sparse, vs_sparse), nbytes = jax.lax.switch(
                _stage_index(ctx.count, stages), branches, us_sparse, vs_sparse
            )
        out = [None] * len(gs)
        us, vs = list(us), list(vs)
        for j, i in enumerate(sparse):
            out[i], us[i], vs[i] = means[j], us_sparse[j], vs_sparse[j]
        for j, i in enumerate(dense):
            out[i] = dense_means[j]
        return Exchanged(out, None, {"velocity": us, "accumulator": vs}, bytecount.add(nbytes, dense_bytes))

    return compressor(
        DgcState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, init_fields=init_fields,
        tree_fields=("velocity", "accumulator"), honours_skip=True, on_shards=True,
    )
