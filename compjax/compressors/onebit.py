"""1-bit SGD with error feedback (Seide et al., Interspeech 2014)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.quantized import quantized_mean


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
        means, sent, nbytes = quantized_mean(
            ps, lambda i, x: q.onebit_encode(x), lambda i, c, s, shape: q.onebit_decode(c, s, shape), 1,
            ctx.axis_name,
        )
        return Exchanged(means, sent, {}, nbytes)

    return compressor(OnebitState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=True)
