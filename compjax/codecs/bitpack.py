"""Bit packing: small unsigned codes into uint32 words, the arrays that go on the wire.

Codes of ``b`` bits with ``32 % b == 0`` (1, 2, 4, 8, 16, 32 bits) are packed
``32 // b`` per word, code ``i`` of a word in bits ``[b*i, b*(i+1))``
(little-endian within the word): 32 signs or 16 two-bit codes per uint32.  The
tail of the last word is padded with zero codes.

Other widths (e.g. QSGD's 10 bits for 256 levels) are split into bit fields of
widths that divide 32, taken from the low bits up in its binary decomposition
(10 = 8 + 2, 9 = 8 + 1, 7 = 4 + 2 + 1); each field is packed as above and the
fields' words are concatenated, low field first.  That is ``b * n / 32`` words
when ``n`` is a multiple of 32 (at most one partly filled word per field
otherwise), and every pass stays a cheap fused reduction.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

__all__ = ["fields", "num_words", "pack", "unpack"]


def _check_bits(bits: int) -> None:
    if not (isinstance(bits, int) and 1 <= bits <= 32):
        raise ValueError(f"bits must be an integer in [1, 32], got {bits!r}")


def fields(bits: int) -> tuple[tuple[int, int], ...]:
    """The ``(low bit, width)`` fields a ``bits``-bit code is split into (widths divide 32).

    Examples:
      >>> fields(2), fields(10), fields(7)
      (((0, 2),), ((0, 8), (8, 2)), ((0, 4), (4, 2), (6, 1)))
    """
    _check_bits(bits)
    if 32 % bits == 0:
        return ((0, bits),)
    out, lo = [], 0
    for w in (16, 8, 4, 2, 1):
        if (bits - lo) & w:
            out.append((lo, w))
            lo += w
    return tuple(out)


def num_words(n: int, bits: int) -> int:
    """Number of uint32 words that hold ``n`` codes of ``bits`` bits."""
    return sum(math.ceil(n / (32 // w)) for _, w in fields(bits))


def _pack_field(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    per = 32 // bits
    n = codes.shape[0]
    w = math.ceil(n / per)
    codes = jnp.pad(codes, (0, w * per - n)).reshape(w, per)
    shifts = (jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits))[None, :]
    # Codes occupy disjoint bit ranges, so the sum is a bitwise OR.
    return jnp.sum(codes << shifts, axis=1, dtype=jnp.uint32)


def _unpack_field(words: jnp.ndarray, bits: int, n: int) -> jnp.ndarray:
    per = 32 // bits
    shifts = (jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits))[None, :]
    mask = jnp.uint32((1 << bits) - 1) if bits < 32 else jnp.uint32(0xFFFFFFFF)
    return ((words[:, None] >> shifts) & mask).reshape(-1)[:n]


def pack(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Pack ``codes`` (values in ``[0, 2**bits)``) into ``num_words(n, bits)`` uint32 words.

    Args:
      codes: array of ``n`` non-negative integers (any shape, raveled; any
        integer or bool dtype).  Higher bits than ``bits`` are dropped.
      bits: code width, an integer in 1..32.

    Returns:
      ``(num_words(n, bits),)`` uint32.

    Raises:
      ValueError: ``bits`` outside 1..32.
    """
    codes = jnp.ravel(codes).astype(jnp.uint32)
    parts = []
    for lo, w in fields(bits):
        field = codes if w == 32 else (codes >> jnp.uint32(lo)) & jnp.uint32((1 << w) - 1)
        parts.append(_pack_field(field, w))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def unpack(words: jnp.ndarray, bits: int, n: int) -> jnp.ndarray:
    """Inverse of :func:`pack`: the first ``n`` codes as uint32 ``(n,)``.

    Raises:
      ValueError: ``bits`` outside 1..32, or ``words`` not of ``num_words(n, bits)`` words.
    """
    words = jnp.ravel(words).astype(jnp.uint32)
    if words.shape[0] != num_words(n, bits):
        raise ValueError(f"{n} codes of {bits} bits take {num_words(n, bits)} words, got {words.shape[0]}")
    out, off = None, 0
    for lo, w in fields(bits):
        nw = math.ceil(n / (32 // w))
        part = _unpack_field(words[off:off + nw], w, n)
        part = part << jnp.uint32(lo) if lo else part
        out = part if out is None else out | part
        off += nw
    return out
