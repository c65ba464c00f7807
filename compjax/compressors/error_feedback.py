"""Error feedback (residual memory), written once for every compressor that has it.

Seide et al. 2014; Strom 2015; Karimireddy et al. 2019 (EF-SGD, Algorithm 2)::

    p_t = g_t + e_t            (accumulate)
    e_{t+1} = p_t - D(C(p_t))  (remainder: what was not sent)

so that, per worker, ``sum_t D(C(p_t)) + e_T = sum_t g_t`` (nothing is lost).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from compjax.codecs.sparse import zero_at


def init_residual(params: Any) -> Any:
    """A zero residual with the structure, shapes and dtypes of ``params``."""
    return jax.tree.map(jnp.zeros_like, params)


def accumulate(residual: Any, grads: Any) -> Any:
    """``p = g + e`` leaf by leaf; ``residual=None`` (no error feedback) returns ``grads``."""
    if residual is None:
        return grads
    return jax.tree.map(lambda g, e: g + e.astype(g.dtype), grads, residual)


def remainder(accumulated: Any, decoded: Any) -> Any:
    """``e = p - D(C(p))`` leaf by leaf: the part of ``p`` that was not sent."""
    return jax.tree.map(lambda p, d: p - d.astype(p.dtype), accumulated, decoded)


def remainder_sparse(accumulated: Any, indices: list) -> Any:
    """``e = p - D(C(p))`` for a compressor that sent ``p`` exactly at flat ``indices`` per leaf.

    The sent entries leave the residual (set to 0); the rest stays.  ``indices``
    is a list of int32 arrays in the leaf order of ``accumulated``.
    """
    leaves, treedef = jax.tree.flatten(accumulated)
    out = [zero_at(p, idx) for p, idx in zip(leaves, indices)]
    return jax.tree.unflatten(treedef, out)
