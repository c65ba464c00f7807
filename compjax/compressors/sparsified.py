"""The bucketed sparse exchange shared by the sparsifying compressors (top-k, random-k, DGC).

Each layer contributes ``k_i`` (index, value) pairs; indices are offset into the
concatenation of all layers, so every worker's pairs travel in **one** int32
and **one** value all-gather, whatever the number of layers; each worker
scatter-adds all pairs and divides by the number of workers (Lin et al., ICLR
2018, Sec. 3), as :func:`compjax.collectives.sparse_mean` does.

The scatter-add goes into one dense buffer per *chunk* of consecutive layers
(:func:`chunks`: layers of at least :data:`CHUNK` entries alone, smaller ones
together up to that size) through :func:`compjax.collectives.sparse_mean_segments`,
not into one buffer of all parameters: a buffer of tens of MB is memory the
allocator maps afresh at every step (page faults cost more than the scatter),
and a layer alone needs no copy out of a bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp

from compjax import collectives
from compjax.codecs.bucket import make_bucket
from compjax.collectives import AxisName

#: ``select(i, leaf) -> (int32 (k_i,) flat indices into leaf.ravel(), (k_i,) values)``.
Select = Callable[[int, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]

#: ``select_all(leaves) -> [(int32 (k_i,) flat indices, (k_i,) values), ...]``: every layer at once
#: (e.g. :func:`compjax.codecs.select.topk_many`, whose layers share their loops and branches).
SelectAll = Callable[[list], list]

#: Entries of a chunk of small layers scatter-added into one buffer (4 MiB of float32).
CHUNK = 2**20


def chunks(sizes: Sequence[int], limit: int = CHUNK) -> list[list[int]]:
    """Consecutive layers grouped for the scatter-add: lists of layer positions, in order.

    A layer of ``limit`` entries or more is a chunk alone; smaller consecutive
    layers share a chunk while their total stays at most ``limit``.

    Examples:
      >>> chunks([10, 20, 2**20, 5])
      [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if n >= limit or not out or total + n > limit or sizes[out[-1][-1]] >= limit:
            out.append([i])
            total = n
        else:
            out[-1].append(i)
            total += n
    return out


def sparse_layers_mean(
    leaves: Sequence[jnp.ndarray], select: Select | None, axis_name: AxisName, *,
    select_all: SelectAll | None = None, skip: jnp.ndarray | None = None,
) -> tuple[list[jnp.ndarray], list[jnp.ndarray], int]:
    """Select (index, value) pairs in every layer and average the sparse layers over workers.

    Args:
      leaves: this worker's float arrays.
      select: picks each layer's entries to send (static ``k_i``), or None with ``select_all``.
      axis_name: worker axis, or None for one worker.
      select_all: picks the entries of all layers at once (instead of ``select``).
      skip: bool scalar, the same on every worker, or None: when true every
        worker sends zeros as its values (the indices as selected), so the
        means are zeros -- a skipped step of the non-finite guard
        (:class:`compjax.compressors.base.Context`) at the cost of ``k`` selects,
        not of a pass over the dense means.

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
    if (select is None) == (select_all is None):
        raise ValueError("give one of select and select_all")
    pairs = select_all(list(leaves)) if select_all is not None else [select(i, x) for i, x in enumerate(leaves)]
    idx_parts = [idx.astype(jnp.int32) for idx, _ in pairs]
    val_parts = [val.astype(dtype) for _, val in pairs]
    groups = chunks(bucket.sizes)
    # Indices on the wire count from the start of their segment (a few MB of layers), not of the whole
    # model: int32 holds them however large the model (offsets past 2**31 would overflow).
    base = {i: bucket.offsets[g[0]] for g in groups for i in g}
    indices = jnp.concatenate([idx + (bucket.offsets[i] - base[i]) for i, idx in enumerate(idx_parts)])
    values = jnp.concatenate(val_parts)
    if skip is not None:
        values = jnp.where(skip, jnp.zeros_like(values), values)
    pair_at = [0]
    for idx in idx_parts:
        pair_at.append(pair_at[-1] + int(idx.size))
    segments = [(pair_at[g[0]], pair_at[g[-1] + 1], 0,
                 bucket.offsets[g[-1]] + bucket.sizes[g[-1]] - bucket.offsets[g[0]]) for g in groups]
    dense, nbytes = collectives.sparse_mean_segments(indices, values, segments, axis_name)
    means: list[jnp.ndarray] = [None] * len(leaves)  # type: ignore[list-item]
    for g, buf in zip(groups, dense):
        for i in g:
            o = bucket.offsets[i] - bucket.offsets[g[0]]
            part = buf if len(g) == 1 else buf[o : o + bucket.sizes[i]]
            means[i] = part.reshape(leaves[i].shape).astype(leaves[i].dtype)
    return means, idx_parts, nbytes
