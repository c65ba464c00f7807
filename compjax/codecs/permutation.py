"""Uniform ``k``-subsets of ``range(d)`` from a keyed permutation: ``O(k)`` work, no pass over ``d`` entries.

Random-k (Stich et al. 2018) sends ``k`` entries of a layer of ``d`` drawn
without replacement.  Drawing them as the ``k`` largest of ``d`` random numbers
costs a pass over the layer; here they are the images of ``0, 1, ..., k - 1``
under a keyed pseudo-random **permutation** of ``range(d)``, computed only at
those ``k`` points.

**Definition.**  A layer of ``d`` entries is laid out on an ``a x b`` grid,
``a = ceil(sqrt(d))``, ``b = ceil(d / a)`` (so ``d <= a b < d + a``); the element
``x = L b + R`` has coordinates ``(L, R)``, ``0 <= L < a``, ``0 <= R < b``.
A Feistel network of :data:`ROUNDS` rounds with modular addition (the
"numeric" Feistel of format-preserving encryption, Black & Rogaway 2002)
permutes the grid; round ``r`` (0-based) of layer ``l`` is::

    r even:  L = (L + F(r, R) mod a)  mod a
    r odd:   R = (R + F(r, L) mod b)  mod b
    F(r, v) mod m = min(m - 1, floor(m * uniform))   with
    uniform = (bits(stream, ((l * ROUNDS + r) << 16) + v) >> 8) * 2**-24

(``bits`` and ``stream`` of :mod:`compjax.codecs.random`; ``v < 2**16`` since
``a, b <= 2**16`` for ``d <= 2**32``).  Each round is a bijection of the grid
(the other coordinate is left as it is and fixes the shift), so the network
is one.  Points that land outside ``range(d)`` (``L b + R >= d``, at most
``a - 1`` of the ``a b`` grid points, none when ``d`` is a product such as
``9 c**2``) go through the network again until they land inside ("cycle
walking", Black & Rogaway 2002): a permutation of ``range(d)``.  The
selection of layer ``l`` is ``[perm(0), ..., perm(k - 1)]``: ``k`` distinct
indices in no particular order, each index kept with probability ``k / d``
over keys.

Cost: ``ROUNDS`` hash evaluations per selected index, ``k`` of them (about
``k / d`` of a pass over the layer); the walk is a ``lax.while_loop`` whose
body runs again only while some point is outside its layer (usually once
in all).

References:
  Black & Rogaway, "Ciphers with Arbitrary Finite Domains", CT-RSA 2002
  (generalized Feistel on ``Z_a x Z_b``, cycle walking).  Luby & Rackoff,
  "How to construct pseudorandom permutations from pseudorandom functions",
  SIAM J. Comput. 1988.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from compjax.codecs import random as cr

__all__ = ["ROUNDS", "grid", "subsets"]

#: Feistel rounds (Luby & Rackoff: 4 make a strong pseudo-random permutation from a pseudo-random function).
ROUNDS = 6


def grid(d: int) -> tuple[int, int]:
    """The ``(a, b)`` grid of a layer of ``d`` entries: ``a = ceil(sqrt(d))``, ``b = ceil(d / a)``.

    Raises:
      ValueError: ``d`` outside ``[1, 2**32]``.

    Examples:
      >>> grid(36864), grid(1000), grid(1)
      ((192, 192), (32, 32), (1, 1))
    """
    if not 1 <= d <= cr.MAX_SIZE:
        raise ValueError(f"a layer must have between 1 and 2**32 entries, got {d}")
    a = math.isqrt(d - 1) + 1
    return a, -(-d // a)


def _rounds(st, L, R, a, b, layer):
    """The Feistel network on uint32 coordinates (all arrays of one shape)."""
    for r in range(ROUNDS):
        m, v = (a, R) if r % 2 == 0 else (b, L)
        u = cr.uniform_at(st, ((layer * jnp.uint32(ROUNDS) + jnp.uint32(r)) << jnp.uint32(16)) + v)
        f = jnp.minimum((u * m.astype(jnp.float32)).astype(jnp.uint32), m - jnp.uint32(1))
        if r % 2 == 0:
            L = L + f
            L = jnp.where(L >= a, L - a, L)
        else:
            R = R + f
            R = jnp.where(R >= b, R - b, R)
    return L, R


def subsets(st: jnp.ndarray, sizes: Sequence[int], ks: Sequence[int]) -> list[jnp.ndarray]:
    """Per layer ``l``, the ``k_l`` indices ``perm_l(0), ..., perm_l(k_l - 1)`` of its keyed permutation.

    All layers are computed in one vector of ``sum(ks)`` points (one walk loop
    for all).  See the module docstring for the definition.

    Args:
      st: uint32 ``(2,)`` stream (:func:`compjax.codecs.random.stream`).
      sizes: entries ``d_l`` of each layer, ``1 <= d_l <= 2**31 - 1``.
      ks: static number of entries per layer, ``1 <= k_l <= d_l``.

    Returns:
      One int32 ``(k_l,)`` array of distinct indices into ``range(d_l)`` per layer.

    Raises:
      ValueError: a ``k_l`` outside ``[1, d_l]``, a ``d_l`` outside ``[1, 2**31 - 1]``,
        or ``sizes`` and ``ks`` of different lengths.

    Examples:
      >>> import jax.numpy as jnp
      >>> from compjax.codecs import random as cr
      >>> [idx] = subsets(cr.stream(jnp.zeros(2, jnp.uint32), 0, 0), [10], [10])
      >>> sorted(idx.tolist())
      [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    if len(sizes) != len(ks):
        raise ValueError(f"one k per layer: {len(sizes)} sizes, {len(ks)} ks")
    parts: list[list] = [[], [], [], [], [], []]  # L, R, a, b, d, layer
    for layer, (d, k) in enumerate(zip(sizes, ks)):
        if not 1 <= d < 2**31:
            raise ValueError(f"sizes must be in [1, 2**31 - 1], got {d}")
        if not 1 <= k <= d:
            raise ValueError(f"k must be in [1, {d}], got {k}")
        a, b = grid(d)
        rows = -(-k // b)
        x = jax.lax.broadcasted_iota(jnp.uint32, (rows, b), 0).reshape(-1)[:k]
        y = jax.lax.broadcasted_iota(jnp.uint32, (rows, b), 1).reshape(-1)[:k]
        for part, v in zip(parts, (x, y, a, b, d, layer)):
            part.append(v if not isinstance(v, int) else jnp.full((k,), v, jnp.uint32))
    if not ks:
        return []
    L, R, a, b, d, layer = (jnp.concatenate(p) for p in parts)
    st = jnp.asarray(st).astype(jnp.uint32)

    def outside(carry):
        L, R = carry
        return jnp.any(L * b + R >= d)

    def walk(carry):
        L, R = carry
        L2, R2 = _rounds(st, L, R, a, b, layer)
        out = L * b + R >= d
        return jnp.where(out, L2, L), jnp.where(out, R2, R)

    L, R = jax.lax.while_loop(outside, walk, _rounds(st, L, R, a, b, layer))
    flat = (L * b + R).astype(jnp.int32)
    out, at = [], 0
    for k in ks:
        out.append(flat[at : at + k])
        at += k
    return out
