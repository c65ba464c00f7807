"""Data-parallel plumbing: meshes, the worker-stacked state layout and a train-step builder.

Layout (DESIGN.md §4): parameters and optimizer state carry a leading worker
axis of size n, sharded over the mesh's data axis with ``P(axis_name)``; inside
``jax.shard_map`` each device sees its own slice.  Keeping parameters
worker-stacked (each worker its own copy, kept equal by the compressor's mean)
means gradients are taken with respect to per-worker values, so JAX inserts no
dense all-reduce of its own: the compiled step carries only the compressor's
collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "data_parallel_step",
    "init_worker_state",
    "make_mesh",
    "replicate",
    "shard_batch",
    "unreplicate",
]


def make_mesh(num_workers: int | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh of ``num_workers`` devices (default: all) with axis ``axis_name``.

    Raises:
      ValueError: ``num_workers`` < 1 or more than the available devices.
    """
    n_dev = len(jax.devices())
    n = n_dev if num_workers is None else int(num_workers)
    if not 1 <= n <= n_dev:
        raise ValueError(f"num_workers must be in [1, {n_dev}] (the available devices), got {num_workers}")
    return jax.make_mesh((n,), (axis_name,), devices=jax.devices()[:n])


def replicate(tree: Any, mesh: Mesh, axis_name: str = "data") -> Any:
    """Stack ``n`` copies of every leaf on a new leading axis, sharded ``P(axis_name)``.

    Args:
      tree: pytree of arrays of any shapes (one worker's values).
      mesh: the mesh; ``n = mesh.shape[axis_name]``.

    Returns:
      The same tree with leaves of shape ``(n, *shape)``, one slice per device.
    """
    n = mesh.shape[axis_name]
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(
        lambda x: jax.device_put(jnp.broadcast_to(jnp.asarray(x)[None], (n, *jnp.shape(x))), sharding), tree
    )


def unreplicate(tree: Any) -> Any:
    """Worker 0's slice of a worker-stacked tree (as host NumPy arrays)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data)[0] if hasattr(x, "addressable_shards") else np.asarray(x)[0], tree)


def shard_batch(batch: Any, mesh: Mesh, axis_name: str = "data") -> Any:
    """Put a global batch on the mesh, split along its leading (batch) axis.

    Raises:
      ValueError: a leading dimension not divisible by the number of workers.
    """
    n = mesh.shape[axis_name]
    for x in jax.tree.leaves(batch):
        if jnp.shape(x)[0] % n:
            raise ValueError(f"batch leading dimension {jnp.shape(x)[0]} is not divisible by {n} workers")
    return jax.device_put(batch, NamedSharding(mesh, P(axis_name)))


def init_worker_state(tx: optax.GradientTransformation, params: Any, mesh: Mesh, axis_name: str = "data") -> Any:
    """``tx.init(params)`` replicated into the worker-stacked layout (every worker starts equal)."""
    return replicate(tx.init(params), mesh, axis_name)


def data_parallel_step(
    loss_fn: Callable[[Any, Any], jnp.ndarray],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    donate: bool = False,
) -> Callable[[Any, Any, Any], tuple[Any, Any, jnp.ndarray]]:
    """Build a jitted data-parallel train step under ``jax.shard_map``.

    Each worker computes ``loss_fn(params, local_batch)`` and its gradient with
    respect to its own copy of the parameters, passes the local gradients to
    ``tx`` (whose compressor averages them over ``axis_name``) and applies the
    updates.

    Args:
      loss_fn: ``(params, batch) -> scalar loss`` for one worker's batch.
      tx: an optax transformation whose compressor uses ``axis_name``.
      mesh: mesh with axis ``axis_name`` (n workers).
      axis_name: the data axis.
      donate: donate the params and state buffers to the step.

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, loss)``; params and
      opt_state worker-stacked (:func:`replicate`, :func:`init_worker_state`),
      batch sharded along its leading axis (:func:`shard_batch`), loss of shape
      ``(n,)`` (each worker's local loss).
    """
    spec = P(axis_name)

    def local(x):
        return x[0]

    def stack(x):
        return x[None]

    def body(params, opt_state, batch):
        params, opt_state = jax.tree.map(local, (params, opt_state))
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.map(stack, (params, opt_state)) + (loss[None],)

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec))
    return jax.jit(sharded, donate_argnums=(0, 1) if donate else ())
