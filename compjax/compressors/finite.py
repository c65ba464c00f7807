"""Skip a whole optimizer step on all workers when any worker's gradient is not finite."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import bytecount, collectives
from compjax._checks import check_range
from compjax.collectives import AxisName
from compjax.compressors.base import any_nonfinite, check_axis


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite` (the fields of ``optax.ApplyIfFiniteState``, plus the vote's bytes).

    Attributes:
      notfinite_count: int32 scalar, consecutive skipped steps.
      last_finite: bool scalar, whether the last step's gradients were finite on every worker.
      total_notfinite: int32 scalar, steps skipped so far.
      inner_state: the wrapped transformation's state.
      payload_bytes: uint32 ``(2,)`` byte count of this wrapper's collective in
        the last step (the 4-byte vote), read with :func:`compjax.payload_bytes`
        together with the inner compressor's.
    """

    notfinite_count: jnp.ndarray
    last_finite: jnp.ndarray
    total_notfinite: jnp.ndarray
    inner_state: Any
    payload_bytes: jnp.ndarray


def _zeros_like(s: jax.ShapeDtypeStruct) -> jnp.ndarray:
    if s.dtype == jax.dtypes.float0:
        return np.zeros(s.shape, jax.dtypes.float0)
    return jnp.zeros(s.shape, s.dtype)


def apply_if_finite(
    inner: optax.GradientTransformation,
    max_consecutive_errors: int | None = None,
    *,
    axis_name: AxisName = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.apply_if_finite`` with the decision taken over the worker axis.

    ``optax.apply_if_finite`` checks each worker's own gradients, so when one
    worker sees a NaN only that worker skips: under ``jax.shard_map`` the others
    then wait in the inner compressor's collectives for a worker that never
    comes (on CPU, XLA aborts the process after 40 s).  Here every worker votes
    (one 4-byte ``pmax``) and all of them skip together: zero updates, the
    whole inner state untouched (compressor state, momentum, the learning-rate
    schedule's count), ``total_notfinite`` up by one.  A skipped step is then
    exactly a step that never happened.

    Every compjax compressor also guards itself (``skip_nonfinite=True``): it
    keeps its own state clean, but the transformations chained after it still
    step on its zero output (e.g. momentum carries on).  Wrap the whole chain
    in this to skip everything.

    Args:
      inner: the transformation to wrap (e.g. ``optax.chain(compressor, optimizer)``).
      max_consecutive_errors: after this many consecutive skipped steps, apply
        the update anyway (as optax does); None never gives up.
      axis_name: the worker axis, or None for one worker.

    Returns:
      ``optax.GradientTransformationExtraArgs`` with state :class:`ApplyIfFiniteState`.

    Raises:
      ValueError: ``max_consecutive_errors`` not None and below 0; at trace
        time, an ``axis_name`` no enclosing ``shard_map``/``pmap``/``vmap``
        binds, or None while the gradients vary over a mesh axis (each worker
        would decide alone, and the others would wait in the compressor's
        collectives).

    Examples:
      >>> import optax, compjax as cj
      >>> tx = cj.apply_if_finite(optax.chain(cj.topk(0.01, axis_name="data"), optax.sgd(0.1)),
      ...                         axis_name="data")
    """
    if max_consecutive_errors is not None:
        check_range("max_consecutive_errors", max_consecutive_errors, 0, None, integer=True, static=True)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return ApplyIfFiniteState(
            notfinite_count=jnp.zeros((), jnp.int32), last_finite=jnp.ones((), jnp.bool_),
            total_notfinite=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
            payload_bytes=bytecount.zeros(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        floats = [x for x in jax.tree.leaves(updates) if jnp.issubdtype(x.dtype, jnp.floating) and x.size]
        check_axis(axis_name, floats, "cj.apply_if_finite")
        local_bad = any_nonfinite(floats) if floats else jnp.bool_(False)
        bad, nbytes = collectives.any_over_workers(local_bad, axis_name)
        notfinite_count = jnp.where(bad, state.notfinite_count + 1, 0)
        apply = ~bad
        if max_consecutive_errors is not None:
            apply = apply | (notfinite_count > max_consecutive_errors)

        def do(_):
            return inner.update(updates, state.inner_state, params, **extra_args)

        # Both branches return the union of the two branches' varying axes, leaf by leaf.
        types = jax.eval_shape(do, None)
        zeros = jax.tree.map(_zeros_like, types[0])
        rejected = (zeros, state.inner_state)

        def unify(tree):
            return jax.tree.map(
                lambda x, t, r: x if x.dtype == jax.dtypes.float0
                else collectives.vary(x, collectives.varying_axes(t) | collectives.varying_axes(r)),
                tree, types, rejected,
            )

        new_updates, new_inner = jax.lax.cond(apply, lambda _: unify(do(None)), lambda _: unify(rejected), None)
        new_state = ApplyIfFiniteState(
            notfinite_count=collectives.like_varying(notfinite_count, state.notfinite_count),
            last_finite=collectives.like_varying(~bad, state.last_finite),
            total_notfinite=collectives.like_varying(state.total_notfinite + bad.astype(jnp.int32),
                                                     state.total_notfinite),
            inner_state=new_inner,
            payload_bytes=collectives.like_varying(bytecount.constant(nbytes), state.payload_bytes),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
