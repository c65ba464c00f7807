"""Gradient accumulation whose inner transformation -- and so its exchange -- runs once per ``k`` micro-steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax._checks import check_range
from compjax.compressors import base


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Attributes:
      mini_step: int32 scalar, micro-steps accumulated since the last inner
        step (``0 .. every_k - 1``; 0 right after an inner step).
      gradient_step: int32 scalar, inner steps taken.
      inner_opt_state: the inner transformation's state.  Its compressors'
        ``payload_bytes`` read 0 after a micro-step (nothing was sent) and the
        exchange's bytes after the ``every_k``-th, so :func:`compjax.payload_bytes`
        reads what each step sent.  This transform issues no collective and
        keeps no byte counter of its own.
      acc_grads: the running mean of this worker's micro-gradients since the
        last inner step, float32 (or the gradients' dtype when wider), same tree
        as the gradients; zeros right after an inner step.
    """

    mini_step: jnp.ndarray
    gradient_step: jnp.ndarray
    inner_opt_state: Any
    acc_grads: Any


def multi_steps(inner: optax.GradientTransformation, every_k: int) -> optax.GradientTransformationExtraArgs:
    """Accumulate ``every_k`` micro-gradients and run ``inner`` -- its exchange included -- only on the last.

    The compjax counterpart of ``optax.MultiSteps(inner, every_k)`` (mean of
    the micro-gradients, ``use_grad_mean=True``): on micro-steps
    ``1 .. every_k - 1`` of a cycle the update is zeros and the gradient is
    added to a running mean (Welford's, as optax does); on the ``every_k``-th
    the mean goes through ``inner`` and its update is returned.  Unlike
    ``optax.MultiSteps``, which computes ``inner``'s update on every micro-step
    and keeps it only every ``k``-th (a compjax compressor inside it exchanges
    over the wire on every micro-step), ``inner`` runs here inside a
    ``lax.cond`` branch taken only on the ``every_k``-th step: the wire carries
    one exchange per ``every_k`` micro-batches, and :func:`compjax.payload_bytes`
    reads 0 on micro-steps and the exchange's bytes on the ``every_k``-th (in
    the compiled program the collectives sit in the branch:
    :func:`compjax.worker_bytes` of its audit equals that step's count).  The
    parameters after ``2 * every_k`` steps equal ``optax.MultiSteps``'.

    The branch is chosen by the step count, the same on every worker, so the
    collectives inside it run on all workers or none (under ``shard_map``,
    ``pmap`` and ``vmap`` with an axis name).

    **Non-finite micro-gradients** are handled as ``optax.MultiSteps`` does by
    default (no ``should_skip_update_fn``): they enter the mean, and the
    ``every_k``-th step passes a non-finite mean to ``inner``.  A compjax
    compressor built with ``skip_nonfinite=True`` (the default) then skips that
    inner step on every worker (zero update, its state kept); the accumulator is
    reset either way, so the next cycle starts clean.

    Args:
      inner: the transformation applied every ``every_k`` steps, e.g.
        ``optax.chain(cj.topk(0.01, axis_name="data"), optax.adam(1e-3))``.
      every_k: micro-steps per inner step, an integer >= 1 (1: ``inner`` on
        every step).

    Returns:
      ``optax.GradientTransformationExtraArgs``; ``update(grads, state, params,
      **extra_args)`` takes this worker's micro-gradients and returns zeros, or
      ``inner``'s update of the mean on the ``every_k``-th step (same tree;
      each leaf in its gradient's dtype).  Extra arguments go to ``inner``.

    Raises:
      ValueError: ``every_k`` not an integer >= 1, or ``inner`` not an optax
        transformation (build time).

    References:
      optax's ``MultiSteps`` (gradient accumulation), whose update rule this follows.

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = cj.multi_steps(optax.chain(cj.topk(0.5, axis_name=None), optax.sgd(1.0)), every_k=2)
      >>> g = {"w": jnp.array([1.0, -3.0])}
      >>> state = tx.init(g)
      >>> out, state = tx.update(g, state)                 # micro-step: nothing sent
      >>> out["w"], int(cj.message_bytes(state))
      (Array([0., 0.], dtype=float32), 0)
      >>> out, state = tx.update({"w": jnp.array([3.0, 1.0])}, state)   # the mean [2, -1] goes through top-k
      >>> out["w"], int(cj.message_bytes(state)) > 0
      (Array([-2., -0.], dtype=float32), True)
    """
    check_range("every_k", every_k, 1, None, integer=True, static=True)
    every_k = int(every_k)
    if not isinstance(inner, optax.GradientTransformation):
        raise ValueError(f"inner must be an optax GradientTransformation, got {inner!r}")  # noqa: TRY004
    inner = optax.with_extra_args_support(inner)

    def acc_dtype(x):
        return jnp.promote_types(x.dtype, jnp.float32)

    def init_fn(params):
        return MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=jnp.zeros([], jnp.int32),
            inner_opt_state=inner.init(params),
            acc_grads=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype(jnp.asarray(p))), params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        n = state.mini_step
        acc = jax.tree.map(lambda g, a: a + (g.astype(a.dtype) - a) / (n + 1).astype(a.dtype), updates,
                           state.acc_grads)
        emit = n == every_k - 1

        def step():
            mean = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
            out, new_inner = inner.update(mean, state.inner_opt_state, params, **extra_args)
            out = jax.tree.map(lambda u, g: u.astype(g.dtype), out, updates)
            return collectives.match_varying((out, new_inner), (updates, state.inner_opt_state))

        def wait():
            return jax.tree.map(jnp.zeros_like, updates), _silenced_tree(state.inner_opt_state)

        out, inner_state = collectives.cond_unified(emit, step, wait)
        new_state = MultiStepsState(
            mini_step=jnp.where(emit, 0, n + 1).astype(jnp.int32),
            gradient_step=state.gradient_step + emit.astype(jnp.int32),
            inner_opt_state=inner_state,
            acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc),
        )
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _silenced_tree(state: Any) -> Any:
    """``state`` with every compressor's ``payload_bytes`` in it set to 0 (:func:`compjax.compressors.base.silenced`
    applied to each node that has the field, nested ones included): the state of a step in which none ran."""

    def has_counter(x):
        return hasattr(x, "payload_bytes") and hasattr(x, "_replace")

    def one(x):
        if not has_counter(x):
            return x
        rest = {f: _silenced_tree(getattr(x, f)) for f in x._fields if f != "payload_bytes"}
        return base.silenced(x._replace(**rest))

    return jax.tree.map(one, state, is_leaf=has_counter)
