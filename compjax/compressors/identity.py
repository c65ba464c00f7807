"""The uncompressed baseline: dense mean of the workers' gradients."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import optax

from compjax import collectives
from compjax.collectives import AxisName
from compjax.compressors.base import Exchanged, compressor


class IdentityState(NamedTuple):
    """State of :func:`identity`.

    Attributes:
      count: int32 scalar, updates applied.
      skipped: int32 scalar, steps skipped because a worker's gradient was not finite.
      payload_bytes: uint32 ``(2,)`` byte count (low, high word) of what this
        worker put into collectives in the last step; read it with
        :func:`compjax.payload_bytes`.
    """

    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def identity(axis_name: AxisName = None, *, skip_nonfinite: bool = True) -> optax.GradientTransformationExtraArgs:
    """Dense all-reduce mean of local gradients: the uncompressed baseline.

    The leaves go into flat buffers per dtype (at most 64 MiB each, a larger
    leaf on its own: :func:`compjax.collectives.dense_mean_arrays`) and one
    all-reduce each, one after the other, so a float32 model costs ``4 * num_params`` bytes per worker per step (float16
    buffers are divided by the number of workers before the sum, so the sum
    cannot overflow), plus the 4-byte non-finite vote.

    Args:
      axis_name: the worker axis of ``shard_map``/``pmap``/``vmap``; None for
        one worker (the output is the input).
      skip_nonfinite: if any worker's gradient holds a NaN or an infinity, all
        workers skip the step (zero updates, ``skipped`` + 1); see
        :mod:`compjax.compressors.base`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
      params=None)`` takes this worker's local gradients (any pytree) and
      returns their mean over workers, same structure, shapes and dtypes.

    Examples:
      >>> import jax.numpy as jnp, compjax as cj
      >>> tx = cj.identity()
      >>> g = {"w": jnp.ones((2, 3))}
      >>> out, state = tx.update(g, tx.init(g))
      >>> int(cj.message_bytes(state))   # one worker: the size of the message (nothing is sent)
      24
    """

    def exchange(ps, fields, ctx):
        shards = None if ctx.shards is None else [d is not None for d in ctx.shards.dims]
        means, nbytes = collectives.dense_mean_arrays(ps, ctx.axis_name, shards=shards)  # a shard is its own piece
        return Exchanged(means, list(ps), {}, nbytes)  # sent: p itself

    return compressor(IdentityState, exchange, axis_name=axis_name, skip_nonfinite=skip_nonfinite, on_shards=True,
                      any_cut=True)
