"""The bucketed sparse exchange shared by the sparsifying compressors (top-k, random-k, DGC).

Each layer contributes ``k_i`` (index, value) pairs; indices are offset into the
concatenation of all layers, so every worker's pairs travel in **one** int32
and **one** value all-gather (:func:`compjax.collectives.sparse_mean`), whatever
the number of layers; each worker scatter-adds all pairs and divides by the
number of workers (Lin et al., ICLR 2018, Sec. 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp

from compjax import collectives
from compjax.codecs.bucket import make_bucket
from compjax.collectives import AxisName

#: ``select(i, leaf) -> (int32 (k_i,) flat indices into leaf.ravel(), (k_i,) values)``.
Select = Callable[[int, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]


def sparse_layers_mean(
    leaves: Sequence[jnp.ndarray], select: Select, axis_name: AxisName
) -> tuple[list[jnp.ndarray], list[jnp.ndarray], int]:
    """Select (index, value) pairs in every layer and average the sparse layers over workers.

    Args:
      leaves: this worker's float arrays.
      select: picks each layer's entries to send (static ``k_i``).
      axis_name: worker axis, or None for one worker.

    Returns:
      ``(means, indices, payload_bytes)``: the dense means over workers (shapes
      and dtypes of ``leaves``), each layer's int32 flat indices that this worker
      sent (for error feedback and masking), and ``sum_i k_i * (4 + itemsize)``
      bytes (values in the leaves' common dtype).  No leaves: nothing is sent, ``([], [], 0)``.
    """
    if not leaves:
        return [], [], 0
    bucket = make_bucket([x.shape for x in leaves])
    dtype = jnp.result_type(*leaves)
    idx_parts, val_parts = [], []
    for i, x in enumerate(leaves):
        idx, val = select(i, x)
        idx_parts.append(idx.astype(jnp.int32))
        val_parts.append(val.astype(dtype))
    indices = jnp.concatenate([idx + off for idx, off in zip(idx_parts, bucket.offsets)])
    mean, nbytes = collectives.sparse_mean(indices, jnp.concatenate(val_parts), bucket.size, axis_name)
    means = [m.astype(x.dtype) for m, x in zip(bucket.unflatten(mean), leaves)]
    return means, idx_parts, nbytes

