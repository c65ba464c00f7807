"""The bucketed pipeline shared by the quantizing compressors, and their step keys.

Every leaf is encoded to (codes, scales); all leaves' codes are packed into
**one** uint32 word buffer and all scales into **one** float32 buffer, which
:func:`compjax.collectives.gathered_mean` all-gathers (so a step issues at most
two collectives whatever the number of leaves); each worker decodes every
worker's payload and averages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.codecs import bitpack
from compjax.codecs.bucket import make_bucket
from compjax.collectives import AxisName

Encode = Callable[[int, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]
Decode = Callable[[int, jnp.ndarray, jnp.ndarray, tuple[int, ...]], jnp.ndarray]


def quantized_mean(
    leaves: Sequence[jnp.ndarray], encode: Encode, decode: Decode, bits: int, axis_name: AxisName
) -> tuple[list[jnp.ndarray], list[jnp.ndarray], int]:
    """Encode, pack, exchange and decode a list of leaves.

    Args:
      leaves: this worker's arrays (float).
      encode: ``encode(i, leaf) -> (codes uint32 (leaf.size,), scales float32 (k_i,))``.
      decode: ``decode(i, codes, scales, shape) -> float32 array of shape``.
      bits: code width (packed ``32 // bits`` per word, see :mod:`compjax.codecs.bitpack`).
      axis_name: worker axis, or None.

    Returns:
      ``(means, sent, payload_bytes)``: the mean over workers of the decoded
      leaves and this worker's own decoded leaves (what it sent; for error
      feedback), both in the leaves' dtypes, and the bytes of the payload.
    """
    encoded = [encode(i, x) for i, x in enumerate(leaves)]
    codes_bucket = make_bucket([c.shape for c, _ in encoded])
    scales_bucket = make_bucket([s.shape for _, s in encoded])
    words = bitpack.pack(codes_bucket.flatten([c for c, _ in encoded]), bits)
    scales = scales_bucket.flatten([s for _, s in encoded], jnp.float32)

    def decode_all(words, scales):
        codes = codes_bucket.unflatten(bitpack.unpack(words, bits, codes_bucket.size))
        scs = scales_bucket.unflatten(scales)
        return [decode(i, c, s, x.shape) for i, (c, s, x) in enumerate(zip(codes, scs, leaves))]

    means, nbytes = collectives.gathered_mean((words, scales), decode_all, axis_name)
    sent = decode_all(words, scales)
    return (
        [m.astype(x.dtype) for m, x in zip(means, leaves)],
        [s.astype(x.dtype) for s, x in zip(sent, leaves)],
        nbytes,
    )


def as_key(key) -> jax.Array:
    """A raw uint32 PRNG key from an int seed, a raw key or a typed ``jax.random.key``."""
    if isinstance(key, int):
        return jax.random.PRNGKey(key)
    key = jnp.asarray(key) if not hasattr(key, "dtype") else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def step_key(key: jax.Array, count: jnp.ndarray, axis_name: AxisName) -> jax.Array:
    """The key of this step and worker: ``fold_in(fold_in(key, step), worker index)``."""
    return jax.random.fold_in(jax.random.fold_in(key, count), collectives.worker_index(axis_name))
