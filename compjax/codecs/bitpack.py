"""Bit packing: small unsigned codes into uint32 words, the arrays that go on the wire.

``b``-bit codes with ``32 % b == 0`` (1, 2, 4, 8, 16 bits) are packed ``32 // b``
per word, code ``i`` of a word in bits ``[b*i, b*(i+1))`` (little-endian within
the word): 32 signs or 16 two-bit codes per uint32.  Other widths (e.g. QSGD's
10 bits) are packed as ``b`` bit-planes of 1-bit words, which costs the same
``b * ceil(n / 32)`` words.  The tail is padded with zero codes.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

__all__ = ["num_words", "pack", "unpack"]


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be an integer in [1, 32], got {bits}")


def num_words(n: int, bits: int) -> int:
    """Number of uint32 words that hold ``n`` codes of ``bits`` bits."""
    _check_bits(bits)
    if 32 % bits == 0:
        return math.ceil(n / (32 // bits))
    return bits * math.ceil(n / 32)


def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Pack ``codes`` (1-D, values in ``[0, 2**bits)``) into ``num_words(n, bits)`` uint32 words.

    Args:
      codes: ``(n,)`` array of non-negative integers (any integer or bool dtype).
      bits: code width, 1..32.

    Returns:
      ``(num_words(n, bits),)`` uint32.
    """
    _check_bits(bits)
    codes = jnp.ravel(codes).astype(jnp.uint32)
    n = codes.shape[0]
    if 32 % bits:  # bit-planes
        planes = [(codes >> jnp.uint32(j)) & jnp.uint32(1) for j in range(bits)]
        return jnp.concatenate([pack(p, 1) for p in planes])
    per = 32 // bits
    w = math.ceil(n / per)
    codes = jnp.pad(codes, (0, w * per - n)).reshape(w, per)
    shifts = (jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits))[None, :]
    # Codes occupy disjoint bit ranges, so the sum is a bitwise OR.
    return jnp.sum(codes << shifts, axis=1, dtype=jnp.uint32)


def unpack(words: jnp.ndarray, bits: int, n: int) -> jnp.ndarray:
    """Inverse of :func:`pack`: the first ``n`` codes as uint32 ``(n,)``."""
    _check_bits(bits)
    words = jnp.ravel(words).astype(jnp.uint32)
    if 32 % bits:
        w1 = math.ceil(n / 32)
        planes = [unpack(words[j * w1:(j + 1) * w1], 1, n) for j in range(bits)]
        out = jnp.zeros((n,), jnp.uint32)
        for j, p in enumerate(planes):
            out = out | (p << jnp.uint32(j))
        return out
    per = 32 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits))[None, :]
    mask = jnp.uint32((1 << bits) - 1) if bits < 32 else jnp.uint32(0xFFFFFFFF)
    return ((words[:, None] >> shifts) & mask).reshape(-1)[:n]
