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
      history: this worker's last ``delay`` local gradients, one ``(delay, *shape)``
        ring buffer per compressed leaf (slot ``t mod delay`` holds ``g_t``),
        in the gradients' dtype: ``delay`` copies of the model.  An empty tuple
        when ``delay == 0``.
      inner: the state of the compressor that carries the delayed exchange
        (over the list of compressed leaves); its ``payload_bytes`` counts that
        exchange (0 on the first ``delay`` steps, when nothing is sent).
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


def delayed_averaging(
    delay: int,
    *,
    axis_name: AxisName,
    compressor: optax.GradientTransformation | None = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Delayed Gradient Averaging: apply the local gradient now, swap in the average ``delay`` steps later.

    Zhu et al., NeurIPS 2021 (Sec. 3; Algorithm 1 with period 1): worker ``i``
    at step ``t`` returns::

        update_t = g_t - g_{t-D} + mean_j g^j_{t-D}      (t >= D)
        update_t = g_t                                    (t <  D: nothing has arrived yet)

    so that after ``t`` steps every worker has applied the average of all
    gradients up to ``t - D`` plus its own last ``D`` local gradients.  The
    collective issued in step ``t`` reads only ``g_{t-D}`` from the state, not
    the gradient given to this update: nothing in the step waits on it, so XLA
    may overlap it with the step's computation (and on a slow link it has ``D``
    steps to arrive).  ``delay=0`` is synchronous data-parallel SGD (the update
    is the mean of this step's gradients).

    The exchange goes through ``compressor`` (any compjax compressor over the
    same ``axis_name``; its state, e.g. error feedback, is kept in ``inner``);
    the default is a dense all-reduce (:func:`compjax.identity`).  The history
    is always finite, so an inner compressor's own non-finite vote is redundant
    (build it with ``skip_nonfinite=False``).

    **Memory**: the state holds ``delay`` copies of the gradients (one ring
    buffer of ``delay`` slots per leaf) besides the compressor's state.

    With ``skip_nonfinite`` (default) the non-finite vote of the compressor
    pipeline (:mod:`compjax.compressors.base`) guards the history: a NaN on any
    worker skips the step on all workers.  That vote is a 4-byte all-reduce on
    the current gradient in every step; the delayed exchange does not wait for
    it (the vote only selects what the step keeps), but the vote itself is a
    round trip per step: on a high-latency link turn it off to keep the method
    fully latency-tolerant.

    Args:
      delay: ``D``, steps between a gradient and the arrival of its average, an
        integer >= 0 (fixes the state's shape: ``static_args`` of
        ``optax.inject_hyperparams``).
      axis_name: the worker axis (None: one worker, the update is ``g_t``).
      compressor: the transformation that averages the delayed gradients over
        ``axis_name``, or None for a dense all-reduce.
      skip_nonfinite: the non-finite guard.

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update(grads, state)`` takes
      this worker's local gradients and returns the update above (same tree,
      shapes and dtypes).

    Raises:
      ValueError: ``delay`` not an integer >= 0, or ``compressor`` not an optax
        transformation (build time).

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
    """
    check_range("delay", delay, 0, None, integer=True, static=True)
    delay = int(delay)
    if compressor is not None and not isinstance(compressor, optax.GradientTransformation):
        raise ValueError(f"compressor must be an optax GradientTransformation or None, got {compressor!r}")
    inner = optax.with_extra_args_support(
        identity(axis_name, skip_nonfinite=False) if compressor is None else compressor
    )

    def init_fields(xs):
        history = tuple(jnp.zeros((delay, *x.shape), x.dtype) for x in xs) if delay else ()
        return {"history": history, "inner": inner.init(list(xs))}

    def exchange(ps, fields, ctx):
        if delay == 0:
            means, st = inner.update(list(ps), fields["inner"])
            return base.Exchanged(means, None, {"inner": st}, 0)
        slot = ctx.count % delay
        old = [h[slot] for h in fields["history"]]  # g_{t-D}: zeros until the ring buffer has filled

        def send(_):
            means, st = inner.update(old, fields["inner"])
            return collectives.match_varying((means, st), (old, fields["inner"]))

        def wait(_):
            return [jnp.zeros_like(o) for o in old], base.silenced(fields["inner"])

        means, st = jax.lax.cond(ctx.count >= delay, send, wait, None)
        out = [g - o.astype(g.dtype) + m.astype(g.dtype) for g, o, m in zip(ps, old, means)]
        history = tuple(h.at[slot].set(g.astype(h.dtype)) for h, g in zip(fields["history"], ps))
        return base.Exchanged(out, None, {"history": history, "inner": st}, 0)

    return base.compressor(
        DelayedAveragingState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, init_fields=init_fields
    )
