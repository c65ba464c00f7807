"""Top-k sparsification codec (Strom 2015; Aji & Heafield 2017).

A layer of ``size`` elements keeps ``k = max(1, ceil(ratio * size))`` entries of
largest magnitude.  The payload is the int32 flat indices and the values at them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def layer_k(size: int, ratio: float) -> int:
    """Number of kept entries for a layer: ``max(1, ceil(ratio * size))``, at most ``size``.

    Args:
      size: number of elements of the layer (> 0).
      ratio: kept fraction in (0, 1].

    Returns:
      k as a Python int (static).
    """
    # Guard against float noise (0.01 * 100 = 1.0000000000000002 must give 1, not 2) with a tolerance
    # relative to ratio * size, far below its fractional part (3,000,001 * 0.001 must give 3,001).
    x = ratio * size
    k = math.ceil(x - 1e-12 * x)
    return int(min(size, max(1, k)))


def topk_select(x: jnp.ndarray, k: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Select the ``k`` entries of largest magnitude of ``x``.

    Args:
      x: array of any shape, float dtype.
      k: static number of entries to keep, ``1 <= k <= x.size``.

    Returns:
      ``(indices, values)``: int32 indices into ``x.ravel()`` of shape ``(k,)`` and
      the values ``x.ravel()[indices]`` of shape ``(k,)`` and dtype ``x.dtype``.
      Ties are broken by ``jax.lax.top_k`` (lowest index first).
    """
    flat = jnp.ravel(x)
    if k == flat.size:
        idx = jnp.arange(flat.size, dtype=jnp.int32)
        return idx, flat
    _, idx = jax.lax.top_k(jnp.abs(flat), k)
    idx = idx.astype(jnp.int32)
    return idx, flat[idx]


def zero_at(x: jnp.ndarray, indices: jnp.ndarray) -> jnp.ndarray:
    """``x`` with the entries at flat ``indices`` (int32, into ``x.ravel()``) set to 0; same shape and dtype.

    Indices at or past ``x.size`` are dropped (a skipped step sends ``x.size`` everywhere).
    """
    return jnp.ravel(x).at[indices].set(0, mode="drop").reshape(x.shape)


def randomk_select(x: jnp.ndarray, k: int, key: jax.Array) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Select ``k`` distinct entries of ``x`` uniformly at random (without replacement).

    Args:
      x: array of any shape, float dtype.
      k: static number of entries, ``1 <= k <= x.size``.
      key: PRNG key.

    Returns:
      ``(indices, values)``: int32 ``(k,)`` flat indices into ``x.ravel()`` and the
      ``(k,)`` values there, dtype ``x.dtype``.  Each entry is chosen with
      probability ``k / x.size``.
    """
    flat = jnp.ravel(x)
    if k == flat.size:
        return jnp.arange(flat.size, dtype=jnp.int32), flat
    # The k largest of d i.i.d. uniforms are a uniform k-subset; lax.top_k is far cheaper on CPU
    # than the full permutation behind jax.random.choice(replace=False).
    _, idx = jax.lax.top_k(jax.random.uniform(key, (flat.size,)), k)
    idx = idx.astype(jnp.int32)
    return idx, flat[idx]
