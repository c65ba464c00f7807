"""MXNet-style 2-bit threshold quantization with residual (MXNet gradient compression)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from compjax._checks import check_range
from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.quantized import quantized_mean, quantized_mean_on_shards


class TwobitState(NamedTuple):
    """State of :func:`twobit`.

    Attributes:
      residual: error-feedback memory, same tree as the params.
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``4 * sum_layers ceil(size / 16)`` (each layer's codes start at a word
        boundary, as MXNet packs each array) + 4 (the non-finite vote).
    """

    residual: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def twobit(
    threshold: float = 0.5, *, skip_nonfinite: bool = True, axis_name: AxisName = None
) -> optax.GradientTransformationExtraArgs:
    """2-bit quantization with MXNet's semantics and a residual.

    On ``p = g + residual``: code ``11`` where ``p >= threshold`` (decodes to
    ``+threshold``), ``10`` where ``p <= -threshold`` (``-threshold``), ``00``
    otherwise (0); ``residual = p - decoded``.  16 codes per uint32 word, each
    layer starting at a word boundary, all layers in one buffer (one all-gather
    per step): exactly 16x fewer bytes than float32 when every layer's size is a
    multiple of 16.  No scales travel (the threshold is known).
    MXNet compressed only worker-to-server traffic; here every worker's words are
    all-gathered and each worker decodes all.

    Args:
      threshold: positive float, the quantization threshold (MXNet default 0.5);
        may be traced (``optax.inject_hyperparams``).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: ``threshold <= 0`` (build time); a mismatched gradient tree (trace time).

    References:
      MXNet documentation, "Gradient Compression" (2-bit compression), 2017.

    Examples:
      >>> import compjax as cj
      >>> tx = cj.twobit(0.5, axis_name="data")
    """
    check_range("threshold", threshold, 0.0, None, lo_open=True)

    def exchange(ps, fields, ctx):
        def encode(i, x):
            return q.twobit_encode(x, threshold), jnp.zeros((0,), jnp.float32)

        def decode(i, c, s, shape):
            return q.twobit_decode(c, threshold, shape)

        if ctx.shards is None:
            means, sent, nbytes = quantized_mean(ps, encode, decode, 2, ctx.axis_name)
        else:  # no statistic: each shard is encoded on its own
            means, sent, nbytes = quantized_mean_on_shards(ps, encode, decode, 2, ctx.axis_name, ctx.shards,
                                                           encode, decode)
        return Exchanged(means, sent, {}, nbytes)

    return compressor(TwobitState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=True,
                      on_shards=True, any_cut=True)
