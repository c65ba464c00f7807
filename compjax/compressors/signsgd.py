"""EF-signSGD: scaled sign compression with error feedback (Karimireddy et al., ICML 2019)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from compjax import collectives
from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.quantized import quantized_mean, quantized_mean_on_shards


class SignsgdState(NamedTuple):
    """State of :func:`signsgd`.

    Attributes:
      residual: error-feedback memory e (None when ``error_feedback=False``).
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``4 * sum_layers ceil(size / 32)`` bytes of signs + 4 bytes of scale per
        layer + 4 (the non-finite vote).
    """

    residual: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def signsgd(
    *, error_feedback: bool = True, skip_nonfinite: bool = True, axis_name: AxisName = None
) -> optax.GradientTransformationExtraArgs:
    """EF-signSGD: send ``(‖p‖₁/d)·sign(p)`` per layer, keep what was not sent.

    Karimireddy, Rebjock, Stich & Jaggi 2019, Algorithm 1 (EF-SIGNSGD), per
    worker and layer of ``d`` entries::

        p = g + e
        sent = (‖p‖₁ / d) · sign(p)     (1 bit per element + one float per layer)
        e = p - sent

    The paper folds the learning rate into ``p = γ g + e``; here the
    compressor runs before the optax optimizer, so ``e`` is in gradient units
    (the same for a constant learning rate).  Signs go 32 per uint32 word; all
    layers in one buffer and the scales in another, all-gathered (2 collectives
    per step); each worker decodes every worker's payload and averages.

    Args:
      error_feedback: keep ``e`` (else plain scaled signSGD).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: a mismatched gradient tree (trace time).

    References:
      Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and
      other Gradient Compression Schemes", ICML 2019.

    Examples:
      >>> import compjax as cj
      >>> tx = cj.signsgd(axis_name="data")
    """

    def exchange(ps, fields, ctx):
        sh = ctx.shards
        encode, decode = (lambda i, x: q.sign_encode(x)), (lambda i, c, s, shape: q.sign_decode(c, s, shape))
        if sh is None:
            means, sent, nbytes = quantized_mean(ps, encode, decode, 1, ctx.axis_name)
        else:
            def encode_shard(i, x):  # the layer's mean |p|: the shards' sums of |p| added over the fast axis
                total = collectives.sum_over_fast(jnp.sum(jnp.abs(jnp.ravel(x).astype(jnp.float32))))
                return q.sign_encode(x)[0], (total / (int(x.size) * sh.fast()))[None]

            means, sent, nbytes = quantized_mean_on_shards(ps, encode, decode, 1, ctx.axis_name, sh, encode_shard,
                                                           decode)
        return Exchanged(means, sent, {}, nbytes)

    return compressor(
        SignsgdState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, error_feedback=error_feedback,
        on_shards=True, any_cut=True,
    )
