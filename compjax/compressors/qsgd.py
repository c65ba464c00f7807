"""QSGD: stochastic quantization to s levels of the layer norm (Alistarh et al., NeurIPS 2017)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax._checks import check_range
from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.keys import as_key, step_uniforms
from compjax.compressors.quantized import quantized_mean, quantized_mean_on_shards


class QsgdState(NamedTuple):
    """State of :func:`qsgd`.

    Attributes:
      key: uint32 ``(2,)`` PRNG key; steps and workers enter its stream.
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step: packed codes of
        ``qsgd_bits(levels)`` bits per element + 4 bytes of norm per layer + 4
        (the non-finite vote).
    """

    key: jax.Array
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def qsgd(
    levels: int = 256, *, key, skip_nonfinite: bool = True, axis_name: AxisName = None
) -> optax.GradientTransformationExtraArgs:
    """QSGD with ``levels`` quantization levels per layer, unbiased.

    Alistarh et al. 2017, Sec. 3.1: ``Q_s(v)_i = ‖v‖₂ · sign(v_i) · ξ_i(v, s)``
    with ``ξ_i`` the stochastic rounding of ``s|v_i|/‖v‖₂`` to a neighbouring
    level ``l/s``.  Each element is sent in the fewest whole bits that hold the
    levels ``0..s`` plus a sign (``ceil(log2(s+1)) + 1``: 10 bits for s = 256,
    3 bits for s = 2; packed as bit fields, see :mod:`compjax.codecs.bitpack`)
    and the layer norm as float32; the paper's Elias coding is not used.  All
    layers' words go in one all-gathered buffer and the norms in another.
    Worker ``w`` at step ``t`` draws its uniforms for all layers from the stream
    ``stream(key, t, w)`` (a keyed hash of each element's index,
    :mod:`compjax.codecs.random`).  No error feedback (QSGD is unbiased).

    Args:
      levels: number of quantization levels s, an integer in [2, 2**30] (default
        256); fixes the code width (``static_args`` of ``optax.inject_hyperparams``).
      key: int seed, typed key (``jax.random.key``) or raw uint32 key, the same on
        every worker; each step and worker draws from the counter-based stream
        ``stream(key, step, worker)`` (:func:`compjax.compressors.keys.step_uniforms`,
        :mod:`compjax.codecs.random`).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: ``levels`` outside [2, 2**30] or not an integer, or a ``key`` that
        is not a seed or PRNG key (build time).

    References:
      Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient
      SGD via Gradient Quantization and Encoding", NeurIPS 2017.

    Examples:
      >>> import compjax as cj
      >>> tx = cj.qsgd(16, key=0, axis_name="data")
    """
    check_range("levels", levels, 2, 2**30, integer=True, static=True)
    levels = int(levels)
    bits = q.qsgd_bits(levels)
    key0 = as_key(key)

    def exchange(ps, fields, ctx):
        sh = ctx.shards
        u = step_uniforms(fields["key"], ctx.count, ctx.axis_name, ps, sh)

        def decode(i, c, s, shape):
            return q.qsgd_decode(c, s, levels, shape)

        if sh is None:
            means, sent, nbytes = quantized_mean(ps, lambda i, x: q.qsgd_encode(x, levels, u[i]), decode, bits,
                                                 ctx.axis_name)
        else:
            def encode_shard(i, x):  # the layer's norm: the shards' squares added over the fast axis
                norm = jnp.sqrt(collectives.sum_over_fast(jnp.sum(jnp.square(x.astype(jnp.float32)))))
                return q.qsgd_encode(x, levels, u[i], norm)

            # A leaf gathered whole draws at its shard's entries only: give it the layer's draws.
            whole_u = step_uniforms(fields["key"], ctx.count, ctx.axis_name,
                                    [jax.ShapeDtypeStruct(sh.whole_shape(x, i), x.dtype) for i, x in enumerate(ps)])
            means, sent, nbytes = quantized_mean_on_shards(
                ps, lambda i, x: q.qsgd_encode(x, levels, whole_u[i] if x.size != ps[i].size else u[i]), decode,
                bits, ctx.axis_name, sh, encode_shard, decode)
        return Exchanged(means, sent, {}, nbytes)

    return compressor(
        QsgdState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite,
        init_fields=lambda xs: {"key": jnp.array(key0)}, on_shards=True,
    )
