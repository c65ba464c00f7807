"""TernGrad: stochastic ternary gradients with a shared scaler (Wen et al., NeurIPS 2017)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import bytecount, collectives
from compjax._checks import check_range
from compjax.codecs import quantize as q
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor
from compjax.compressors.keys import as_key, step_uniforms
from compjax.compressors.quantized import quantized_mean, quantized_mean_on_shards


class TerngradState(NamedTuple):
    """State of :func:`terngrad`.

    Attributes:
      key: uint32 ``(2,)`` PRNG key (the same on every worker; steps and workers enter its stream).
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step:
        ``4 * sum_layers ceil(size / 16)`` bytes of 2-bit codes + ``4 * num_layers``
        bytes of scalers (the max all-reduce) + 4 (the non-finite vote).
    """

    key: jax.Array
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def terngrad(
    *, key, clip_sigma: float = 2.5, skip_nonfinite: bool = True, axis_name: AxisName = None
) -> optax.GradientTransformationExtraArgs:
    """TernGrad: each layer clipped at ``clip_sigma·σ``, ternarized with a scaler shared by all workers.

    Wen et al. 2017, Sec. 3 (stochastic ternarization with a layer-wise scaler,
    scaler sharing across workers and gradient clipping), per worker and layer::

        g = clip(g, -cσ, cσ)                 (σ: std of this worker's layer entries)
        s = max over workers of max|g|       (one pmax all-reduce of all layers' scalers)
        b ~ Bernoulli(|g| / s)               (u < |g| / s, u uniform)
        sent = s · sign(g) ∘ b               (2-bit codes, 16 per uint32 word)

    ``E[sent] = clip(g)``: unbiased for the clipped gradient.  All layers' codes
    travel in one all-gathered uint32 buffer; each worker decodes every worker's
    codes with the shared scalers and averages, so a step issues 2 collectives
    (plus the non-finite vote).  Worker ``w`` at step ``t`` draws its uniforms for
    all layers from the stream ``stream(key, t, w)`` (in leaf order; a keyed hash
    of each element's index, :mod:`compjax.codecs.random`).  No
    error feedback (as in the paper).  Choices: the scaler is ``max|clip(g)|`` as
    in the paper's text (the authors' code uses ``c·σ`` when clipping, equally
    unbiased); every layer is ternarized, the logit layer included (the authors'
    code can leave it in float).

    Args:
      key: int seed, typed key (``jax.random.key``) or raw uint32 key, the same on
        every worker; each step and worker draws from the counter-based stream
        ``stream(key, step, worker)`` (:func:`compjax.compressors.keys.step_uniforms`,
        :mod:`compjax.codecs.random`).
      clip_sigma: positive float c of the clipping at ``c·σ`` (paper: 2.5); may be traced.
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs``.

    Raises:
      ValueError: ``clip_sigma <= 0`` or a ``key`` that is not a seed or PRNG key (build time).

    References:
      Wen, Xu, Yan, Wu, Wang, Chen & Li, "TernGrad: Ternary Gradients to Reduce
      Communication in Distributed Deep Learning", NeurIPS 2017.

    Examples:
      >>> import compjax as cj
      >>> tx = cj.terngrad(key=0, axis_name="data")
    """
    check_range("clip_sigma", clip_sigma, 0.0, None, lo_open=True)
    key0 = as_key(key)

    def exchange(ps, fields, ctx):
        sh = ctx.shards
        if sh is None:
            clipped = [q.terngrad_clip(x, clip_sigma) for x in ps]
        else:  # a sharded layer's mean and deviation: the shards' sums added over the fast axis
            clipped = [q.terngrad_clip(x, clip_sigma) if sh.dims[i] is None else
                       q.terngrad_clip_with(x, clip_sigma, collectives.sum_over_fast, int(x.size) * sh.fast())
                       for i, x in enumerate(ps)]
        local_max = jnp.stack([jnp.max(jnp.abs(x)) for x in clipped])
        if sh is not None:  # the layers' largest |g|: the shards' maxima (exact)
            local_max = collectives.max_over_fast(local_max)
        scalers, s_bytes = collectives.max_over_workers(local_max, ctx.axis_name)
        u = step_uniforms(fields["key"], ctx.count, ctx.axis_name, ps, sh)

        def encode(i, x):
            return q.terngrad_encode(x, scalers[i], u[i]), jnp.zeros((0,), jnp.float32)

        def decode(i, c, s, shape):
            return q.terngrad_decode(c, scalers[i], shape)

        if sh is None:
            means, _, c_bytes = quantized_mean(clipped, encode, decode, 2, ctx.axis_name)
        else:
            # A leaf gathered whole (its shards straddle words) draws the layer's numbers.
            whole_u = step_uniforms(fields["key"], ctx.count, ctx.axis_name,
                                    [jax.ShapeDtypeStruct(sh.whole_shape(x, i), x.dtype) for i, x in enumerate(ps)])

            def encode_whole(i, x):
                return q.terngrad_encode(x, scalers[i], whole_u[i] if x.size != ps[i].size else u[i]), \
                    jnp.zeros((0,), jnp.float32)

            means, _, c_bytes = quantized_mean_on_shards(clipped, encode_whole, decode, 2, ctx.axis_name, sh,
                                                         encode, decode)
        return Exchanged(means, None, {}, bytecount.add(s_bytes, c_bytes))

    return compressor(
        TerngradState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite,
        init_fields=lambda xs: {"key": jnp.array(key0)}, on_shards=True,
    )
