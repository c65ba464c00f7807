"""Error feedback (residual memory), written once for every compressor that has it.

Seide et al. 2014; Strom 2015; Karimireddy et al. 2019 (EF-SGD, Algorithm 2)::

    p_t = g_t + e_t            (accumulate)
    e_{t+1} = p_t - D(C(p_t))  (remainder: what was not sent)

so that, per worker, ``sum_t D(C(p_t)) + e_T = sum_t g_t`` (nothing is lost).
:func:`compjax.compressors.base.compressor` applies both steps around a
compressor's exchange when ``error_feedback=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp

from compjax.codecs.sparse import zero_at


class SentAt(NamedTuple):
    """What a sparsifying exchange sent: each leaf's entries at ``indices`` exactly.

    Attributes:
      indices: one int32 array of flat indices per leaf (into ``leaf.ravel()``).
    """

    indices: list


#: What an exchange reports as sent: the decoded own payload per leaf, or :class:`SentAt`.
Sent = Sequence[jnp.ndarray] | SentAt


def accumulate(residual: Sequence[jnp.ndarray], grads: Sequence[jnp.ndarray], decay=1.0) -> list[jnp.ndarray]:
    """``p = decay * e + g`` leaf by leaf, in the residual's dtype (the parameters' dtype).

    ``decay`` (``β`` in [0, 1], a number or a traced scalar) makes the memory a decayed accumulator,
    ``e ← β e + g`` (SparseLoCo, Sarfi et al. 2025; DeMo, Peng et al. 2024); the default 1 is plain
    error feedback, ``p = e + g``, computed without a multiplication.
    """
    if isinstance(decay, (int, float)) and decay == 1:
        return [e + g.astype(e.dtype) for g, e in zip(grads, residual)]
    return [(decay * e).astype(e.dtype) + g.astype(e.dtype) for g, e in zip(grads, residual)]


def remainder(accumulated: Sequence[jnp.ndarray], sent: Sent) -> list[jnp.ndarray]:
    """``e = p - D(C(p))`` leaf by leaf: the part of ``p`` that was not sent.

    ``sent`` is either the decoded own payload per leaf (subtracted), or
    :class:`SentAt` for a compressor that sent ``p`` exactly at some entries
    (those entries leave the residual, set to 0; the rest stays).
    """
    if isinstance(sent, SentAt):
        return [zero_at(p, idx) for p, idx in zip(accumulated, sent.indices)]
    return [p - d.astype(p.dtype) for p, d in zip(accumulated, sent)]
