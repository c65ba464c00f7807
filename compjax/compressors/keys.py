"""Randomness of the compressors: keys from seeds, and per-step, per-worker draws.

Every random compressor keeps one raw PRNG key in its state, the same on every
worker; step ``t`` of worker ``w`` draws from ``fold_in(fold_in(key, t), w)``:
reproducible, and different across workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from compjax import collectives
from compjax.codecs.bucket import make_bucket
from compjax.collectives import AxisName

__all__ = ["as_key", "step_key", "step_uniforms"]


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


def step_uniforms(
    key: jax.Array, count: jnp.ndarray, axis_name: AxisName, leaves: Sequence[jnp.ndarray]
) -> list[jnp.ndarray]:
    """This step's and worker's uniform draws in [0, 1), one per element of each leaf.

    One draw for the whole bucket, ``jax.random.uniform(step_key(...), (total,))``
    in float32, split in leaf order (leaf ``i`` gets the ``size_i`` draws after
    the previous leaves'), so the program holds one random-bits kernel whatever
    the number of leaves.

    Returns:
      float32 arrays of shapes ``(leaf.size,)``.
    """
    bucket = make_bucket([(x.size,) for x in leaves])
    u = jax.random.uniform(step_key(key, count, axis_name), (bucket.size,), jnp.float32)
    return bucket.unflatten(u)
