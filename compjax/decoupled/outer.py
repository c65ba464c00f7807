"""The outer optimizer of asynchronous merges: Nesterov momentum that steps once per full round of tokens."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax._checks import check_range

__all__ = ["DelayedNesterovState", "delayed_nesterov"]


class DelayedNesterovState(NamedTuple):
    """State of :func:`delayed_nesterov`.

    Attributes:
      progress: float32 scalar, the share of a full round merged since the momentum last stepped, in ``[0, 1)``.
      trace: the momentum ``m`` (a pytree like the parameters, float32 or their dtype).
      buffer: the outer gradients merged since the momentum last stepped, summed (like ``trace``).
    """

    progress: jax.Array
    trace: Any
    buffer: Any


def delayed_nesterov(learning_rate: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformationExtraArgs:
    r"""Delayed Nesterov: outer momentum that steps once per full round's share of merges, plain steps between.

    With asynchronous merges of part of the learners (a syncer's ``partial_rounds="share"``), each
    merge carries a *share* ``s ∈ (0, 1]`` of a full round (its tokens over those of a full round) and
    an outer gradient ``g`` already scaled by it.  Applying Nesterov momentum at every such merge
    steps the momentum several times per round of tokens, and it keeps pushing after the last merges
    of a run (the momentum acceleration of stale updates that Liu et al. 2024 identify).  Delayed
    Nesterov (Liu et al. 2024, Algorithm "Delayed Nesterov update", with momentum activation
    ``c = 0``) steps the momentum once per ``N`` arrivals of ``N`` workers and applies the outer
    gradients in between without it.  Here a merge counts by its share instead of per arrival, so
    merges of any number of contributors fit:

    .. math::

        P \leftarrow P + s, \quad B \leftarrow B + g; \qquad
        \text{if } P \ge 1:\ m \leftarrow \beta m + B,\ \Delta\theta = -\eta (g + \beta m),\
        B \leftarrow 0,\ P \leftarrow P - 1; \qquad \text{else } \Delta\theta = -\eta g .

    With full rounds only (``s = 1`` every merge) this is ``optax.sgd(η, momentum=β, nesterov=True)``
    exactly, so synchronous DiLoCo's outer step is unchanged.  With ``N`` equal arrivals of share
    ``1/N`` each (``g = g_i / N``) it is the reference rule of Liu et al. (HALoS's
    ``DelayedNesterovOptimizer`` with ``buffer_size=N``, ``c=0``).

    Args:
      learning_rate: ``η``, the outer learning rate, > 0.
      momentum: ``β``, in ``[0, 1)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(updates, state, params=None, *,
      share=1.0)`` takes the merge's share (a float or float32 scalar in ``(0, 1]``; values outside are
      clipped to ``[0, 1]``), and whose state is :class:`DelayedNesterovState`.

    Raises:
      ValueError: ``learning_rate`` <= 0 or ``momentum`` outside ``[0, 1)``.

    References:
      Liu et al., "Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135 (2024),
      Delayed Nesterov update; reference code: HALoS (ICML 2025), ``src/halos/opt.py``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from compjax.decoupled import delayed_nesterov
      >>> tx = delayed_nesterov(0.5, 0.9)
      >>> state = tx.init(jnp.zeros(2))
      >>> step, state = tx.update(jnp.ones(2), state, share=0.5)  # half a round: no momentum yet
      >>> step
      Array([-0.5, -0.5], dtype=float32)
      >>> step, state = tx.update(jnp.ones(2), state, share=0.5)  # a full round: m = 2, step -0.5 (1 + 0.9 m)
      >>> step
      Array([-1.4, -1.4], dtype=float32)
    """
    check_range("learning_rate", learning_rate, 0.0, None, lo_open=True)
    check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
    lr, beta = float(learning_rate), float(momentum)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)  # arrays are immutable: trace and buffer may share them
        return DelayedNesterovState(jnp.zeros((), jnp.float32), zeros, zeros)

    def update(updates, state, params=None, *, share=1.0, **extra):
        del params, extra
        progress = state.progress + jnp.clip(jnp.asarray(share, jnp.float32), 0.0, 1.0)
        full = progress >= 1.0 - 1e-6
        buffer = jax.tree.map(lambda b, g: b + g, state.buffer, updates)
        trace = jax.tree.map(lambda m, b: jnp.where(full, beta * m + b, m), state.trace, buffer)
        step = jax.tree.map(lambda g, m: (-lr * (g + jnp.where(full, beta * m, 0.0))).astype(g.dtype), updates, trace)
        buffer = jax.tree.map(lambda b: jnp.where(full, jnp.zeros_like(b), b), buffer)
        progress = jnp.where(full, jnp.maximum(progress - 1.0, 0.0), progress)
        return step, DelayedNesterovState(progress, trace, buffer)

    return optax.GradientTransformationExtraArgs(init, update)
