"""DiLoCo's global model for Flax NNX: evaluate it from a model and its ``nnx.Optimizer``.

:func:`compjax.diloco_global_params` works on pytrees: an optimizer state and
the parameters it was built for.  An ``nnx.Optimizer`` holds its state as NNX
Variables and the model holds the workers' *local* parameters, so evaluating
the global model (the outer optimizer's iterate, the model DiLoCo trains) takes
two steps this module writes once: read both as arrays, and put the global
values into a model -- a new one (:func:`diloco_global_model`) or the same one
for the length of a ``with`` block (:func:`diloco_swap_global`), which puts the
local parameters back afterwards, so training continues where it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from compjax.algorithms.diloco import diloco_global_params

__all__ = ["diloco_global_model", "diloco_swap_global"]


def _arrays(tree: Any) -> Any:
    """``tree`` with every NNX Variable replaced by its value (other leaves kept)."""
    from flax import nnx

    return jax.tree.map(lambda v: v[...] if isinstance(v, nnx.Variable) else v, tree,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def _global_state(model: Any, optimizer: Any, wrt: Any, assignment: Any = None) -> Any:
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be the nnx.Module the optimizer trains, got {type(model).__name__}")  # noqa: TRY004
    opt_state = getattr(optimizer, "opt_state", None)
    if opt_state is None:
        raise ValueError(f"optimizer must be an nnx.Optimizer (with an opt_state), got {type(optimizer).__name__}")
    wrt = getattr(optimizer, "wrt", nnx.Param) if wrt is None else wrt
    params = nnx.state(model, wrt)
    try:
        return diloco_global_params(_arrays(opt_state), _arrays(params), assignment=assignment)
    except ValueError as e:
        raise ValueError(f"{e} (model: the nnx.Module the optimizer was built for, in the same layout -- both "
                         "worker-stacked by parallel.nnx_replicate or both one worker's; wrt: the optimizer's "
                         f"filter, here {wrt!r})") from None


def diloco_global_model(model: Any, optimizer: Any, *, wrt: Any = None, assignment: Any = None) -> Any:
    """A copy of ``model`` holding DiLoCo's global parameters: the model to evaluate.

    The parameters ``optimizer`` trains (``wrt``, by default the optimizer's
    own filter, ``nnx.Param``) take their global values,
    :func:`compjax.diloco_global_params` of the optimizer's state (as of each
    fragment's last synchronization); every other Variable (batch statistics,
    RNG streams, ...) is copied from ``model``.  ``model`` and ``optimizer``
    are left as they are.

    Args:
      model: the ``nnx.Module`` the optimizer trains (its local parameters),
        one worker's or worker-stacked (:func:`compjax.parallel.nnx_replicate`).
      optimizer: its ``nnx.Optimizer``, whose transformation holds one
        :func:`compjax.diloco` (alone or inside optax combinators).
      wrt: the optimizer's Variable filter, if it has none of its own.
      assignment: the ``assignment`` given to :func:`compjax.diloco`, if any.

    Returns:
      A new ``nnx.Module`` like ``model`` (worker-stacked if ``model`` is:
      every worker's slice is the same global model; evaluate one with
      :func:`compjax.parallel.nnx_unreplicate`).

    Raises:
      ValueError: ``model`` is not an ``nnx.Module``, ``optimizer`` not an
        ``nnx.Optimizer``, its state holds no DiLoCo state, or the model's
        parameters are not those the state was built for (another layout).

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
      >>> model.kernel[...] = jnp.ones((2, 1))
      >>> optimizer = nnx.Optimizer(model, cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None), wrt=nnx.Param)
      >>> for _ in range(3):   # two inner steps and a sync, then one more inner step
      ...     _ = optimizer.update(model, nnx.State({"kernel": nnx.Param(jnp.ones((2, 1)))}))
      >>> round(float(model.kernel[0, 0]), 4)   # the local parameters
      0.634
      >>> round(float(cj.diloco_global_model(model, optimizer).kernel[0, 0]), 4)   # the global model
      0.734
    """
    from flax import nnx

    state = _global_state(model, optimizer, wrt, assignment)
    copy = nnx.clone(model)
    nnx.update(copy, state)
    return copy


@contextlib.contextmanager
def diloco_swap_global(model: Any, optimizer: Any, *, wrt: Any = None, assignment: Any = None) -> Iterator[Any]:
    """Inside the ``with`` block, ``model`` holds DiLoCo's global parameters; afterwards its local ones again.

    For an evaluation loop written against the training model (``model.eval()``,
    ``eval_step(model, ...)``) without a copy: on entry the parameters
    ``optimizer`` trains take their global values
    (:func:`diloco_global_model`), on exit -- also when the block raises -- the
    local values held before are put back, so the next training step starts
    from the same local parameters.  Do not train inside the block.

    Args:
      model, optimizer, wrt, assignment: as for :func:`diloco_global_model`.

    Yields:
      ``model`` itself.

    Raises:
      ValueError: as :func:`diloco_global_model`.

    Examples:
      >>> import jax.numpy as jnp, optax, compjax as cj
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, use_bias=False, rngs=nnx.Rngs(0))
      >>> model.kernel[...] = jnp.ones((2, 1))
      >>> optimizer = nnx.Optimizer(model, cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None), wrt=nnx.Param)
      >>> for _ in range(3):
      ...     _ = optimizer.update(model, nnx.State({"kernel": nnx.Param(jnp.ones((2, 1)))}))
      >>> with cj.diloco_swap_global(model, optimizer):
      ...     print(round(float(model.kernel[0, 0]), 4))   # evaluate here
      0.734
      >>> round(float(model.kernel[0, 0]), 4)   # local again
      0.634
    """
    from flax import nnx

    state = _global_state(model, optimizer, wrt, assignment)
    wrt = getattr(optimizer, "wrt", nnx.Param) if wrt is None else wrt
    local = jax.tree.map(lambda x: x, _arrays(nnx.state(model, wrt)))  # the local values, kept aside
    nnx.update(model, state)
    try:
        yield model
    finally:
        nnx.update(model, local)
