"""PowerSGD: rank-r gradient compression by one power iteration per step.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019, Algorithms 1 and 2.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax._checks import check_range, check_same_tree
from compjax.codecs.lowrank import from_matrix, matrix_shape, to_matrix, use_lowrank
from compjax.collectives import AxisName
from compjax.compressors import error_feedback as ef


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    Attributes:
      count: int32 scalar, number of updates done.
      q: tuple with one ``(rest, r)`` query matrix per compressed leaf, in leaf
        order (the same on every worker; warm start).
      residual: error-feedback memory, same tree as the params (None when
        ``error_feedback=False``).  Zero for leaves that go dense.
      payload_bytes: int32 scalar, bytes this worker put into collectives in the
        last step.
    """

    count: jnp.ndarray
    q: tuple
    residual: Any
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


def _random_qs(key, shapes, lowrank, ranks, dtypes):
    qs = []
    for j, (i, r) in enumerate(zip(lowrank, ranks)):
        _, n = matrix_shape(tuple(shapes[i]))
        qs.append(jax.random.normal(jax.random.fold_in(key, j), (n, r), dtypes[i]))
    return tuple(qs)


def powersgd(
    rank: int = 2,
    *,
    start_step: int = 0,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    error_feedback: bool = True,
    key: int = 0,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """Rank-``rank`` PowerSGD mean of local gradients with error feedback.

    For each leaf of ndim >= 2, viewed as the ``(out, rest)`` matrix (flax
    kernels are ``(..., in, out)``; ``rest = prod(shape[:-1])``), Algorithm 1 of
    Vogels et al. with the error feedback of Algorithm 2::

        M = g + e                      (e: this worker's residual)
        P = M Q;      P <- mean over workers (all-reduce; all leaves in one bucket)
        P̂ = orthonormalize(P)          (Gram-Schmidt)
        Q = Mᵀ P̂;     Q <- mean over workers (all-reduce; one bucket)
        output = P̂ Qᵀ                  (the same on every worker)
        e = M - output                 (each worker's own M against the mean)

    Q is kept for the next step (warm start) or redrawn from ``(key, step)``.
    Vectors, scalars and matrices with ``(m + n) r min_compression_rate >= m n``
    go dense through one bucketed all-reduce.  The first ``start_step`` updates
    are a dense mean of the raw gradients (no residual), as PyTorch's
    ``start_powerSGD_iter``.  A step issues at most 3 collectives.

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
      key: integer seed of the initial (and redrawn) Q, the same on every worker.
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update`` takes local gradients
      and returns the averaged low-rank approximation (same tree, shapes, dtypes).

    Raises:
      ValueError: ``rank < 1``, ``start_step < 0``, ``min_compression_rate < 0``
        (at build time); a gradient tree that does not match the state (trace time).

    References:
      Vogels et al., NeurIPS 2019, Algorithms 1-2; PyTorch
      ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.

    Examples:
      >>> import optax, compjax as cj
      >>> tx = optax.chain(cj.powersgd(rank=2, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    """
    check_range("rank", rank, 1, None, integer=True)
    check_range("start_step", start_step, 0, None, integer=True)
    check_range("min_compression_rate", min_compression_rate, 0.0, None)
    rank, start_step = int(rank), int(start_step)
    base_key = jax.random.PRNGKey(int(key))

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        shapes = [x.shape for x in leaves]
        lowrank, ranks, _ = _plan(shapes, rank, min_compression_rate)
        qs = _random_qs(base_key, shapes, lowrank, ranks, [x.dtype for x in leaves])
        residual = ef.init_residual(params) if error_feedback else None
        return PowerSGDState(
            count=jnp.zeros((), jnp.int32), q=qs, residual=residual, payload_bytes=jnp.zeros((), jnp.int32)
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        if error_feedback:
            check_same_tree(updates, state.residual, "residual")
        leaves, treedef = jax.tree.flatten(updates)
        shapes = [x.shape for x in leaves]
        lowrank, ranks, dense = _plan(shapes, rank, min_compression_rate)
        if len(state.q) != len(lowrank):
            raise ValueError(
                f"the gradient tree has {len(lowrank)} compressible matrices but the state holds "
                f"{len(state.q)} Q's: it was built by init for another tree"
            )
        count = state.count

        def compressed(_):
            acc = jax.tree.leaves(ef.accumulate(state.residual, updates))
            if warm_start:
                qs = state.q
            else:
                qs = _random_qs(
                    jax.random.fold_in(base_key, count), shapes, lowrank, ranks, [x.dtype for x in leaves]
                )
            mats = [to_matrix(acc[i]) for i in lowrank]
            outs, new_qs, b_lr = collectives.lowrank_mean(mats, list(qs), axis_name)
            dense_out, b_d = collectives.dense_mean_arrays([acc[i] for i in dense], axis_name)
            out = [None] * len(leaves)
            for i, o in zip(lowrank, outs):
                out[i] = from_matrix(o, shapes[i]).astype(leaves[i].dtype)
            for i, o in zip(dense, dense_out):
                out[i] = o
            residual = state.residual
            if error_feedback:
                # Dense leaves were sent whole: nothing remains.
                decoded = [out[i] if i in set(lowrank) else acc[i] for i in range(len(leaves))]
                residual = ef.remainder(jax.tree.unflatten(treedef, acc), jax.tree.unflatten(treedef, decoded))
            # Match the state's types so both branches of the start_step cond agree.
            new_qs = tuple(collectives.like_varying(q.astype(o.dtype), o) for q, o in zip(new_qs, state.q))
            return out, new_qs, residual, b_lr + b_d

        def uncompressed(_):
            out, nbytes = collectives.dense_mean_arrays(leaves, axis_name)
            return out, tuple(state.q), state.residual, nbytes

        if start_step == 0:
            out, qs, residual, nbytes = compressed(None)
            nbytes = jnp.asarray(nbytes, jnp.int32)
        else:
            def branch(fn):
                def run(_):
                    o, q, r, b = fn(None)
                    return o, q, r, jnp.asarray(b, jnp.int32)
                return run

            out, qs, residual, nbytes = jax.lax.cond(
                count < start_step, branch(uncompressed), branch(compressed), None
            )
        new_state = PowerSGDState(count=count + 1, q=qs, residual=residual, payload_bytes=nbytes)
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
