"""Top-k selection through a sampled threshold (Lin et al., ICLR 2018, Sec. 3.2 and reference code).

Exact ``jax.lax.top_k`` on millions of entries sorts; DGC instead estimates the
threshold from a small sample of ``|x|``, keeps the candidates above it and
takes the exact top ``k`` among those.  Whenever between ``k`` and ``capacity``
entries pass the threshold, every true top-k entry is a candidate, so the
result **equals** exact top-k; the threshold is adjusted (x0.8 down, x1.25 up,
at most ``max_iters`` times, as in the authors' code) until that holds, and
otherwise the selection falls back to exact ``lax.top_k``.  Shapes are static
(``capacity`` candidates), so the output is always exactly ``k`` entries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["sample_size", "sampled_topk"]


def sample_size(size: int, k: int, sample_ratio: float) -> int:
    """Entries sampled: ``ceil(sample_ratio * size)``, at least ``2 * size / k`` (~2/ratio), at most ``size``."""
    return int(min(size, max(math.ceil(sample_ratio * size), math.ceil(2 * size / k), 1)))


def sampled_topk(
    x: jnp.ndarray, k: int, sample_ratio: float, key: jax.Array, *, capacity: int | None = None, max_iters: int = 10
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The ``k`` entries of largest magnitude of ``x``, found through a sampled threshold.

    Args:
      x: array of any shape, float dtype.
      k: static number of entries to keep, ``1 <= k <= x.size``.
      sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1].
      key: PRNG key of the sample's random start (strided sample).
      capacity: static number of candidates kept (default ``min(size, 4 k)``).
      max_iters: threshold adjustments before falling back to exact top-k.

    Returns:
      ``(indices, values)``: int32 ``(k,)`` flat indices and ``(k,)`` values,
      the same set as :func:`compjax.codecs.topk_select` (ties aside).
    """
    flat = jnp.ravel(x)
    size = flat.size
    mag = jnp.abs(flat)
    capacity = min(size, 4 * k) if capacity is None else min(size, max(capacity, k))
    if k >= size or capacity >= size:
        _, idx = jax.lax.top_k(mag, k)
        idx = idx.astype(jnp.int32)
        return idx, flat[idx]
    n_s = sample_size(size, k, sample_ratio)
    stride = size // n_s
    start = jax.random.randint(key, (), 0, stride)
    sample = jax.lax.dynamic_slice(mag, (start,), ((n_s - 1) * stride + 1,))[::stride]
    k_s = max(1, math.ceil(n_s * k / size))
    thr0 = jax.lax.top_k(sample, k_s)[0][-1]

    def count(thr):
        return jnp.sum(mag >= thr)

    def adjust(carry):
        thr, c, it = carry
        thr = jnp.where(c < k, thr * 0.8, thr * 1.25)
        return thr, count(thr), it + 1

    def keep_going(carry):
        _, c, it = carry
        return ((c < k) | (c > capacity)) & (it < max_iters)

    thr, c, _ = jax.lax.while_loop(keep_going, adjust, (thr0, count(thr0), 0))

    def from_candidates(_):
        (cand,) = jnp.nonzero(mag >= thr, size=capacity, fill_value=0)
        cand_mag = jnp.where(jnp.arange(capacity) < c, mag[cand], -1.0)
        _, pos = jax.lax.top_k(cand_mag, k)
        return cand[pos].astype(jnp.int32)

    def exact(_):
        return jax.lax.top_k(mag, k)[1].astype(jnp.int32)

    idx = jax.lax.cond((c >= k) & (c <= capacity), from_candidates, exact, None)
    return idx, flat[idx]
