"""Data-parallel plumbing: meshes, the worker-stacked state layout and train-step builders.

Layout: parameters and optimizer state carry a leading worker axis of size n
(one slice per worker), sharded over the mesh's data axis with
``P(axis_name)``, so device i holds worker i's copy; inside ``jax.shard_map``
each device takes its slice ``x[0]``, runs the step on unstacked values and
re-stacks the result with ``x[None]``.  Keeping parameters worker-stacked (each
worker its own copy, kept equal by the compressor's mean) means gradients are
taken with respect to per-worker values, so JAX inserts no dense all-reduce of
its own: the compiled step carries only the compressor's collectives.

Two front ends share this layout: pure pytrees (:func:`replicate`,
:func:`init_worker_state`, :func:`data_parallel_step`) and Flax NNX objects,
whose Variables are stacked in place (:func:`nnx_replicate`,
:func:`nnx_data_parallel_step`, :func:`nnx_unreplicate`).

Two-level meshes (:func:`make_2d_mesh`): a slow axis between hosts (or slices)
and a fast axis inside each one.  With ``fast_axis=`` the worker axis of the
layout runs over both mesh axes (``P((axis_name, fast_axis))``, one worker per
device); :func:`data_parallel_step` averages gradients densely over the fast
axis and leaves only the slow axis to the compressor.

Sharded parameters (FSDP, ``specs=``): on a 2-D mesh the worker axis runs over
the slow axis only and every large leaf of the parameters, optimizer state and
compressor state is sharded over the fast axis inside it
(``P(axis_name, *spec)``; :func:`fsdp_specs` gives a default rule).  The loss
runs on each worker's logical parameters, sharded over the fast axis: XLA gathers
each parameter inside the host where it is used (one layer at a time under
``jax.lax.scan``) and reduces its gradient back to shards; the optimizer and the
compressors then run on each device's shards (:mod:`compjax.layout`), reducing
only per-layer statistics or per-shard candidates over the fast axis.  The
numbers are those of the replicated layout, with ``1/fast`` of the state on each
device.

Several processes (``jax.distributed``): every function here takes global
arrays spanning all processes' devices; host values (parameters, a global batch)
must be the same on every process, and :func:`gather` brings a worker-stacked
tree back to every host.

The package's modules, each one concept: :mod:`~compjax.parallel.mesh` (meshes),
:mod:`~compjax.parallel.placement` (the worker-stacked and sharded layout),
:mod:`~compjax.parallel.core` (the one step core: ``jax.shard_map`` inside
``jax.jit``, batches split, keys folded, donation and output shardings),
:mod:`~compjax.parallel.pytree` (:func:`data_parallel_step`),
:mod:`~compjax.parallel.precision` (:func:`compute_cast`: mixed precision where parameters are used),
:mod:`~compjax.parallel.userstep` (:func:`worker_step`) and
:mod:`~compjax.parallel.nnx_adapters` (the Flax NNX helpers).
"""

from __future__ import annotations

from compjax.parallel.mesh import make_2d_mesh, make_mesh
from compjax.parallel.nnx_adapters import nnx_data_parallel_step, nnx_replicate, nnx_unreplicate
from compjax.parallel.placement import (
    Padded,
    fsdp_specs,
    gather,
    init_worker_state,
    local_view,
    logical,
    replicate,
    shard_batch,
    state_specs,
    unreplicate,
)
from compjax.parallel.precision import compute_cast
from compjax.parallel.pytree import data_parallel_step
from compjax.parallel.userstep import worker_step

__all__ = [
    "Padded",
    "compute_cast",
    "data_parallel_step",
    "fsdp_specs",
    "gather",
    "init_worker_state",
    "local_view",
    "logical",
    "make_2d_mesh",
    "make_mesh",
    "nnx_data_parallel_step",
    "nnx_replicate",
    "nnx_unreplicate",
    "replicate",
    "shard_batch",
    "state_specs",
    "unreplicate",
    "worker_step",
]
