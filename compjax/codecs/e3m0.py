"""E3M0: 4-bit floats with a sign and a 3-bit exponent, no mantissa (Streaming DiLoCo).  Pure math.

Streaming DiLoCo (Douillard et al. 2025) sends its outer gradients as 4-bit
E3M0 floats and accumulates them in float32.  This module fixes the format
exactly (the scaling and rounding rules below are compjax's; they are written
out so that a NumPy reference can check them bit for bit):

**Code** (4 bits, in the low bits of a uint32): bit 3 is the sign (1 =
negative), bits 0..2 the exponent field ``c`` in 0..7.  ``c = 0`` is zero;
``c = k`` in 1..7 is the magnitude ``scale * 2**(k - 7)``, i.e. ``scale`` times
one of ``2**-6, 2**-5, ..., 2**-1, 1``.  Zero is always encoded as code 0
(never ``0b1000``), so ``-0.0`` and ``+0.0`` both decode to ``+0.0``.

**Scale** (one float32 per tensor): ``scale = 2**E`` with
``E = ceil(log2(max|x|))``, so ``max|x| <= scale < 2 max|x|``.  ``E`` is clamped
to ``[-126, 127]``, the exponents of normal float32 numbers (only a tensor whose
``max|x|`` exceeds ``2**127`` has entries above its scale; they encode as
``±scale``).  A tensor with no normal entry (all zeros, or only subnormal
float32 entries) gets ``scale = 1`` and all codes 0: no ``log2(0)``, no NaN.

**Rounding**: to nearest in log2 space, deterministic.  With ``r = |x| / scale``
(in ``[0, 1]``), ``t = round(log2(r))``; ``t < -6`` (i.e. ``r < 2**-6.5``: whatever would round
to ``2**-7`` or below, the smallest code being ``2**-6``) encodes as 0,
otherwise ``c = min(t, 0) + 7``.  Equivalently, ``r`` goes to ``2**t`` when
``2**(t - 0.5) < r < 2**(t + 0.5)``: the midpoints are irrational, so no float
lies on one and there are no ties.  The relative error of a non-zero code is
at most ``sqrt(2) - 1`` (about 41%, just above a midpoint) and entries below
``2**-6.5 * scale`` are lost to zero.  Subnormal float32 entries (``|x| <
2**-126``) encode as 0.

The encoder works on the float32 bits (no ``log2``, no division): for a
normal ``|x| = (1 + m / 2**23) * 2**(b - 127)``, ``round(log2 |x|) = b - 127 +
[m > M]`` with ``M = floor((sqrt(2) - 1) * 2**23) = 3474675``, since
``1 + M / 2**23 < sqrt(2) < 1 + (M + 1) / 2**23``.  It is exact for every
float32 input.

On the wire, codes go 8 per uint32 word (:mod:`compjax.codecs.bitpack` with
``bits=4``), beside the float32 scale: ``4 * ceil(size / 8) + 4`` bytes per
tensor, 8x fewer than float32 plus 4 bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["BITS", "SQRT2_MANTISSA", "decode", "encode", "scale_exponent"]

#: Bits per code on the wire.
BITS = 4
#: ``floor((sqrt(2) - 1) * 2**23)``: a float32 mantissa field above it means ``1.m > sqrt(2)``.
SQRT2_MANTISSA = 3474675

_MANT = 0x7FFFFF
_BIAS = 127
_SIGN = 8  # the sign bit of a code


def _fields(a: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Biased exponent and mantissa fields (int32) of a non-negative float32 array."""
    b = jax.lax.bitcast_convert_type(a, jnp.uint32)
    return (b >> 23).astype(jnp.int32), (b & jnp.uint32(_MANT)).astype(jnp.int32)


def _pow2(e: jnp.ndarray) -> jnp.ndarray:
    """``2.0 ** e`` as float32, exactly, for integer ``e`` in ``[-126, 127]``."""
    return jax.lax.bitcast_convert_type(((e + _BIAS).astype(jnp.uint32) << 23), jnp.float32)


def scale_exponent(x: jnp.ndarray, amax: jnp.ndarray | None = None) -> jnp.ndarray:
    """``E = ceil(log2(max|x|))`` clamped to ``[-126, 127]``; 0 when ``x`` has no normal float32 entry.

    Args:
      x: any shape, float dtype (taken as float32, which is exact for bfloat16 and float16).
      amax: float32 scalar ``max|x|`` when known (e.g. the largest of a layer's shards), or None.

    Returns:
      int32 scalar: the scale is ``2**E``.
    """
    if amax is None:
        amax = jnp.max(jnp.abs(jnp.ravel(x).astype(jnp.float32)))
    amax = jnp.asarray(amax, jnp.float32)
    b, m = _fields(amax)
    e = jnp.clip(b - _BIAS + (m > 0).astype(jnp.int32), -126, 127)
    return jnp.where(b == 0, 0, e)  # zero or subnormal maximum: scale 1, every code 0


def encode(x: jnp.ndarray, amax: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Encode a tensor as E3M0 codes and its power-of-two scale (rules: the module docstring).

    Args:
      x: any shape, float dtype (float32, bfloat16, float16; computed in float32).
      amax: the float32 scalar the scale is taken from instead of ``max|x|``
        (a shard of a layer encodes with the layer's maximum), or None.

    Returns:
      ``(codes, scales)``: uint32 ``(x.size,)`` codes in 0..15 in ``x.ravel()``
      order (bit 3 the sign, bits 0..2 the exponent field), and float32 ``(1,)``
      scales holding ``2**ceil(log2(max|x|))``.

    References:
      Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey, McIlroy,
      Shen, Ramé, Szlam, Ranzato & Barham, "Streaming DiLoCo with overlapping
      communication: Towards a Distributed Free Lunch", 2025, arXiv:2501.18512.

    Examples:
      >>> import jax.numpy as jnp
      >>> from compjax.codecs import e3m0
      >>> codes, scales = e3m0.encode(jnp.array([3.0, -0.5, 0.01, 0.0, 0.3]))
      >>> scales.tolist(), codes.tolist()
      ([4.0], [7, 12, 0, 0, 3])
      >>> e3m0.decode(codes, scales, (5,)).tolist()
      [4.0, -0.5, 0.0, 0.0, 0.25]
    """
    x = jnp.ravel(x).astype(jnp.float32)
    e = scale_exponent(x, amax)
    b, m = _fields(jnp.abs(x))
    t = b - _BIAS + (m > SQRT2_MANTISSA).astype(jnp.int32) - e  # round(log2(|x| / scale))
    zero = (b == 0) | (t < -6)  # zero and subnormal entries, and |x| / scale < 2**-6.5
    c = jnp.where(zero, 0, jnp.minimum(t, 0) + 7)
    sign = jnp.where((x < 0) & ~zero, _SIGN, 0)
    return (c | sign).astype(jnp.uint32), _pow2(e)[None]


def decode(codes: jnp.ndarray, scales: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`encode`: ``±scale * 2**(c - 7)`` for ``c`` in 1..7, 0 for ``c = 0``.

    Args:
      codes: uint32 ``(prod(shape),)`` codes in 0..15.
      scales: float32 ``(1,)``: the scale.
      shape: the tensor's shape.

    Returns:
      float32 array of ``shape`` (exact: a power of two times the scale, unless
      the product is below the normal float32 range).
    """
    codes = codes.astype(jnp.uint32)
    c = (codes & jnp.uint32(7)).astype(jnp.int32)
    mag = jnp.where(c == 0, jnp.float32(0), scales[0].astype(jnp.float32) * _pow2(c - 7))
    return jnp.where((codes & jnp.uint32(_SIGN)) != 0, -mag, mag).reshape(shape)
