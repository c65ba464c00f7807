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

The same code runs under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp

from compjax.codecs.bucket import make_bucket
from compjax.codecs.lowrank import orthonormalize

AxisName = Hashable | None

__all__ = [
    "dense_mean",
    "dense_mean_arrays",
    "gathered_mean",
    "like_varying",
    "lowrank_mean",
    "max_over_workers",
    "num_workers",
    "sparse_mean",
    "worker_index",
]


def _nbytes(x: jnp.ndarray) -> int:
    return int(x.size) * jnp.dtype(x.dtype).itemsize


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


def _varying_axes(x) -> frozenset:
    """Manual axes over which ``x`` is typed as varying (JAX 0.10: ``manual_axis_type.varying``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))  # older JAX spelling


def like_varying(x: jnp.ndarray, like: jnp.ndarray) -> jnp.ndarray:
    """Type ``x`` as varying over the manual axes over which ``like`` varies (no data moves).

    Under ``shard_map``'s varying-axes checks, a mean that came out of a
    collective is invariant while state passed in with ``P(axis)`` is varying;
    the two branches of a ``lax.cond`` must agree, so the invariant one is cast
    (``jax.lax.pcast(..., to="varying")``).  Elsewhere (pmap, vmap, no axis) this
    returns ``x`` unchanged.
    """
    want, have = _varying_axes(like), _varying_axes(x)
    missing = tuple(sorted(set(want) - set(have), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def dense_mean(x: jnp.ndarray, axis_name: AxisName, *, prescale: bool = False) -> tuple[jnp.ndarray, int]:
    """Mean of ``x`` over workers with one all-reduce (``psum`` then ``/ n``).

    Args:
      x: this worker's array, any shape and float dtype.
      axis_name: worker axis, or None for one worker.
      prescale: divide by ``n`` before the sum instead of after, so a sum in a
        narrow dtype (float16) cannot overflow: ``|sum_i x_i / n| <= max_i |x_i|``.

    Returns:
      ``(mean, payload_bytes)``: the mean, same shape and dtype as ``x``, and
      ``x.size * itemsize`` bytes (the all-reduce operand).
    """
    if axis_name is None:
        return x, _nbytes(x)
    n = jnp.asarray(num_workers(axis_name), x.dtype)
    if prescale:
        return jax.lax.psum(x / n, axis_name), _nbytes(x)
    return jax.lax.psum(x, axis_name) / n, _nbytes(x)


def dense_mean_arrays(
    arrays: Sequence[jnp.ndarray], axis_name: AxisName, *, prescale: bool = False
) -> tuple[list[jnp.ndarray], int]:
    """Mean over workers of several arrays, bucketed: one all-reduce per dtype.

    The arrays are raveled into one flat buffer per dtype (usually one), reduced
    with :func:`dense_mean` and split back.

    Args:
      arrays: this worker's arrays, any shapes; an empty sequence issues nothing.
      axis_name: worker axis, or None.
      prescale: as in :func:`dense_mean`.

    Returns:
      ``(means, payload_bytes)``: the means in the input order and shapes, and
      the total bytes of the all-reduce operands.
    """
    out: list[jnp.ndarray | None] = [None] * len(arrays)
    total = 0
    by_dtype: dict[jnp.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(jnp.dtype(a.dtype), []).append(i)
    for idxs in by_dtype.values():
        bucket = make_bucket([arrays[i].shape for i in idxs])
        mean, nbytes = dense_mean(bucket.flatten([arrays[i] for i in idxs]), axis_name, prescale=prescale)
        total += nbytes
        for i, m in zip(idxs, bucket.unflatten(mean)):
            out[i] = m
    return out, total  # type: ignore[return-value]


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
    """
    if indices.shape != values.shape or indices.ndim != 1:
        raise ValueError(
            f"indices and values must be 1-D of the same shape, got {indices.shape} and {values.shape}"
        )
    nbytes = _nbytes(indices) + _nbytes(values)
    if axis_name is not None:
        n = num_workers(axis_name)
        indices = jax.lax.all_gather(indices, axis_name).reshape(-1)
        values = jax.lax.all_gather(values, axis_name).reshape(-1)
    else:
        n = 1
    dense = jnp.zeros((size,), values.dtype).at[indices].add(values)
    return dense / jnp.asarray(n, values.dtype), nbytes


def lowrank_mean(
    matrices: Sequence[jnp.ndarray], qs: Sequence[jnp.ndarray], axis_name: AxisName
) -> tuple[list[jnp.ndarray], list[jnp.ndarray], int]:
    """PowerSGD's low-rank mean of matrices: two bucketed all-reduces (P, then Q).

    Vogels et al., NeurIPS 2019, Algorithm 1 (one power iteration per step)::

        P_i = M_i Q           all-reduce-mean  P = mean_i P_i
        P̂  = orthonormalize(P)
        Q_i = M_iᵀ P̂          all-reduce-mean  Q = mean_i Q_i
        output = P̂ Qᵀ  (= P̂ P̂ᵀ mean_i M_i, the same on every worker)

    All P's of the call share one all-reduce and all Q's another.

    Args:
      matrices: this worker's ``(m_j, n_j)`` matrices.
      qs: the ``(n_j, r_j)`` query matrices, the same on every worker
        (``r_j <= min(m_j, n_j)``).
      axis_name: worker axis, or None.

    Returns:
      ``(outputs, new_qs, payload_bytes)``: the ``(m_j, n_j)`` rank-``r_j``
      approximations of the mean, the averaged ``(n_j, r_j)`` Q's (to warm-start
      the next step) and the bytes of both all-reduce operands,
      ``sum_j (m_j + n_j) r_j * itemsize``.
    """
    if len(matrices) != len(qs):
        raise ValueError(f"got {len(matrices)} matrices but {len(qs)} Q's")
    if not matrices:
        return [], [], 0
    ps = [m @ q for m, q in zip(matrices, qs)]
    ps, p_bytes = dense_mean_arrays(ps, axis_name)
    ps = [orthonormalize(p) for p in ps]
    new_qs = [m.T @ p for m, p in zip(matrices, ps)]
    new_qs, q_bytes = dense_mean_arrays(new_qs, axis_name)
    outs = [p @ q.T for p, q in zip(ps, new_qs)]
    return outs, new_qs, p_bytes + q_bytes


def gathered_mean(
    payload: Sequence[jnp.ndarray], decode: Callable[..., list[jnp.ndarray]], axis_name: AxisName
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
      decode: ``decode(*payload) -> list of arrays``, the decoder of one worker's payload.
      axis_name: worker axis, or None (decode the own payload).

    Returns:
      ``(means, payload_bytes)``: float32 means of the decoded arrays and the
      bytes of the all-gather operands.
    """
    payload = tuple(payload)
    nbytes = sum(_nbytes(p) for p in payload)
    if axis_name is None:
        return [d.astype(jnp.float32) for d in decode(*payload)], nbytes
    n = num_workers(axis_name)
    sent = [i for i, p in enumerate(payload) if p.size]
    gathered = {i: jax.lax.all_gather(payload[i], axis_name) for i in sent}

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
    z = jnp.zeros(s.shape, s.dtype)
    mat = getattr(s, "manual_axis_type", None)
    axes = tuple(sorted(getattr(mat, "varying", None) or getattr(s, "vma", None) or (), key=str))
    return jax.lax.pcast(z, axes, to="varying") if axes else z


def max_over_workers(x: jnp.ndarray, axis_name: AxisName) -> tuple[jnp.ndarray, int]:
    """Elementwise max over workers with one all-reduce (``pmax``), e.g. TernGrad's shared scalers.

    Returns:
      ``(max, payload_bytes)``: same shape and dtype as ``x``; ``x.size * itemsize`` bytes.
    """
    if axis_name is None:
        return x, _nbytes(x)
    return jax.lax.pmax(x, axis_name), _nbytes(x)
