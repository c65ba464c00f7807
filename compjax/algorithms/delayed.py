"""Delayed Gradient Averaging (Zhu, Lin, Lu & Han, NeurIPS 2021)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax._checks import check_range
from compjax.collectives import AxisName
from compjax.compressors import base
from compjax.compressors.identity import identity


class DelayedAveragingState(NamedTuple):
    """State of :func:`delayed_averaging`.

    Attributes:
      history: this worker's local gradient sums of the periods whose averages
        have not arrived yet, one ``(slots, *shape)`` ring buffer per compressed
        leaf (slot ``p mod slots`` holds period ``p``'s sum), in the gradients'
        dtype, ``slots = 1 + ceil((delay - 1) / period)`` copies of the model
        (``delay`` copies with ``period = 1``: slot ``t mod delay`` holds
        ``g_t``).  An empty tuple when ``delay == 0`` and ``period == 1``.
      inner: the state of the compressor that carries the delayed exchange
        (over the list of compressed leaves); its ``payload_bytes`` counts that
        exchange (0 in the steps that receive no average: the first
        ``delay + period - 1`` steps, and all but one step in ``period``).
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count of this transform's own
        collective in the last step (the 4-byte non-finite vote);
        :func:`compjax.payload_bytes` adds the inner compressor's.
    """

    history: tuple
    inner: Any
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def history_slots(delay: int, period: int = 1) -> int:
    """Slots of :func:`delayed_averaging`'s history: periods whose averages are still to arrive.

    ``1 + ceil((delay - 1) / period)``: ``delay`` with ``period = 1``, 0 for
    synchronous SGD (``delay = 0``, ``period = 1``), 1 for local SGD
    (``delay = 0``, ``period > 1``).  Each slot is one copy of the gradients.
    """
    return 1 + -(-(delay - 1) // period)


def delayed_averaging(
    delay: int,
    *,
    axis_name: AxisName,
    period: int | None = None,
    compressor: optax.GradientTransformation | None = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Delayed Gradient Averaging: apply the local gradients now, swap in their average ``delay`` steps later.

    Zhu et al., NeurIPS 2021 (Sec. 3, Algorithm 1: period ``K``, delay ``D``).
    With the default period (``K = 1``) worker ``i`` at step ``t`` returns::

        update_t = g_t - g_{t-D} + mean_j g^j_{t-D}      (t >= D)
        update_t = g_t                                    (t <  D: nothing has arrived yet)

    so that after ``t`` steps every worker has applied the average of all
    gradients up to ``t - D`` plus its own last ``D`` local gradients.  With
    ``period = K`` the workers average only once per period: ``S_p``, the sum of
    a worker's local gradients over period ``p`` (steps ``pK .. pK + K - 1``),
    is averaged and arrives ``D`` steps after the period ends::

        update_t = g_t - S_p + mean_j S^j_p   (t = pK + K - 1 + D)
        update_t = g_t                        (any other step)

    so a worker's model is the average of every period that has arrived plus
    its own gradients since.  ``K = 1`` is the rule above (``S_t = g_t``);
    ``D = 0, K = 1`` is synchronous data-parallel SGD (the update is the mean of
    this step's gradients); ``D = 0, K > 1`` is local SGD that averages the
    workers' models every ``K`` steps.  The collective issued in step ``t`` with
    ``D >= 1`` reads only sums from the state, not the gradient given to this
    update: nothing in the step waits on it, so XLA may overlap it with the
    step's computation (and on a slow link it has ``D`` steps to arrive).  One
    step in ``K`` sends: the bytes per step fall ``K``-fold.

    **Stability.** The local gradient acts on a worker's own model at once and
    is taken back when its average arrives, so the workers' deviations from
    their average are pushed back only for ``D`` to ``D + K`` steps.  With
    momentum after this transformation and ``K = 1`` that bounded push makes
    the deviations grow in every direction of curvature ``lambda`` with
    ``lr * lambda`` above a bound that falls with ``D`` (momentum 0.9: 1.0 for
    ``D = 2``, 0.07 for ``D = 10``, against 3.8 without delay); a long enough
    period restores most of the synchronous range (``K = 20``: 2.7 for
    ``D = 2`` or 5, 1.8 for ``D = 10``; but ``K = 10, D = 10``: 0.05).

    The exchange goes through ``compressor`` (any compjax compressor over the
    same ``axis_name``; its state, e.g. error feedback, is kept in ``inner``);
    the default is a dense all-reduce (:func:`compjax.identity`).  The history
    is always finite, so an inner compressor's own non-finite vote is redundant
    (build it with ``skip_nonfinite=False``).

    **Memory**: the state holds :func:`history_slots` ``(D, K) = 1 + ceil((D - 1) / K)``
    copies of the gradients (``D`` with ``K = 1``; one ring buffer per leaf)
    besides the compressor's state.

    With ``skip_nonfinite`` (default) the non-finite vote of the compressor
    pipeline (:mod:`compjax.compressors.base`) guards the history: a NaN on any
    worker skips the step on all workers (the step count, which places the
    periods, stays).  That vote is a 4-byte all-reduce on the current gradient
    in every step; the delayed exchange does not wait for it (the vote only
    selects what the step keeps), but the vote itself is a round trip per step:
    on a high-latency link turn it off to keep the method fully latency-tolerant.

    Args:
      delay: ``D``, steps between the end of a period and the arrival of its
        average, an integer >= 0 (fixes the state's shape: ``static_args`` of
        ``optax.inject_hyperparams``).
      axis_name: the worker axis (None: one worker, the update is ``g_t``).
      period: ``K``, steps per averaged period, an integer >= 1, or None for 1
        (fixes the state's shape: list it in ``static_args`` of
        ``optax.inject_hyperparams`` when given; None is not injected).
      compressor: the transformation that averages the periods' sums over
        ``axis_name``, or None for a dense all-reduce.
      skip_nonfinite: the non-finite guard.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update(grads, state)`` takes
      this worker's local gradients and returns the update above (same tree,
      shapes and dtypes).

    Raises:
      ValueError: ``delay`` not an integer >= 0, ``period`` not an integer >= 1,
        or ``compressor`` not an optax transformation (build time).

    References:
      Zhu, Lin, Lu & Han, "Delayed Gradient Averaging: Tolerate the
      Communication Latency for Federated Learning", NeurIPS 2021.

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = cj.delayed_averaging(2, axis_name=None)
      >>> g = {"w": jnp.ones(3)}
      >>> state = tx.init(g)
      >>> out, state = tx.update(g, state)   # t < D: the local gradient alone
      >>> out["w"]
      Array([1., 1., 1.], dtype=float32)
      >>> state.history[0].shape   # D copies of each leaf
      (2, 3)
      >>> cj.delayed_averaging(10, axis_name=None, period=20).init(g).history[0].shape
      (2, 3)
    """
    check_range("delay", delay, 0, None, integer=True, static=True)
    period = 1 if period is None else period
    check_range("period", period, 1, None, integer=True, static=True)
    delay, period = int(delay), int(period)
    if compressor is not None and not isinstance(compressor, optax.GradientTransformation):
        raise ValueError(f"compressor must be an optax GradientTransformation or None, got {compressor!r}")
    inner = optax.with_extra_args_support(
        identity(axis_name, skip_nonfinite=False) if compressor is None else compressor
    )
    slots = history_slots(delay, period)

    def init_fields(xs):
        history = tuple(jnp.zeros((slots, *x.shape), x.dtype) for x in xs) if slots else ()
        return {"history": history, "inner": inner.init(list(xs))}

    def exchange(ps, fields, ctx):
        if slots == 0:  # D = 0, K = 1: synchronous
            means, st = inner.update(list(ps), fields["inner"])
            return base.Exchanged(means, None, {"inner": st}, 0)
        t = ctx.count
        write = (t // period) % slots  # this period's slot
        if period == 1:
            sums = [g.astype(h.dtype) for g, h in zip(ps, fields["history"])]
        else:
            fresh = t % period == 0
            sums = [jnp.where(fresh, g.astype(h.dtype), h[write] + g.astype(h.dtype))
                    for g, h in zip(ps, fields["history"])]
        history = tuple(h.at[write].set(s) for h, s in zip(fields["history"], sums))
        if delay == 0:  # local SGD: the period that ends now, this step's gradient included
            old = sums
        else:  # S_p of the period that ended D steps ago, from the state: zeros until one has
            old = [h[((t - delay) // period) % slots] for h in fields["history"]]
        arrives = (t >= delay + period - 1) & ((t - delay) % period == period - 1)

        def send(_):
            means, st = inner.update(old, fields["inner"])
            return collectives.match_varying((means, st), (old, fields["inner"]))

        def wait(_):
            return [jnp.zeros_like(o) for o in old], base.silenced(fields["inner"])

        means, st = jax.lax.cond(arrives, send, wait, None)
        if period > 1:  # a period still being summed is no arrival: keep it out
            old = [jnp.where(arrives, o, jnp.zeros_like(o)) for o in old]
        out = [g - o.astype(g.dtype) + m.astype(g.dtype) for g, o, m in zip(ps, old, means)]
        return base.Exchanged(out, None, {"history": history, "inner": st}, 0)

    # On shards: the history is elementwise and the inner compressor sees the shards (and works on them, or
    # gathers them itself); nothing of this exchange needs a whole layer.
    return base.compressor(
        DelayedAveragingState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, init_fields=init_fields,
        on_shards=True,
    )
