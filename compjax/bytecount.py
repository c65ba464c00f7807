"""Exact byte counts without 64-bit integers: a count is two uint32 words.

JAX runs with 32-bit integers unless x64 is enabled, and an int32 counter
overflows at 2 GiB, which one step of a large model exceeds (a 100B-parameter
float32 all-reduce is 4·10¹¹ bytes).  Compressor states therefore hold their
byte counts as a uint32 array of shape ``(..., 2)``: ``[low word, high word]``,
the value ``low + 2**32 * high``, exact up to ``MAX = 2**63 - 1`` bytes (read
on the host as int64).  Counts are
built from Python ints at trace time (:func:`constant`), added inside a jitted
step with a carry (:func:`add`) and read on the host as int64
(:func:`to_int`, used by :func:`compjax.payload_bytes`).

**Unsent messages.**  The top bit of the high word (bit 63 of the value,
above :data:`MAX`) marks a count of a message that no collective carried: a
compressor built with ``axis_name=None`` (one worker, or a ``jax.jit`` step
whose gradients XLA all-reduces itself) counts the bytes its message *would*
take, marked so (:func:`unsent`).  :func:`to_int` reads the count without
the mark, :func:`is_sent` tells the two apart: :func:`compjax.payload_bytes`
(bytes sent) reads such a count as 0, :func:`compjax.message_bytes` (bytes of
the message, sent or not) as the count.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["MAX", "add", "constant", "is_sent", "to_int", "unsent", "zeros"]

#: The largest count: the host reads counts as int64 (sums in jit wrap past 2**64 unchecked).
MAX = 2**63 - 1
_WORD = 2**32
_UNSENT = np.uint32(2**31)  # the mark of an unsent message: the top bit of the high word


def constant(n: int) -> jnp.ndarray:
    """The count of ``n`` bytes as a uint32 ``(2,)`` array ``[n mod 2**32, n // 2**32]``.

    Args:
      n: a Python int in ``[0, MAX]`` (a static byte count).

    Raises:
      ValueError: ``n`` is negative, too large, or not an int.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= int(n) <= MAX:
        raise ValueError(f"a byte count must be an int in [0, 2**63 - 1], got {n!r}")
    n = int(n)
    return jnp.asarray(np.array([n % _WORD, n // _WORD], np.uint32))


def zeros() -> jnp.ndarray:
    """A zero count: uint32 ``[0, 0]`` (a new buffer on every call)."""
    return jnp.zeros((2,), jnp.uint32)


def add(a: jnp.ndarray | int, b: jnp.ndarray | int) -> jnp.ndarray:
    """``a + b`` of two counts (uint32 ``(..., 2)`` arrays or Python ints), with the carry.

    Inside ``jit`` the sum is done in uint32 words: ``low = a_low + b_low``
    (mod 2³²) carries one into the high word when it wraps.  Two Python ints
    are added exactly and returned as a constant.
    """
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return constant(int(a) + int(b))
    a = constant(a) if isinstance(a, (int, np.integer)) else a
    b = constant(b) if isinstance(b, (int, np.integer)) else b
    low = a[..., 0] + b[..., 0]
    carry = (low < a[..., 0]).astype(jnp.uint32)
    return jnp.stack([low, a[..., 1] + b[..., 1] + carry], axis=-1)


def unsent(count: jnp.ndarray | int) -> jnp.ndarray:
    """``count`` marked as the size of a message that no collective carried (see the module docstring).

    Args:
      count: a uint32 ``(..., 2)`` count or a Python int (at most :data:`MAX`).

    Returns:
      uint32 ``(..., 2)``: the same words, the top bit of the high word set.
    """
    count = constant(count) if isinstance(count, (int, np.integer)) else count
    return jnp.stack([count[..., 0], count[..., 1] | jnp.uint32(_UNSENT)], axis=-1)


def _words(words) -> np.ndarray:
    w = np.asarray(words)
    if w.ndim == 0 or w.shape[-1] != 2:
        raise ValueError(f"a byte count is a (..., 2) array of uint32 words, got shape {w.shape}")
    return w.astype(np.uint64)


def is_sent(words) -> np.ndarray:
    """Host-side: whether each count is of bytes put into collectives (not marked :func:`unsent`): bool NumPy array.

    Raises:
      ValueError: the last axis is not of size 2.
    """
    return (_words(words)[..., 1] & np.uint64(_UNSENT)) == 0


def to_int(words) -> np.ndarray:
    """Host-side value of counts: int64 NumPy array of shape ``words.shape[:-1]`` (the :func:`unsent` mark dropped).

    Raises:
      ValueError: the last axis is not of size 2.
    """
    w = _words(words)
    high = w[..., 1] & np.uint64(int(_UNSENT) - 1)
    return (w[..., 0] + (high << np.uint64(32))).astype(np.int64)
