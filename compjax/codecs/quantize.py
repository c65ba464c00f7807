"""Quantizer codecs: each maps a layer to (codes, scales) and back.  Pure math, no collectives.

``*_encode`` returns ``codes``, a ``(x.size,)`` uint32 vector of small integers
(packed on the wire by :mod:`compjax.codecs.bitpack`), and, where the method
has them, ``scales``, a small float32 vector that travels beside the codes;
``*_decode`` maps them back to a float32 array of the layer's shape.  Random
codecs take one uniform draw ``u ~ U[0, 1)`` per element (the caller draws
them, e.g. ``jax.random.uniform(key, (x.size,))``, so the codecs stay
deterministic functions, checkable against NumPy) and are unbiased over ``u``:
``E[decode(encode(x, u))] = x``.

.. list-table::
   :header-rows: 1

   * - codec
     - bits/element
     - scales per layer
     - paper
   * - 1-bit SGD
     - 1
     - 2 per column
     - Seide et al. 2014
   * - MXNet 2-bit
     - 2
     - none (threshold is known)
     - MXNet gradient compression docs
   * - TernGrad
     - 2
     - 1 (shared, sent by max-reduce)
     - Wen et al. 2017
   * - QSGD, s levels
     - ``ceil(log2(s + 1)) + 1``
     - 1 (``‖v‖₂``)
     - Alistarh et al. 2017
   * - scaled sign
     - 1
     - 1 (``‖p‖₁ / d``)
     - Karimireddy et al. 2019
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp

__all__ = [
    "onebit_columns",
    "onebit_decode",
    "onebit_encode",
    "onebit_scales",
    "onebit_sums",
    "qsgd_bits",
    "qsgd_decode",
    "qsgd_encode",
    "sign_decode",
    "sign_encode",
    "terngrad_clip",
    "terngrad_clip_with",
    "terngrad_decode",
    "terngrad_encode",
    "twobit_decode",
    "twobit_encode",
]


# --- 1-bit SGD (Seide et al., Interspeech 2014) ------------------------------------------


def onebit_columns(shape: tuple[int, ...]) -> int:
    """Number of columns of a layer: its output units ``shape[-1]`` (ndim >= 2), else 1.

    The paper quantizes weight matrices column by column.  Here a column of a
    flax kernel ``(..., in, out)`` is ``x[..., j]``: every weight feeding output
    unit ``j`` (a column of a Dense ``(in, out)`` matrix; for a conv, all
    ``kh * kw * in`` taps of one output channel).  It is a row of PowerSGD's
    ``(out, rest)`` view (:mod:`compjax.codecs.lowrank`), and the 2-D view
    ``x.reshape(-1, out)`` is free in flax layout (no transpose).  Vectors
    (biases) and scalars are one column.
    """
    return int(shape[-1]) if len(shape) >= 2 else 1


def _as_columns(x: jnp.ndarray) -> jnp.ndarray:
    return jnp.reshape(x, (-1, onebit_columns(x.shape)))


def onebit_encode(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Quantize at threshold 0 with two reconstruction values per column.

    Each entry becomes one bit (1 where ``x >= 0``); column ``j`` is rebuilt
    with the mean of its entries ``>= 0`` and the mean of its entries ``< 0``,
    the two values that minimise the column's squared error.

    Args:
      x: a layer of any shape and float dtype (columns: :func:`onebit_columns`).

    Returns:
      ``(codes, scales)``: uint32 ``(x.size,)`` codes of 0/1 in ``x.ravel()``
      order, and float32 ``(2 * cols,)`` scales: the ``cols`` positive means,
      then the ``cols`` negative means (0 for an empty side).

    References:
      Seide, Fu, Droppo, Li & Yu, "1-bit stochastic gradient descent and its
      application to data-parallel distributed training of speech DNNs",
      Interspeech 2014, Sec. 3.
    """
    cols = _as_columns(x).astype(jnp.float32)
    return (cols >= 0).reshape(-1).astype(jnp.uint32), onebit_scales(*onebit_sums(x), cols.shape[0])


def onebit_sums(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """The column statistics of :func:`onebit_encode`: float32 ``(cols,)`` sums of ``x`` and ``|x|``, int32 counts of ``x >= 0``.

    Column sums of ``x``, ``|x|`` and of the ±1 sign give both sides' sums and counts
    (``sum>=0 = (Σx + Σ|x|) / 2``, ``sum<0 = (Σx - Σ|x|) / 2``): three plain column
    reductions, much faster on CPU than masked ones.  They add up over row
    blocks: a layer cut into shards along a dimension other than its last has
    the sums of its shards' sums.
    """
    cols = _as_columns(x).astype(jnp.float32)
    total = jnp.sum(cols, axis=0)
    absolute = jnp.sum(jnp.abs(cols), axis=0)
    n_pos = jnp.sum(cols >= 0, axis=0, dtype=jnp.int32)  # an integer count vectorizes
    return total, absolute, n_pos


def onebit_scales(total: jnp.ndarray, absolute: jnp.ndarray, n_pos: jnp.ndarray, rows: int) -> jnp.ndarray:
    """float32 ``(2 * cols,)`` scales of :func:`onebit_encode` from its column statistics (:func:`onebit_sums`) over ``rows`` rows."""
    n_pos = n_pos.astype(jnp.float32)
    n_neg = rows - n_pos
    pos_mean = jnp.where(n_pos > 0, (total + absolute) / 2 / jnp.maximum(n_pos, 1), 0.0)
    neg_mean = jnp.where(n_neg > 0, (total - absolute) / 2 / jnp.maximum(n_neg, 1), 0.0)
    return jnp.concatenate([pos_mean, neg_mean])


def onebit_decode(codes: jnp.ndarray, scales: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`onebit_encode`: float32 array of ``shape``."""
    c = onebit_columns(shape)
    bits = codes.reshape(-1, c).astype(bool)
    return jnp.where(bits, scales[:c], scales[c:]).reshape(shape)


# --- MXNet 2-bit (gradient compression FAQ) ----------------------------------------------


def twobit_encode(x: jnp.ndarray, threshold: float) -> jnp.ndarray:
    """MXNet 2-bit codes: ``0b11`` where ``x >= threshold``, ``0b10`` where ``x <= -threshold``, else ``0b00``.

    Args:
      x: a layer of any shape (the gradient plus the residual).
      threshold: positive float.

    Returns:
      uint32 ``(x.size,)`` codes in {0, 2, 3}.

    References:
      MXNet documentation, "Gradient Compression" (2-bit compression).
    """
    x = jnp.ravel(x)
    return jnp.where(x >= threshold, 3, jnp.where(x <= -threshold, 2, 0)).astype(jnp.uint32)


def twobit_decode(codes: jnp.ndarray, threshold: float, shape: tuple[int, ...]) -> jnp.ndarray:
    """``0b11 -> +threshold``, ``0b10 -> -threshold``, else 0: float32 array of ``shape``."""
    t = jnp.asarray(threshold, jnp.float32)
    return jnp.where(codes == 3, t, jnp.where(codes == 2, -t, jnp.float32(0))).reshape(shape)


# --- TernGrad (Wen et al., NeurIPS 2017) -------------------------------------------------


def terngrad_clip(x: jnp.ndarray, clip_sigma: float) -> jnp.ndarray:
    """Clip a layer to ``[-c σ, c σ]``, ``σ`` the (population) standard deviation of its entries.

    TernGrad's gradient clipping (Wen et al. 2017, Sec. 3; ``c = 2.5`` there).

    Returns:
      float32 array of ``x.shape``.
    """
    bound = clip_sigma * jnp.std(x.astype(jnp.float32))
    return jnp.clip(x.astype(jnp.float32), -bound, bound)


def terngrad_clip_with(x: jnp.ndarray, clip_sigma: float, sums: Callable, size: int) -> jnp.ndarray:
    """:func:`terngrad_clip` of a shard ``x`` of a layer of ``size`` entries.

    ``sums(s)`` turns a shard's sum into the layer's (e.g. a sum over the
    devices that hold its shards): the mean, then the mean squared deviation
    from it, as ``jnp.std`` computes them (equal to rounding).
    """
    v = x.astype(jnp.float32)
    mean = sums(jnp.sum(v)) / size
    std = jnp.sqrt(sums(jnp.sum(jnp.square(v - mean))) / size)
    bound = clip_sigma * std
    return jnp.clip(v, -bound, bound)


def terngrad_encode(x: jnp.ndarray, scaler: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    """Stochastic ternary codes of ``s · sign(x) ∘ b``, ``b_k ~ Bernoulli(|x_k| / s)``.

    ``b_k = [u_k < |x_k| / s]``, so ``E[s · sign(x_k) · b_k] = x_k`` when ``|x| <= s``.

    Args:
      x: the (clipped) layer, ``|x| <= scaler``.
      scaler: float32 scalar ``s`` (shared by all workers: the max over them of
        ``max |x|``).  ``s = 0`` sends zeros.
      u: ``x.size`` uniform draws in [0, 1) (any shape; raveled).

    Returns:
      uint32 ``(x.size,)`` codes: 0 -> 0, 1 -> +s, 2 -> -s.

    References:
      Wen, Xu, Yan, Wu, Wang, Chen & Li, "TernGrad: Ternary Gradients to Reduce
      Communication in Distributed Deep Learning", NeurIPS 2017, Sec. 3.
    """
    x = jnp.ravel(x).astype(jnp.float32)
    prob = jnp.where(scaler > 0, jnp.abs(x) / jnp.where(scaler > 0, scaler, 1.0), 0.0)
    b = jnp.ravel(u) < prob
    return jnp.where(b, jnp.where(x >= 0, 1, 2), 0).astype(jnp.uint32)


def terngrad_decode(codes: jnp.ndarray, scaler: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`terngrad_encode`: float32 array of ``shape``."""
    s = scaler.astype(jnp.float32)
    return jnp.where(codes == 1, s, jnp.where(codes == 2, -s, jnp.float32(0))).reshape(shape)


# --- QSGD (Alistarh et al., NeurIPS 2017) ------------------------------------------------


def qsgd_bits(levels: int) -> int:
    """Whole bits per element: ``ceil(log2(levels + 1))`` for the level ``0..s``, plus 1 sign bit.

    10 bits for ``s = 256``, 9 for ``s = 255``, 3 for ``s = 2``.
    """
    return math.ceil(math.log2(levels + 1)) + 1


def qsgd_encode(x: jnp.ndarray, levels: int, u: jnp.ndarray, norm: jnp.ndarray | None = None
                ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``Q_s(v)_i = ‖v‖₂ · sign(v_i) · ξ_i(v, s)`` with stochastic rounding.

    With ``r_i = s |v_i| / ‖v‖₂`` and ``l_i = floor(r_i)``, ``ξ_i = (l_i + 1) / s``
    with probability ``r_i - l_i`` (where ``u_i < r_i - l_i``), else ``l_i / s``:
    ``E[Q_s(v)] = v``.

    Args:
      x: a layer of any shape (flattened: ``v``).
      levels: ``s >= 1``.
      u: ``x.size`` uniform draws in [0, 1) (any shape; raveled).
      norm: float32 scalar ``‖v‖₂`` of the layer when ``x`` is a shard of it, or None (``x``'s own).

    Returns:
      ``(codes, scales)``: uint32 ``(x.size,)`` codes holding the level ``l`` in
      the low ``qsgd_bits(s) - 1`` bits and the sign (1 = negative) in bit
      ``qsgd_bits(s) - 1``; float32 ``(1,)`` scales: ``‖v‖₂``.

    References:
      Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient
      SGD via Gradient Quantization and Encoding", NeurIPS 2017, Sec. 3.1.
    """
    v = jnp.ravel(x).astype(jnp.float32)
    norm = jnp.linalg.norm(v) if norm is None else jnp.asarray(norm, jnp.float32)
    scale = jnp.where(norm > 0, levels / jnp.where(norm > 0, norm, 1.0), 0.0)  # one division per layer
    r = jnp.minimum(jnp.abs(v) * scale, jnp.float32(levels))  # rounding could put r an ulp above s
    low = jnp.floor(r)
    up = jnp.ravel(u) < r - low  # round up with probability r - l
    level = (low + up).astype(jnp.uint32)
    sign = (v < 0).astype(jnp.uint32) << jnp.uint32(qsgd_bits(levels) - 1)
    return level | sign, norm[None]


def qsgd_decode(codes: jnp.ndarray, scales: jnp.ndarray, levels: int, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`qsgd_encode`: float32 array of ``shape``."""
    mag_bits = qsgd_bits(levels) - 1
    level = (codes & jnp.uint32((1 << mag_bits) - 1)).astype(jnp.float32)
    neg = (codes >> jnp.uint32(mag_bits)).astype(jnp.float32)
    return (scales[0] * level / levels * (1.0 - 2.0 * neg)).reshape(shape)


# --- scaled sign (EF-signSGD, Karimireddy et al., ICML 2019) -------------------------------


def sign_encode(p: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The scaled sign ``(‖p‖₁ / d) · sign(p)`` of a layer of ``d`` entries; sign(0) is taken as +.

    Returns:
      ``(codes, scales)``: uint32 ``(p.size,)`` codes (1 where ``p >= 0``) and
      float32 ``(1,)`` scales: ``‖p‖₁ / d``.

    References:
      Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and
      other Gradient Compression Schemes", ICML 2019, Algorithm 1.
    """
    p = jnp.ravel(p).astype(jnp.float32)
    return (p >= 0).astype(jnp.uint32), jnp.mean(jnp.abs(p))[None]


def sign_decode(codes: jnp.ndarray, scales: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`sign_encode`: float32 array of ``shape``."""
    return jnp.where(codes.astype(bool), scales[0], -scales[0]).reshape(shape)
