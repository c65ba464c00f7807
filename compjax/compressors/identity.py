"""The uncompressed baseline: dense mean of the workers' gradients."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives
from compjax.collectives import AxisName


class IdentityState(NamedTuple):
    """State of :func:`identity`.

    Attributes:
      payload_bytes: int32 scalar, bytes this worker put into collectives in the
        last step (0 before the first step).
    """

    payload_bytes: jnp.ndarray


def identity(axis_name: AxisName = None) -> optax.GradientTransformationExtraArgs:
    """Dense all-reduce mean of local gradients: the uncompressed baseline.

    All leaves go into one flat buffer per dtype and one all-reduce each, so a
    float32 model costs ``4 * num_params`` bytes per worker per step.

    Args:
      axis_name: the worker axis of ``shard_map``/``pmap``/``vmap``; None for
        one worker (the output is the input).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
      params=None)`` takes this worker's local gradients (any pytree of float
      arrays) and returns their mean over workers, same structure, shapes and
      dtypes.

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.identity()
      >>> g = {"w": jnp.ones((2, 3))}
      >>> out, state = tx.update(g, tx.init(g))
      >>> int(state.payload_bytes)
      24
    """

    def init_fn(params):
        del params
        return IdentityState(payload_bytes=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args, state
        leaves, treedef = jax.tree.flatten(updates)
        means, nbytes = collectives.dense_mean_arrays(leaves, axis_name)
        return jax.tree.unflatten(treedef, means), IdentityState(jnp.asarray(nbytes, jnp.int32))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
