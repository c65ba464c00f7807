"""1-bit SGD with error feedback (Seide et al., Interspeech 2014)."""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.quantized import quantized_mean, quantized_mean_on_shards


class OnebitState(NamedTuple):
    """State of :func:`onebit`.

    Attributes:
      residual: error-feedback memory Δ, same tree as the params.
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``4 * sum_layers ceil(size / 32)`` bytes of packed signs + ``4 * 2 * columns``
        bytes of reconstruction values + 4 (the non-finite vote).
    """

    residual: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def onebit(*, skip_nonfinite: bool = True, axis_name: AxisName = None) -> optax.GradientTransformationExtraArgs:
    """1-bit SGD: sign quantization at 0 with per-column reconstruction values and error feedback.

    Seide et al. 2014, Sec. 3 (with the residual carrying ``Δ_prev``, as intended)::

        p = g + Δ
        bit = p >= 0;  column j decodes to mean{p_ij >= 0} or mean{p_ij < 0}
        Δ = p - decode(bits)

    A column is one output unit ``x[..., j]`` of a flax kernel ``(..., in, out)``
    (:func:`compjax.codecs.quantize.onebit_columns`); vectors are one column.
    Signs go 32 per uint32 word; all layers' words in one buffer and all
    reconstruction values in another, exchanged by all-gather; every worker
    decodes all and averages.

    Args:
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``: local gradients in, averaged
      decoded gradients out (same tree, shapes, dtypes).

    Raises:
      ValueError: a gradient tree that does not match the residual (trace time).

    References:
      Seide, Fu, Droppo, Li & Yu, "1-bit stochastic gradient descent and its
      application to data-parallel distributed training of speech DNNs",
      Interspeech 2014.

    Examples:
      >>> import optax, compjax as cj
      >>> tx = optax.chain(cj.onebit(axis_name="data"), optax.sgd(0.05, momentum=0.9))
    """

    def exchange(ps, fields, ctx):
        sh = ctx.shards
        encode, decode = (lambda i, x: q.onebit_encode(x)), (lambda i, c, s, shape: q.onebit_decode(c, s, shape))
        if sh is None:
            means, sent, nbytes = quantized_mean(ps, encode, decode, 1, ctx.axis_name)
        else:
            means, sent, nbytes = quantized_mean_on_shards(
                ps, encode, decode, 1, ctx.axis_name, sh, partial(_encode_shard, sh), partial(_decode_shard, sh))
        return Exchanged(means, sent, {}, nbytes)

    return compressor(OnebitState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=True,
                      on_shards=True)


def _by_columns(sh, i: int, x) -> bool:
    """Whether leaf ``i`` is cut among its columns (its last dimension, ndim >= 2): each shard holds whole columns."""
    return x.ndim >= 2 and sh.dims[i] == x.ndim - 1


def _encode_shard(sh, i: int, x):
    """A shard's 1-bit codes and its layer's scales: its own columns' gathered, or its rows' sums added over the fast axis."""
    codes = q.onebit_encode(x)[0]
    sums = q.onebit_sums(x)
    rows = int(x.size) // q.onebit_columns(x.shape)
    if _by_columns(sh, i, x):  # whole columns: this shard's scales, the host's gathered in the layer's order
        own = q.onebit_scales(*sums, rows).reshape(2, -1)
        return codes, jnp.swapaxes(collectives.gather_over_fast(own), 0, 1).reshape(-1)
    total, absolute, n_pos = (collectives.sum_over_fast(s) for s in sums)
    return codes, q.onebit_scales(total, absolute, n_pos, rows * sh.fast())


def _decode_shard(sh, i: int, codes, scales, shape):
    """A shard's values from its codes and the layer's scales (its own columns' where it holds some)."""
    if len(shape) >= 2 and sh.dims[i] == len(shape) - 1:
        f = jax.lax.axis_index(sh.axis).astype(jnp.int32)
        scales = jax.lax.dynamic_index_in_dim(scales.reshape(2, sh.fast(), -1), f, axis=1, keepdims=False).reshape(-1)
    return q.onebit_decode(codes, scales, shape)
