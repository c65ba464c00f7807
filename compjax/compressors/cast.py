"""Half-precision payloads: fp16 / bf16 casts of the gradients."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax.codecs.bucket import make_bucket
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor

_ALLOWED = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


class CastState(NamedTuple):
    """State of :func:`cast`.

    Attributes:
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of the last step (``2 * num_params``
        + 4); read it with :func:`compjax.payload_bytes`.
    """

    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def cast(dtype, axis_name: AxisName = None, *, skip_nonfinite: bool = True) -> optax.GradientTransformationExtraArgs:
    """Average the gradients through a 16-bit payload (2x fewer bytes than float32).

    * ``float16``: each worker divides by ``n`` **before** the sum, then one
      float16 all-reduce: the sum of ``g_i / n`` is bounded by ``max_i |g_i|``,
      so the reduction cannot overflow where the inputs do not (values above
      65504 still saturate to inf in the cast itself; values below about
      ``6e-8 * n`` flush to zero after the division).
    * ``bfloat16`` (8 exponent bits: no overflow concern): the bf16 bits are
      all-gathered as uint16 and every worker averages the ``n`` payloads in
      float32.  An all-gather rather than an all-reduce because XLA:CPU widens
      bf16 reductions to float32 on the wire, which would double the bytes sent.

    Args:
      dtype: ``jnp.float16`` or ``jnp.bfloat16`` (or their names).  With
        ``optax.inject_hyperparams``, list ``"dtype"`` in ``static_args``.
      axis_name: worker axis, or None for one worker (a cast round trip).
      skip_nonfinite: the non-finite guard (:mod:`compjax.compressors.base`).

    Returns:
      ``optax.GradientTransformationExtraArgs``; outputs in the gradients' dtypes.

    Raises:
      ValueError: any other ``dtype`` (build time): float32 is :func:`identity`,
        and integer or 8-bit formats need a scale (see the quantizers).

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.cast(jnp.bfloat16, axis_name="data")
    """
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _ALLOWED:
        raise ValueError(f"dtype must be one of {sorted(_ALLOWED)}, got {dtype!r}")
    wire = _ALLOWED[name]

    def exchange(ps, fields, ctx):
        low = [x.astype(wire) for x in ps]
        shards = [False] * len(low) if ctx.shards is None else [d is not None for d in ctx.shards.dims]
        if wire == jnp.float16:  # a shard is its own piece of the host's payload
            means, nbytes = collectives.dense_mean_arrays(low, ctx.axis_name, prescale=True, shards=shards)
        else:
            # One all-gather for all whole layers; shards of layers are this device's own part of the host's
            # payload, in a second buffer sent as it is (collectives.gathered_mean(own=)).
            whole = [i for i, s in enumerate(shards) if not s]
            own = [i for i, s in enumerate(shards) if s]
            buckets = [make_bucket([low[i].shape for i in at]) for at in (whole, own)]
            # Bitcast leaf by leaf, then concatenate the uint16 parts (faster on CPU
            # than concatenating bfloat16 arrays).
            words = [b.flatten([jax.lax.bitcast_convert_type(low[i], jnp.uint16) for i in at], jnp.uint16)
                     for b, at in zip(buckets, (whole, own))]

            def decode(w, w_own):
                out = [None] * len(low)
                for b, at, x in zip(buckets, (whole, own), (w, w_own)):
                    for i, y in zip(at, b.unflatten(jax.lax.bitcast_convert_type(x, jnp.bfloat16))):
                        out[i] = y
                return out

            means, nbytes = collectives.gathered_mean((words[0],), decode, ctx.axis_name, own=(words[1],))
        return Exchanged(means, low, {}, nbytes)  # sent: p in the wire dtype

    return compressor(CastState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, on_shards=True,
                      any_cut=True)
