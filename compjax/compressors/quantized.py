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

from compjax import collectives, layout
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


#: ``encode_shard(i, shard) -> (codes uint32 (shard.size,), scales float32)``: the shard's codes and the
#: whole layer's scales (its statistics reduced over the fast axis), the same on every device of the host.
EncodeShard = Callable[[int, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]
#: ``decode_shard(i, codes, scales, shape) -> float32 shard``: a shard's codes with the layer's scales.
DecodeShard = Callable[[int, jnp.ndarray, jnp.ndarray, tuple[int, ...]], jnp.ndarray]


def quantized_mean_on_shards(
    leaves: Sequence[jnp.ndarray], encode: Encode, decode: Decode, bits: int, axis_name: AxisName,
    shards: layout.Shards, encode_shard: EncodeShard, decode_shard: DecodeShard,
) -> tuple[list[jnp.ndarray], list[jnp.ndarray], int]:
    """:func:`quantized_mean` of this device's shards of the layers (:class:`compjax.layout.Shards`).

    A sharded leaf whose shards pack into whole words (``fast`` times the
    shard's words are the layer's) is encoded on its shard
    (``encode_shard``: the layer's scales from statistics reduced over the
    fast axis); its words are this device's own part of the host's payload:
    sent as they are over the worker axis and decoded with the layer's scales
    into the shard alone (``decode_shard``).  Whole leaves, and sharded
    leaves whose shards do not pack into whole words (gathered here over the
    fast axis), go as in :func:`quantized_mean` (the scales of every leaf
    too).  The host sends the bytes the replicated layout sends.

    Returns:
      ``(means, sent, payload_bytes)`` as :func:`quantized_mean`, this device's shards.
    """
    fast = shards.fast()
    own_at, gathered = [], set()
    xs = list(leaves)
    for i, x in enumerate(xs):
        d = shards.dims[i]
        if d is None:
            continue
        if fast * bitpack.num_words(int(x.size), bits) == bitpack.num_words(int(x.size) * fast, bits):
            own_at.append(i)
        else:  # its shards' codes would straddle words: gathered, and encoded whole
            gathered.add(i)
            xs[i] = collectives.gather_inside_host(x, shards.axis, d)
    whole_at = [i for i in range(len(xs)) if i not in own_at]
    encoded = {i: (encode_shard(i, xs[i]) if i in own_at else encode(i, xs[i])) for i in range(len(xs))}
    words_bucket = make_bucket([(bitpack.num_words(xs[i].size, bits),) for i in whole_at])
    own_bucket = make_bucket([(bitpack.num_words(xs[i].size, bits),) for i in own_at])
    scales_bucket = make_bucket([encoded[i][1].shape for i in range(len(xs))])
    words = words_bucket.flatten([bitpack.pack(encoded[i][0], bits) for i in whole_at], jnp.uint32)
    own = own_bucket.flatten([bitpack.pack(encoded[i][0], bits) for i in own_at], jnp.uint32)
    scales = scales_bucket.flatten([encoded[i][1] for i in range(len(xs))], jnp.float32)

    def decode_all(words, scales, own):
        ws = dict(zip(whole_at, words_bucket.unflatten(words)))
        ws.update(zip(own_at, own_bucket.unflatten(own)))
        scs = scales_bucket.unflatten(scales)
        return [
            (decode_shard if i in own_at else decode)(i, bitpack.unpack(ws[i], bits, x.size), scs[i], x.shape)
            for i, x in enumerate(xs)
        ]

    means, nbytes = collectives.gathered_mean((words, scales), decode_all, axis_name, own=(own,))
    sent = means if axis_name is None else decode_all(words, scales, own)
    means = [shards.own(m, i) if i in gathered else m for i, m in enumerate(means)]
    sent = [shards.own(m, i) if i in gathered else m for i, m in enumerate(sent)]
    return (
        [m.astype(x.dtype) for m, x in zip(means, leaves)],
        [s.astype(x.dtype) for s, x in zip(sent, leaves)],
        nbytes,
    )
