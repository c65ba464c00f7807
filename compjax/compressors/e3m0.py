"""4-bit E3M0 quantization of Streaming DiLoCo (Douillard et al. 2025), with optional error feedback."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from compjax import collectives
from compjax.codecs import e3m0 as codec
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.quantized import quantized_mean, quantized_mean_on_shards


class E3m0State(NamedTuple):
    """State of :func:`e3m0`.

    Attributes:
      residual: error-feedback memory ``e``, same tree as the params (None when
        ``error_feedback=False``).
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``4 * sum_layers ceil(size / 8)`` bytes of packed codes + 4 bytes of
        float32 scale per layer + 4 (the non-finite vote, with ``skip_nonfinite``
        on several workers).
    """

    residual: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def e3m0(
    *, error_feedback: bool = True, skip_nonfinite: bool = True, axis_name: AxisName = None
) -> optax.GradientTransformationExtraArgs:
    """Send every layer as 4-bit E3M0 floats (sign + 3-bit exponent) with a power-of-two scale.

    Streaming DiLoCo's low-precision exchange (Douillard et al. 2025): each
    worker sends 4 bits per entry, every worker decodes all workers' payloads
    and accumulates them in float32.  Per worker and layer (format details:
    :mod:`compjax.codecs.e3m0`)::

        p = g + e                                   (error_feedback=True; else p = g)
        scale = 2**ceil(log2(max|p|))               (one float32 per layer)
        code = sign(p) | c,  c = 0 -> 0,  c = k in 1..7 -> scale * 2**(k - 7)
        c = min(round(log2(|p| / scale)), 0) + 7, or 0 where |p| / scale < 2**-6.5
        e = p - decode(code)                        (error_feedback=True)

    Rounding is to nearest in log2 space and deterministic; the scaling and
    rounding rules are compjax's (the method names the E3M0 format and the
    float32 accumulation).  Codes go 8 per uint32 word, each layer starting at
    a word boundary, all layers in one buffer and all scales in another, both
    all-gathered (2 collectives per step): ``4 * sum_layers ceil(size / 8) + 4 *
    layers`` bytes per worker and step, plus 4 for the non-finite vote (with
    ``skip_nonfinite`` on several workers) — exactly 8x fewer than float32, plus
    the scales, when every layer's size is a multiple of 8.  Outputs are cast
    back to each gradient's dtype.

    Args:
      error_feedback: keep ``e``, what quantization left out, and add it to the
        next step's gradient (compjax's default); False sends the quantized
        gradient as is (biased: entries below ``2**-6.5 * scale`` are dropped).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``: local gradients in, the mean
      over workers of the decoded gradients out (same tree, shapes, dtypes).

    Raises:
      ValueError: a gradient tree that does not match the residual (trace time).

    References:
      Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey, McIlroy,
      Shen, Ramé, Szlam, Ranzato & Barham, "Streaming DiLoCo with overlapping
      communication: Towards a Distributed Free Lunch", 2025, arXiv:2501.18512.

    Examples:
      One worker: ``3.0`` (scale 4) rounds to 4 in log2 space, ``-0.5`` is
      exact, ``0.01`` is below ``2**-6.5 * 4`` and goes to zero; 8 entries in
      one uint32 word plus a float32 scale.

      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.e3m0()
      >>> g = {"w": jnp.array([3.0, -0.5, 0.01, 0.0, 0.3, 1.0, -2.0, 0.1])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> out["w"].tolist()
      [4.0, -0.5, 0.0, 0.0, 0.25, 1.0, -2.0, 0.125]
      >>> int(cj.message_bytes(state))   # one worker: the size of the message (nothing is sent)
      8
    """

    def exchange(ps, fields, ctx):
        encode, decode = (lambda i, x: codec.encode(x)), (lambda i, c, s, shape: codec.decode(c, s, shape))
        if ctx.shards is None:
            means, sent, nbytes = quantized_mean(ps, encode, decode, codec.BITS, ctx.axis_name)
        else:
            def encode_shard(i, x):  # the layer's max |p|: the shards' maxima, maxed over the fast axis (exact)
                return codec.encode(x, amax=collectives.max_over_fast(jnp.max(jnp.abs(x.astype(jnp.float32)))))

            means, sent, nbytes = quantized_mean_on_shards(ps, encode, decode, codec.BITS, ctx.axis_name, ctx.shards,
                                                           encode_shard, decode)
        return Exchanged(means, sent, {}, nbytes)

    return compressor(
        E3m0State, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=error_feedback,
        on_shards=True, any_cut=True, materialize=True,
    )
