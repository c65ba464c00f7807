"""One optimizer step with its updates applied, in place where the transformation can do it.

optax's contract is two calls: ``updates, state = tx.update(grads, state,
params)`` and then ``params = optax.apply_updates(params, updates)``.  Between
them the updates of the whole model exist as one more copy of the parameters.
XLA fuses the two calls into one pass per leaf for an elementwise optimizer, so
the copy is never stored; but a transformation that computes its updates in a
loop (DiLoCo's guarded inner step, whose loop of zero or one trips keeps a
skipped step's optimizer state bit for bit) hands them out of the loop as
buffers of their own, and only then are they added to the parameters.

A transformation may therefore register an ``apply`` function beside its
``update``: ``apply(grads, state, params, **extra_args) -> (new_params,
new_state)``, the same step with the updates added to the parameters where it
computes them (in its loops, over the donated parameters).
:func:`apply_gradients` calls it when the transformation has one and
``update`` followed by ``optax.apply_updates`` otherwise; every step builder of
:mod:`compjax.parallel` goes through it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import optax

__all__ = ["applies_in_place", "apply_gradients", "in_place_apply"]

_APPLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def applies_in_place(tx: optax.GradientTransformation, apply: Callable[..., tuple]) -> optax.GradientTransformation:
    """``tx`` with ``apply`` registered as the in-place form of its step (for :func:`apply_gradients`).

    Args:
      tx: an optax transformation.
      apply: ``apply(grads, state, params, **extra_args) -> (new_params,
        new_state)``, equal (up to rounding) to ``updates, new_state =
        tx.update(grads, state, params, **extra_args)`` then
        ``optax.apply_updates(params, updates)``.

    Returns:
      ``tx`` itself (the registration is keyed by ``tx.update`` and lives as
      long as that function).

    Raises:
      TypeError: ``apply`` is not callable.
    """
    if not callable(apply):
        raise TypeError(f"apply must be a function (grads, state, params, **extra_args) -> (params, state), "
                         f"got {apply!r}")
    _APPLY[tx.update] = apply
    return tx


def in_place_apply(tx: Any) -> Callable[..., tuple] | None:
    """The ``apply`` function registered for ``tx`` by :func:`applies_in_place`, or None."""
    update = getattr(tx, "update", None)
    try:
        return _APPLY.get(update) if update is not None else None
    except TypeError:  # an update that cannot be weakly referenced was never registered
        return None


def apply_gradients(
    tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any]:
    """One step of ``tx`` with its updates applied: ``(new_params, new_opt_state)``.

    ``tx.update(grads, opt_state, params, **extra_args)`` and then
    ``optax.apply_updates(params, updates)``; for a transformation that applies
    its own updates (:func:`compjax.diloco` and :func:`compjax.sparseloco`
    without ``overlap``), its in-place step, which never holds the updates of
    the whole model at once (8B model, 2 x 4 mesh, sharded parameters,
    SparseLoCo: 7.4 GiB of float32 updates per device fewer).  Every step
    builder of :mod:`compjax.parallel` calls it; a user's own step
    (:func:`compjax.parallel.worker_step`) may call it in place of the two optax calls.

    Args:
      tx: an optax transformation (``init``/``update``).
      grads: the gradients, a pytree like ``params``.
      opt_state: ``tx``'s state.
      params: the parameters before the step (pytree of arrays); donate them to
        the compiled step to have them updated in place.
      **extra_args: passed on to ``tx.update`` (``optax.GradientTransformationExtraArgs``).

    Returns:
      ``(new_params, new_opt_state)``: ``new_params`` has ``params``' structure,
      shapes and dtypes (``optax.apply_updates`` casts each leaf back to its
      parameter's dtype).

    Raises:
      ValueError: what ``tx.update`` raises (e.g. DiLoCo's update without ``params``).

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> tx = optax.sgd(0.5)
      >>> params = {"w": jnp.ones(2)}
      >>> params, state = cj.apply_gradients(tx, {"w": jnp.ones(2)}, tx.init(params), params)
      >>> params["w"].tolist()
      [0.5, 0.5]
    """
    apply = in_place_apply(tx)
    if apply is not None:
        return apply(grads, opt_state, params, **extra_args)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state
