"""Low-rank codec pieces for PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1).

Matrix view: a parameter of shape ``(..., out)`` (flax layout: Dense ``(in, out)``,
Conv ``(kh, kw, in, out)``) is viewed as the matrix ``(out, rest)`` with
``rest = prod(shape[:-1])``, the PyTorch ``view(out, -1)`` layout of the paper's
reference code.  ``P = M Q`` then has shape ``(out, r)`` and ``Q`` has shape
``(rest, r)``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

#: Added to column norms in Gram-Schmidt so that a zero column stays zero
#: (``0 / (0 + eps) = 0``) instead of becoming NaN.
ORTHO_EPS = 1e-8


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(m, n) = (out, rest)`` of the matrix view of a parameter of ``shape`` (ndim >= 2)."""
    if len(shape) < 2:
        raise ValueError(f"matrix view needs ndim >= 2, got shape {shape}")
    return int(shape[-1]), int(math.prod(shape[:-1]))


def to_matrix(x: jnp.ndarray) -> jnp.ndarray:
    """View ``x`` of shape ``(..., out)`` as the ``(out, rest)`` matrix."""
    m, n = matrix_shape(x.shape)
    return jnp.reshape(x, (n, m)).T


def from_matrix(mat: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """Inverse of :func:`to_matrix`: ``(out, rest)`` back to ``shape``."""
    return jnp.reshape(mat.T, shape)


def use_lowrank(shape: tuple[int, ...], rank: int, min_compression_rate: float) -> bool:
    """Whether a parameter is compressed with rank ``min(rank, m, n)``.

    Vectors and scalars go dense.  A matrix ``(m, n)`` is compressed iff
    ``(m + n) * r * min_compression_rate < m * n`` with ``r = min(rank, m, n)``
    (the rule of PyTorch's ``powerSGD_hook``).
    """
    if len(shape) < 2:
        return False
    m, n = matrix_shape(shape)
    r = min(rank, m, n)
    return (m + n) * r * min_compression_rate < m * n


def orthonormalize(p: jnp.ndarray, eps: float = ORTHO_EPS) -> jnp.ndarray:
    """Orthonormalize the columns of ``p`` by (modified) Gram-Schmidt.

    Column i is divided by ``||column|| + eps`` and then projected out of the
    later columns, as in ``_orthogonalize_gram_schmidt`` of PyTorch's PowerSGD
    hook.  The PowerSGD output ``P̂ P̂ᵀ M`` does not depend on column signs.

    Args:
      p: ``(m, r)`` float matrix with ``r <= m``.
      eps: added to each column norm.

    Returns:
      ``(m, r)`` matrix with orthonormal columns (zero columns stay zero).
    """
    cols = []
    for i in range(p.shape[1]):
        v = p[:, i]
        for q in cols:  # modified Gram-Schmidt: project out earlier columns one by one
            v = v - jnp.dot(q, v) * q
        cols.append(v / (jnp.linalg.norm(v) + eps))
    return jnp.stack(cols, axis=1)
