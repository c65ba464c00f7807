"""The bucketed pipeline shared by the quantizing compressors, and their step keys.

Every leaf is encoded to (codes, scales); each leaf's codes are packed into
uint32 words (starting at a word boundary: at most one partly filled word per
leaf) and all leaves' words are concatenated into **one** uint32 buffer, all
scales into **one** float32 buffer; :func:`compjax.collectives.gathered_mean`
all-gathers the two (so a step issues at most two collectives whatever the
number of leaves) and each worker decodes every worker's payload and averages.
Packing leaf by leaf keeps the pack a fused pass over each leaf (no
materialized code buffer); it costs nothing when every leaf size is a multiple
of ``32 // bits`` codes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
      bits: code width (``32 // bits`` codes per word when ``bits`` divides 32, else
        split into fields, see :mod:`compjax.codecs.bitpack`); the payload holds
        ``sum_leaves num_words(size, bits)`` words.
      axis_name: worker axis, or None.

    Returns:
      ``(means, sent, payload_bytes)``: the mean over workers of the decoded
      leaves and this worker's own decoded leaves (what it sent; for error
      feedback), both in the leaves' dtypes, and the bytes of the payload.
    """
    encoded = [encode(i, x) for i, x in enumerate(leaves)]
    words_bucket = make_bucket([(bitpack.num_words(x.size, bits),) for x in leaves])
    scales_bucket = make_bucket([s.shape for _, s in encoded])
    words = words_bucket.flatten([bitpack.pack(c, bits) for c, _ in encoded], jnp.uint32)
    scales = scales_bucket.flatten([s for _, s in encoded], jnp.float32)

    def decode_all(words, scales):
        ws = words_bucket.unflatten(words)
        scs = scales_bucket.unflatten(scales)
        return [
            decode(i, bitpack.unpack(w, bits, x.size), s, x.shape)
            for i, (w, s, x) in enumerate(zip(ws, scs, leaves))
        ]

    means, nbytes = collectives.gathered_mean((words, scales), decode_all, axis_name)
    # One worker: the mean is the own decode (do not decode twice).
    sent = means if axis_name is None else decode_all(words, scales)
    return (
        [m.astype(x.dtype) for m, x in zip(means, leaves)],
        [s.astype(x.dtype) for s, x in zip(sent, leaves)],
        nbytes,
    )


def as_key(key) -> jax.Array:
    """A raw uint32 ``(2,)`` PRNG key from an int seed, a raw key or a typed ``jax.random.key``.

    Raises:
      ValueError: ``key`` is none of these (e.g. a float, or an array of another shape).
    """
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return jax.random.PRNGKey(int(key))
    if hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    arr = jnp.asarray(key) if key is not None and not isinstance(key, (bool, float, str)) else None
    if arr is not None and arr.shape == () and jnp.issubdtype(arr.dtype, jnp.integer):
        return jax.random.PRNGKey(arr)
    if arr is None or arr.shape != (2,) or arr.dtype != jnp.uint32:
        raise ValueError(f"key must be an int seed or a PRNG key (jax.random.key / PRNGKey), got {key!r}")
    return arr


def step_key(key: jax.Array, count: jnp.ndarray, axis_name: AxisName) -> jax.Array:
    """The key of this step and worker: ``fold_in(fold_in(key, step), worker index)``."""
    return jax.random.fold_in(jax.random.fold_in(key, count), collectives.worker_index(axis_name))


def step_uniforms(
    key: jax.Array, count: jnp.ndarray, axis_name: AxisName, leaves: Sequence[jnp.ndarray]
) -> list[jnp.ndarray]:
    """This step's and worker's uniform draws in [0, 1), one per element of each leaf.

    One draw for the whole bucket, ``jax.random.uniform(step_key(...), (total,))``
    in float32, split in leaf order (leaf ``i`` gets the ``size_i`` draws after
    the previous leaves'), so the program holds one random-bits kernel whatever
    the number of leaves.

    Returns:
      float32 arrays of shapes ``(leaf.size,)``.
    """
    bucket = make_bucket([(x.size,) for x in leaves])
    u = jax.random.uniform(step_key(key, count, axis_name), (bucket.size,), jnp.float32)
    return bucket.unflatten(u)
