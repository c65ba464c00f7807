"""The bucketed pipeline shared by the quantizing compressors.

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
