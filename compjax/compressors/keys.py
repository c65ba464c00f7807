"""Randomness of the compressors: keys from seeds, and per-step, per-worker draws.

Every random compressor keeps one raw uint32 PRNG key in its state, the same on
every worker.  Step ``t`` of worker ``w`` draws from the counter-based stream
``stream(key, t, w)`` of :mod:`compjax.codecs.random`: each draw is a keyed
32-bit hash of the element's index, computed where it is used (about one
elementwise pass, where ``jax.random``'s threefry costs ~30): reproducible,
and different across steps and workers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from compjax import collectives
from compjax.codecs import random as cr
from compjax.codecs.bucket import make_bucket
from compjax.collectives import AxisName

__all__ = ["as_key", "step_key", "step_stream", "step_uniforms"]


def as_key(key) -> jax.Array:
    """A raw uint32 ``(2,)`` PRNG key from an int seed, a raw key or a typed ``jax.random.key``.

    Accepts Python/NumPy ints, integer scalar arrays (also traced ones, as
    ``optax.inject_hyperparams`` passes them), typed keys (``jax.random.key``)
    and raw uint32 ``(2,)`` keys (``jax.random.PRNGKey``).

    Raises:
      ValueError: ``key`` is none of these (e.g. a float, a bool, or an array of another shape).
    """
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return jax.random.PRNGKey(int(key))
    if isinstance(key, (bool, np.bool_, float, str)) or key is None:
        raise ValueError(f"key must be an int seed or a PRNG key (jax.random.key / PRNGKey), got {key!r}")
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if jax.random.key_impl(key) != jax.random.key_impl(jax.random.key(0)) or key.shape != ():
            raise ValueError(f"key must be a single threefry key, got {key!r}")
        return jax.random.key_data(key)
    arr = jnp.asarray(key) if isinstance(key, (jax.Array, np.ndarray, list, tuple)) else None
    if arr is not None and arr.shape == () and jnp.issubdtype(arr.dtype, jnp.integer):
        return jax.random.PRNGKey(arr)
    if arr is None or arr.shape != (2,) or arr.dtype != jnp.uint32:
        raise ValueError(f"key must be an int seed or a PRNG key (jax.random.key / PRNGKey), got {key!r}")
    return arr


def step_key(key: jax.Array, count: jnp.ndarray, axis_name: AxisName) -> jax.Array:
    """The key of this step and worker: ``fold_in(fold_in(key, step), worker index)``."""
    return jax.random.fold_in(jax.random.fold_in(key, count), collectives.worker_index(axis_name))


def step_stream(key: jax.Array, count: jnp.ndarray, axis_name: AxisName) -> jnp.ndarray:
    """The counter-based stream of this step and worker: :func:`compjax.codecs.random.stream` (uint32 ``(2,)``)."""
    return cr.stream(key, count, collectives.worker_index(axis_name))


def step_uniforms(
    key: jax.Array, count: jnp.ndarray, axis_name: AxisName, leaves: Sequence[jnp.ndarray], shards=None,
) -> list[jnp.ndarray]:
    """This step's and worker's uniform draws in [0, 1), one per element of each leaf.

    The draws of the whole bucket are elements ``0 .. total - 1`` of the stream
    ``step_stream(key, count, axis_name)`` (:func:`compjax.codecs.random.uniform`),
    split in leaf order: leaf ``i`` gets elements ``offset_i .. offset_i + size_i - 1``,
    ``offset_i`` the sizes of the leaves before it.  Each leaf's draws are an
    elementwise function of an iota, so XLA computes them inside the pass that
    uses them.

    With ``shards`` (a :class:`compjax.layout.Shards`: the leaves are shards
    of layers), a shard's draws are its layer's at the shard's entries (the
    offsets count the layers' sizes): the same numbers as for whole layers.

    Returns:
      float32 arrays of shapes ``(leaf.size,)``.

    Raises:
      ValueError: more than 2**32 elements in all.
    """
    if shards is not None:  # the layers' draws at the shards' entries
        sizes = [int(math.prod(shards.whole_shape(x, i))) for i, x in enumerate(leaves)]
        bucket = make_bucket([(n,) for n in sizes])
        if bucket.size > cr.MAX_SIZE:
            raise ValueError(f"a stream indexes at most 2**32 elements, got {bucket.size}")
        st = step_stream(key, count, axis_name)
        return [cr.uniform_at(st, shards.to_whole(jax.lax.iota(jnp.int32, int(x.size)), x.shape, i).astype(jnp.uint32)
                              + jnp.uint32(off)) for i, (x, off) in enumerate(zip(leaves, bucket.offsets))]
    bucket = make_bucket([(x.size,) for x in leaves])
    st = step_stream(key, count, axis_name)
    return [cr.uniform(st, int(x.size), int(off)) for x, off in zip(leaves, bucket.offsets)]
