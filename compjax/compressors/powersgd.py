"""PowerSGD: rank-r gradient compression by one power iteration per step.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019, Algorithms 1 and 2.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import bytecount, collectives
from compjax._checks import check_range
from compjax.codecs import ordering
from compjax.codecs.lowrank import (
    back_project,
    matrix_shape,
    orthonormalize,
    project,
    reconstruct,
    use_lowrank,
)
from compjax.collectives import AxisName
from compjax.compressors import error_feedback as ef
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.keys import as_key


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    Attributes:
      q: tuple with one float32 ``(rest, r)`` query matrix per compressed leaf,
        in leaf order (the same on every worker; warm start).
      residual: error-feedback memory, same tree as the params (None when
        ``error_feedback=False``).  Zero for leaves that go dense.
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step (P, Q and the
        dense leaves' all-reduces, + 4 for the non-finite vote).
    """

    q: tuple
    residual: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def _plan(shapes, rank, min_compression_rate):
    """Static split of leaf indices into low-rank and dense, with each rank."""
    lowrank, ranks = [], []
    for i, s in enumerate(shapes):
        if use_lowrank(tuple(s), rank, min_compression_rate):
            m, n = matrix_shape(tuple(s))
            lowrank.append(i)
            ranks.append(min(rank, m, n))
    dense = [i for i in range(len(shapes)) if i not in set(lowrank)]
    return lowrank, ranks, dense


def _random_qs(key, shapes, lowrank, ranks):
    qs = []
    for j, (i, r) in enumerate(zip(lowrank, ranks)):
        _, n = matrix_shape(tuple(shapes[i]))
        qs.append(jax.random.normal(jax.random.fold_in(key, j), (n, r), jnp.float32))
    return tuple(qs)


def _batched(fn, mats):
    """Apply ``fn`` to ``(..., a, b)`` stacks of same-shape matrices; results in input order."""
    groups: dict[tuple, list[int]] = {}
    for j, x in enumerate(mats):
        groups.setdefault(tuple(x.shape), []).append(j)
    out = [None] * len(mats)
    for idxs in groups.values():
        y = fn(jnp.stack([mats[j] for j in idxs]))
        for b, j in enumerate(idxs):
            out[j] = y[b]
    return out


def powersgd(
    rank: int = 2,
    *,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    error_feedback: bool = True,
    key=0,
    skip_nonfinite: bool = True,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """Rank-``rank`` PowerSGD mean of local gradients with error feedback.

    For each leaf of ndim >= 2, viewed as the ``(out, rest)`` matrix (flax
    kernels are ``(..., in, out)``; ``rest = prod(shape[:-1])``), Algorithm 1 of
    Vogels et al. with the error feedback of Algorithm 2, in float32::

        M = g + e                      (e: this worker's residual)
        Q̂ = orthonormalize(Q)          (the warm-started Q, as PyTorch's hook does)
        P = M Q̂;      P <- mean over workers (all-reduce; all leaves in one bucket)
        P̂ = orthonormalize(P)
        Q = Mᵀ P̂;     Q <- mean over workers (all-reduce; one bucket)
        output = P̂ Qᵀ                  (the same on every worker)
        e = M - output                 (each worker's own M against the mean)

    Orthonormalization (:func:`compjax.codecs.lowrank.orthonormalize`, batched
    over same-shape matrices): Gram-Schmidt at rank 1, Householder QR above, so
    float32 stays close to float64 when the singular values span orders of
    magnitude.  Q is kept for the next step (warm start) or redrawn from
    ``(key, step)``.  Vectors, scalars and matrices with
    ``(m + n) r min_compression_rate >= m n`` go dense through one bucketed
    all-reduce.  The first ``start_step`` updates are a dense mean of the raw
    gradients (the residual stays zero), as PyTorch's ``start_powerSGD_iter``.
    A step issues at most 3 collectives, plus the non-finite vote.

    The rank used for a leaf is ``min(rank, m, n)``; with ``rank >= min(m, n)``
    the output equals the dense mean.

    Args:
      rank: approximation rank r, an integer >= 1.
      start_step: number of initial dense steps, an integer >= 0.  With
        ``start_step > 0`` the compiled program holds both paths in a
        ``lax.cond`` (the audit then lists both paths' collectives).
      min_compression_rate: compress a matrix only if its rate
        ``m n / ((m + n) r)`` exceeds this, a number >= 0.
      warm_start: reuse last step's averaged Q (else redraw it every step).
      error_feedback: keep ``M - output`` and add it next step.
      key: int seed, typed key (``jax.random.key``) or raw uint32 key of the
        initial (and redrawn) Q, the same on every worker.
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`):
        Q and the residual stay untouched on a skipped step.
      axis_name: worker axis, or None for one worker.

    ``rank``, ``start_step`` and ``min_compression_rate`` fix shapes: with
    ``optax.inject_hyperparams``, list them in ``static_args``.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update`` takes local gradients
      and returns the averaged low-rank approximation (same tree, shapes, dtypes).

    Raises:
      ValueError: ``rank < 1``, ``start_step < 0``, ``min_compression_rate < 0``
        or a bad ``key`` (at build time); a gradient tree that does not match the
        state (trace time).

    References:
      Vogels et al., NeurIPS 2019, Algorithms 1-2; PyTorch
      ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.

    Examples:
      >>> import optax, compjax as cj
      >>> tx = optax.chain(cj.powersgd(rank=2, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    """
    check_range("rank", rank, 1, None, integer=True, static=True)
    check_range("start_step", start_step, 0, None, integer=True, static=True)
    check_range("min_compression_rate", min_compression_rate, 0.0, None, static=True)
    rank, start_step, min_compression_rate = int(rank), int(start_step), float(min_compression_rate)
    base_key = as_key(key)

    def init_fields(xs):
        shapes = [x.shape for x in xs]
        lowrank, ranks, _ = _plan(shapes, rank, min_compression_rate)
        return {"q": _random_qs(base_key, shapes, lowrank, ranks)}

    def exchange(ps, fields, ctx):
        grads = list(ps)
        sh = ctx.shards
        shapes = [x.shape if sh is None else sh.whole_shape(x, i) for i, x in enumerate(ps)]
        lowrank, ranks, dense = _plan(shapes, rank, min_compression_rate)
        old_q = fields["q"]
        if len(old_q) != len(lowrank):
            raise ValueError(
                f"the gradient tree has {len(lowrank)} compressible matrices but the state holds "
                f"{len(old_q)} Q's: it was built by init for another tree"
            )
        # On shards (the matrix view M is (out, rest)): a leaf cut along its last dimension holds rows of M
        # ("out"; Q whole), along another one columns of M ("rest"; Q's rows cut along the same dimension, and
        # the state holds a block of Q's rows, as the fast axis lays it out).
        cut = {i: None if sh is None or sh.dims[i] is None else
               ("out" if sh.dims[i] == len(shapes[i]) - 1 else "rest") for i in lowrank}
        sharded = [sh is not None and sh.dims[i] is not None for i in range(len(ps))]

        bad = ctx.skip
        es = fields["residual"]
        trips = ordering.one_trip(ctx.count)
        if es is None:  # no memory: the gradients as they are (zeros on a skipped step: all stays finite)
            ps = list(ps) if bad is None else [jnp.where(bad, jnp.zeros_like(x), x) for x in ps]
        else:  # M = g + e, in place of e for the matrices (a skipped step exchanges the finite residual alone)
            low = set(lowrank)
            ps = [_accumulated(e, g, bad, trips if i in low else None) for i, (e, g) in enumerate(zip(es, ps))]

        def compressed(_):
            if warm_start:
                qs = [collectives.gather_inside_host(q, sh.axis, 0) if cut[i] == "rest" else q
                      for i, q in zip(lowrank, old_q)]
            else:
                qs = _random_qs(jax.random.fold_in(base_key, ctx.count), shapes, lowrank, ranks)
            mats = [ps[i].astype(jnp.float32) for i in lowrank]  # matrix views M (codecs.lowrank)
            qs = _batched(orthonormalize, list(qs))
            p_loc = []
            for i, m, q in zip(lowrank, mats, qs):  # M Q
                if cut[i] == "out":  # this shard's rows of P, the host's rows gathered: P exactly
                    p_loc.append(collectives.gather_inside_host(project(m, q), sh.axis, 0))
                elif cut[i] == "rest":  # M_f Q_f summed over the host's shards
                    p_loc.append(collectives.sum_over_fast(project(m, _rest_rows(q, shapes[i], sh, i))))
                else:
                    p_loc.append(project(m, q))
            p_mean, p_bytes = collectives.dense_mean_arrays(p_loc, ctx.axis_name)
            p_hat = _batched(orthonormalize, p_mean)
            q_loc = []
            for i, m, p in zip(lowrank, mats, p_hat):  # Mᵀ P̂
                if cut[i] == "out":  # M_fᵀ P̂_f summed over the host's shards
                    q_loc.append(collectives.sum_over_fast(back_project(m, _own_rows(p, sh))))
                elif cut[i] == "rest":  # this shard's rows of Q, the host's rows gathered in Q's order
                    q_f = back_project(m, p).reshape(tuple(ps[i].shape[:-1]) + (p.shape[-1],))
                    q_loc.append(collectives.gather_inside_host(q_f, sh.axis, sh.dims[i]).reshape(-1, p.shape[-1]))
                else:
                    q_loc.append(back_project(m, p))
            q_mean, q_bytes = collectives.dense_mean_arrays(q_loc, ctx.axis_name)
            dense_out, d_bytes = collectives.dense_mean_arrays([ps[i] for i in dense], ctx.axis_name,
                                                               shards=[sharded[i] for i in dense])
            out = [None] * len(ps)
            new_e = None if es is None else list(es)
            for i, p, q in zip(lowrank, p_hat, q_mean):
                if cut[i] == "out":
                    p = _own_rows(p, sh)
                elif cut[i] == "rest":
                    q = _rest_rows(q, shapes[i], sh, i)
                # P̂ Qᵀ, and e = M - P̂ Qᵀ in place of M: one layer's product at a time.
                out[i], e = _decoded(p, q, ps[i], grads[i], bad, trips, es is not None)
                if new_e is not None:
                    new_e[i] = e
            for i, o in zip(dense, dense_out):  # dense leaves were sent whole: nothing remains of them
                out[i] = o if bad is None else jnp.where(bad, jnp.zeros_like(o), o)
                if new_e is not None:
                    new_e[i] = jnp.zeros_like(ps[i]) if bad is None else jnp.where(bad, ps[i], jnp.zeros_like(ps[i]))
            new_q = tuple(_own_rows(q, sh) if cut[i] == "rest" else q for i, q in zip(lowrank, q_mean))
            if bad is not None:
                new_q = tuple(jnp.where(bad, o, n) for o, n in zip(old_q, new_q))
            out = [o.astype(g.dtype) for o, g in zip(out, grads)]  # both branches: the gradients' dtypes
            result = (out, new_e, new_q)
            return collectives.match_varying(result, (grads, es, old_q)), bytecount.constant(p_bytes + q_bytes + d_bytes)

        def uncompressed(_):
            out, nbytes = collectives.dense_mean_arrays(ps, ctx.axis_name, shards=sharded)
            if bad is not None:
                out = [jnp.where(bad, jnp.zeros_like(o), o) for o in out]
            # M was sent whole (on a skipped step M is e, which stays).
            new_e = None if es is None else [jnp.zeros_like(p) if bad is None else jnp.where(bad, p, jnp.zeros_like(p))
                                             for p in ps]
            out = [o.astype(g.dtype) for o, g in zip(out, grads)]  # both branches: the gradients' dtypes
            result = (out, new_e, tuple(old_q))
            return collectives.match_varying(result, (grads, es, old_q)), bytecount.constant(nbytes)

        if start_step == 0:
            (out, new_e, qs), nbytes = compressed(None)
        else:
            (out, new_e, qs), nbytes = jax.lax.cond(ctx.count < start_step, uncompressed, compressed, None)
        out = [o.astype(g.dtype) for o, g in zip(out, grads)]
        changed = {"q": qs} if new_e is None else {"q": qs, "residual": new_e}
        # What this worker sent, as decoded: the approximation from the averaged factors; M for a dense leaf.
        sent = [ps[i] if i in set(dense) else o for i, o in enumerate(out)]
        return Exchanged(out, sent, changed, nbytes)

    return compressor(  # the exchange keeps the residual itself: in place, one layer's product at a time
        PowerSGDState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=False,
        residual_in_exchange=error_feedback, init_fields=init_fields, on_shards=True, honours_skip=True,
    )


def _accumulated(e: jnp.ndarray, g: jnp.ndarray, bad, trips) -> jnp.ndarray:
    """``M = e + g`` (``e`` on a skipped step) in ``e``'s dtype, written in place of ``e``.

    A loop of one trip carrying ``e``: its carry is written where it lies, so
    ``M`` takes the (donated) residual's buffer and the products read it there
    (computed as an expression, XLA writes ``M`` to a buffer of its own or
    recomputes it in every pass).  The gradient goes through a barrier with
    the trip index, so that its widening to ``e``'s dtype stays inside the
    loop's pass (not a copy hoisted out of the loop).  With ``trips=None``
    (small leaves), a plain expression.
    """
    def body(i, e):
        x = g if trips is None else jax.lax.optimization_barrier((g, i))[0]
        (m,) = ef.accumulate([e], [x])
        return m if bad is None else jnp.where(bad, e, m)

    return body(0, e) if trips is None else jax.lax.fori_loop(0, trips, body, e)


def _decoded(p, q, m, g, bad, trips, feedback: bool):
    """``(P̂ Qᵀ in g's dtype, M - P̂ Qᵀ)`` of one layer, the product made inside one pass over the layer.

    A loop of one trip carrying ``M`` (the residual's buffer) and ``g``
    (the gradient's buffer, which nothing reads any more): the product
    ``Q P̂ᵀ`` is a temporary of the loop's body, so one layer's product
    exists at a time, and the residual and the output are written in place
    of ``M`` and of the gradient.  ``P̂`` goes through a barrier with the trip
    index so that the product is not hoisted out of the loop.  On a skipped
    step (``bad``) the output is zeros and the residual stays ``M`` (which
    then is ``e``).  Without ``feedback`` the returned residual is ``m``;
    with ``trips=None``, no loop: the same values as plain expressions.
    """
    def body(i, carry):
        e, o = carry if feedback else (None, carry)
        pp, _ = jax.lax.optimization_barrier((p, i))
        r = reconstruct(pp, q, m.shape)
        out = collectives.like_varying(r.astype(o.dtype), o)  # typed as the carry (the gradient varies per worker)
        if bad is not None:
            out = jnp.where(bad, jnp.zeros_like(out), out)
        if not feedback:
            return out
        (new,) = ef.remainder([e], [r])
        new = collectives.like_varying(new, e)
        return (new if bad is None else jnp.where(bad, e, new)), out

    if trips is None:  # as expressions, not in place
        res = body(0, (m, g) if feedback else g)
        return (res[1], res[0]) if feedback else (res, m)
    if not feedback:
        return jax.lax.fori_loop(0, trips, body, g), m
    e, o = jax.lax.fori_loop(0, trips, body, (m, g))
    return o, e


def _rest_rows(q: jnp.ndarray, shape: tuple, sh, i: int) -> jnp.ndarray:
    """The rows of the layer's ``(rest, r)`` factor ``q`` that belong to leaf ``i``'s shard (its columns of M)."""
    r = q.shape[-1]
    return sh.own(q.reshape(tuple(shape[:-1]) + (r,)), i).reshape(-1, r)


def _own_rows(q: jnp.ndarray, sh) -> jnp.ndarray:
    """This device's block of the rows of ``q`` (the fast axis's layout of the state's Q; a row shard's rows of P)."""
    per = q.shape[0] // sh.fast()
    return jax.lax.dynamic_slice_in_dim(q, jax.lax.axis_index(sh.axis).astype(jnp.int32) * per, per, axis=0)
