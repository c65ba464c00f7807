"""Quantizer codecs: each maps a layer to (codes, scales) and back.  Pure math, no collectives.

``encode`` returns ``codes``, a ``(x.size,)`` uint32 vector of small integers
(packed by :mod:`compjax.codecs.bitpack`) and ``scales``, a small float32 vector
that travels beside them; ``decode`` inverts it to the layer's shape.  Random
codecs take a ``jax.random`` key and are unbiased: ``E[decode(encode(x))] = x``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = [
    "onebit_columns",
    "onebit_decode",
    "onebit_encode",
    "qsgd_bits",
    "qsgd_decode",
    "qsgd_encode",
    "sign_decode",
    "sign_encode",
    "terngrad_clip",
    "terngrad_decode",
    "terngrad_encode",
    "twobit_decode",
    "twobit_encode",
]


# --- 1-bit SGD (Seide et al., Interspeech 2014) ------------------------------------------


def onebit_columns(shape: tuple[int, ...]) -> int:
    """Number of columns of a layer: its output units ``shape[-1]`` (ndim >= 2), else 1.

    A column of a flax kernel ``(..., in, out)`` is ``x[..., j]``: every weight
    feeding output unit ``j`` (a column of the ``(in, out)`` weight matrix as in
    the paper, and a row of PowerSGD's ``(out, rest)`` view).
    """
    return int(shape[-1]) if len(shape) >= 2 else 1


def _as_columns(x: jnp.ndarray) -> jnp.ndarray:
    return jnp.reshape(x, (-1, onebit_columns(x.shape)))


def onebit_encode(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Quantize at threshold 0 with two reconstruction values per column.

    Each entry becomes one bit (1 where ``x >= 0``); column ``j`` is rebuilt
    with the mean of its entries ``>= 0`` and the mean of its entries ``< 0``,
    the two values that minimise the squared error (Seide et al. 2014, Sec. 3).

    Returns:
      ``codes`` uint32 ``(x.size,)`` of 0/1 and ``scales`` float32 ``(2 * cols,)``:
      the positive means, then the negative means (0 for an empty side).
    """
    cols = _as_columns(x).astype(jnp.float32)
    pos = cols >= 0
    n_pos = jnp.sum(pos, axis=0)
    n_neg = cols.shape[0] - n_pos
    pos_mean = jnp.sum(jnp.where(pos, cols, 0.0), axis=0) / jnp.maximum(n_pos, 1)
    neg_mean = jnp.sum(jnp.where(pos, 0.0, cols), axis=0) / jnp.maximum(n_neg, 1)
    return pos.reshape(-1).astype(jnp.uint32), jnp.concatenate([pos_mean, neg_mean])


def onebit_decode(codes: jnp.ndarray, scales: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`onebit_encode` (float32, ``shape``)."""
    c = onebit_columns(shape)
    bits = codes.reshape(-1, c).astype(bool)
    return jnp.where(bits, scales[:c], scales[c:]).reshape(shape)


# --- MXNet 2-bit (gradient compression FAQ) ----------------------------------------------


def twobit_encode(x: jnp.ndarray, threshold: float) -> jnp.ndarray:
    """MXNet 2-bit codes: ``0b11`` where ``x >= threshold``, ``0b10`` where ``x <= -threshold``, else ``0b00``.

    Returns:
      uint32 ``(x.size,)`` codes in {0, 2, 3}.
    """
    x = jnp.ravel(x)
    return jnp.where(x >= threshold, 3, jnp.where(x <= -threshold, 2, 0)).astype(jnp.uint32)


def twobit_decode(codes: jnp.ndarray, threshold: float, shape: tuple[int, ...]) -> jnp.ndarray:
    """``0b11 -> +threshold``, ``0b10 -> -threshold``, else 0 (float32, ``shape``)."""
    t = jnp.float32(threshold)
    return jnp.where(codes == 3, t, jnp.where(codes == 2, -t, jnp.float32(0))).reshape(shape)


# --- TernGrad (Wen et al., NeurIPS 2017) -------------------------------------------------


def terngrad_clip(x: jnp.ndarray, clip_sigma: float) -> jnp.ndarray:
    """Clip a layer to ``[-c σ, c σ]`` with ``σ`` the standard deviation of its entries (Sec. 3.3)."""
    bound = clip_sigma * jnp.std(x.astype(jnp.float32))
    return jnp.clip(x.astype(jnp.float32), -bound, bound)


def terngrad_encode(x: jnp.ndarray, scaler: jnp.ndarray, key: jax.Array) -> jnp.ndarray:
    """Stochastic ternary codes ``s · sign(x) · b``, ``b ~ Bernoulli(|x| / s)`` (Eq. 2).

    Args:
      x: the (clipped) layer, ``|x| <= scaler``.
      scaler: float32 scalar ``s`` (shared by all workers: the max over them of ``max |x|``).
      key: PRNG key.

    Returns:
      uint32 ``(x.size,)`` codes: 0 -> 0, 1 -> +s, 2 -> -s.
    """
    x = jnp.ravel(x).astype(jnp.float32)
    prob = jnp.where(scaler > 0, jnp.abs(x) / jnp.where(scaler > 0, scaler, 1.0), 0.0)
    b = jax.random.uniform(key, x.shape) < prob
    return jnp.where(b, jnp.where(x >= 0, 1, 2), 0).astype(jnp.uint32)


def terngrad_decode(codes: jnp.ndarray, scaler: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`terngrad_encode` (float32, ``shape``)."""
    s = scaler.astype(jnp.float32)
    return jnp.where(codes == 1, s, jnp.where(codes == 2, -s, jnp.float32(0))).reshape(shape)


# --- QSGD (Alistarh et al., NeurIPS 2017) ------------------------------------------------


def qsgd_bits(levels: int) -> int:
    """Whole bits per element: ``ceil(log2(levels + 1))`` for the level 0..s, plus 1 sign bit."""
    return math.ceil(math.log2(levels + 1)) + 1


def qsgd_encode(x: jnp.ndarray, levels: int, key: jax.Array) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``Q_s(v)_i = ‖v‖₂ · sign(v_i) · ξ_i(v, s)`` with stochastic rounding (Sec. 3.1).

    ``ξ_i = l / s`` or ``(l + 1) / s`` where ``l = floor(s |v_i| / ‖v‖₂)``, rounded
    up with probability ``s |v_i| / ‖v‖₂ - l``: unbiased.

    Returns:
      ``codes`` uint32 ``(x.size,)``: the level in the low bits and the sign
      (1 = negative) in bit ``qsgd_bits(levels) - 1``; ``scales`` float32 ``(1,)``: ``‖v‖₂``.
    """
    v = jnp.ravel(x).astype(jnp.float32)
    norm = jnp.linalg.norm(v)
    r = jnp.where(norm > 0, levels * jnp.abs(v) / jnp.where(norm > 0, norm, 1.0), 0.0)
    level = jnp.floor(r + jax.random.uniform(key, v.shape)).astype(jnp.uint32)
    level = jnp.minimum(level, jnp.uint32(levels))
    sign = (v < 0).astype(jnp.uint32) << jnp.uint32(qsgd_bits(levels) - 1)
    return level | sign, norm[None]


def qsgd_decode(codes: jnp.ndarray, scales: jnp.ndarray, levels: int, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`qsgd_encode` (float32, ``shape``)."""
    mag_bits = qsgd_bits(levels) - 1
    level = (codes & jnp.uint32((1 << mag_bits) - 1)).astype(jnp.float32)
    neg = (codes >> jnp.uint32(mag_bits)).astype(jnp.float32)
    return (scales[0] * level / levels * (1.0 - 2.0 * neg)).reshape(shape)


# --- scaled sign (EF-signSGD, Karimireddy et al., ICML 2019) -------------------------------


def sign_encode(p: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(‖p‖₁ / d) · sign(p)`` (Algorithm 1 of EF-signSGD); sign(0) is taken as +.

    Returns:
      ``codes`` uint32 ``(p.size,)`` (1 where ``p >= 0``) and ``scales`` float32 ``(1,)``: ``‖p‖₁ / d``.
    """
    p = jnp.ravel(p).astype(jnp.float32)
    return (p >= 0).astype(jnp.uint32), jnp.mean(jnp.abs(p))[None]


def sign_decode(codes: jnp.ndarray, scales: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`sign_encode` (float32, ``shape``)."""
    return jnp.where(codes.astype(bool), scales[0], -scales[0]).reshape(shape)
