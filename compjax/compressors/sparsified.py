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

import jax
import jax.numpy as jnp

from compjax import collectives, layout
from compjax.codecs import select as select_codec
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


def topk_on_shards(xs: Sequence[jnp.ndarray], ks: Sequence[int], shards: layout.Shards, **kw) -> list:
    """The exact top-``k_i`` of every layer from its shards, without moving the layers.

    Each device selects its shard's top ``min(k_i, shard size)`` entries
    (:func:`compjax.codecs.select.topk_many`, ``kw`` passed on), turns their
    indices into the layer's flat indices (:meth:`compjax.layout.Shards.to_whole`)
    and all-gathers these candidates over the fast axis
    (:func:`compjax.collectives.gather_over_fast`, ``fast * k_i`` pairs); the
    ``k_i`` of largest magnitude among them, ties to the lowest index of the
    layer, are the layer's top ``k_i`` exactly as ``jax.lax.top_k`` of the
    whole layer picks them (an entry of the layer's top ``k_i`` is among its
    shard's top ``k_i``, and inside a shard the order of the indices is the
    layer's).  Every device of the host gets the same pairs.

    Args:
      xs: this device's shards (whole leaves where ``shards.dims[i]`` is None).
      ks: the number of entries per layer, ``1 <= k_i <=`` the layer's size.
      shards: the layout of ``xs``.

    Returns:
      One ``(indices, values)`` per layer: int32 ``(k_i,)`` flat indices into
      the whole layer and the values there, ordered by decreasing magnitude.
    """
    local = [min(k, int(x.size)) if d is not None else k for x, k, d in zip(xs, ks, shards.dims)]
    pairs = select_codec.topk_many(list(xs), local, **kw)
    out = []
    for i, (x, k, (idx, val)) in enumerate(zip(xs, ks, pairs)):
        if shards.dims[i] is None:
            out.append((idx, val))
            continue
        g = collectives.gather_over_fast(shards.to_whole(idx.astype(jnp.int32), x.shape, i)).reshape(-1)
        v = collectives.gather_over_fast(val).reshape(-1)
        # (score descending, index ascending): ~score sorts the uint32 magnitudes from the largest.
        _, g, v = jax.lax.sort((~select_codec.magnitude_scores(v), g, v), num_keys=2)
        out.append((g[:k], v[:k]))
    return out


def sparse_layers_mean(
    leaves: Sequence[jnp.ndarray], select: Select | None, axis_name: AxisName, *,
    select_all: SelectAll | None = None, skip: jnp.ndarray | None = None, shards: layout.Shards | None = None,
    dtypes: Sequence | None = None,
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
      shards: the leaves are this device's shards of layers
        (:class:`compjax.layout.Shards`): ``select``/``select_all`` then return
        flat indices into the whole layers (the same on every device of the
        host, e.g. :func:`topk_on_shards`), each layer's pairs travel from
        the start of their layer, and each device scatter-adds only the pairs
        that fall in its shard, into a buffer of the shard's size.
      dtypes: one dtype per layer for its mean, or None (the leaves' dtypes).
        Given, each layer's mean (each bucket group's, without ``shards``, when
        its layers share a dtype) is cast as soon as it is summed and the next
        one's sum waits for that cast
        (:func:`compjax.collectives.sparse_mean_segments`): one layer's sum in
        the values' dtype at a time.

    Returns:
      ``(means, indices, payload_bytes)``: the dense means over workers (shapes
      of ``leaves``, dtypes ``dtypes`` or the leaves'), each layer's int32 flat indices that this worker
      sent (for error feedback and masking; with ``shards``, into the shard, the
      size of the shard where an entry lies in another device's shard), and
      ``sum_i k_i * (4 + itemsize)`` bytes (values in the leaves' common dtype).
      No leaves: nothing is sent, ``([], [], 0)``.
    """
    if not leaves:
        return [], [], 0
    if shards is not None:  # the layers' sums chained one after the other only when their dtypes are asked for
        return _sparse_shards_mean(leaves, select, axis_name, select_all, skip, shards, dtypes)
    asked = dtypes is not None
    dtypes = [x.dtype for x in leaves] if dtypes is None else list(dtypes)
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
    # Asked for their dtypes (DGC), the groups' sums are chained as on shards, where a group's leaves share one.
    same = asked and all(len({jnp.dtype(dtypes[i]) for i in g}) == 1 for g in groups)
    dense, nbytes = collectives.sparse_mean_segments(indices, values, segments, axis_name,
                                                     dtypes=[dtypes[g[0]] for g in groups] if same else None)
    means: list[jnp.ndarray] = [None] * len(leaves)  # type: ignore[list-item]
    for g, buf in zip(groups, dense):
        for i in g:
            o = bucket.offsets[i] - bucket.offsets[g[0]]
            part = buf if len(g) == 1 else buf[o : o + bucket.sizes[i]]
            means[i] = part.reshape(leaves[i].shape).astype(dtypes[i])
    return means, idx_parts, nbytes


def _sparse_shards_mean(leaves, select, axis_name, select_all, skip, shards, dtypes):
    """:func:`sparse_layers_mean` of shards: one segment per layer, scatter-added into the shards alone."""
    if (select is None) == (select_all is None):
        raise ValueError("give one of select and select_all")
    dtype = jnp.result_type(*leaves)
    pairs = select_all(list(leaves)) if select_all is not None else [select(i, x) for i, x in enumerate(leaves)]
    idx_parts = [idx.astype(jnp.int32) for idx, _ in pairs]
    values = jnp.concatenate([val.astype(dtype) for _, val in pairs])
    if skip is not None:
        values = jnp.where(skip, jnp.zeros_like(values), values)
    segments, maps, at = [], [], 0
    for i, (x, idx) in enumerate(zip(leaves, idx_parts)):
        segments.append((at, at + int(idx.size), 0, int(x.size)))
        maps.append(None if shards.dims[i] is None else
                    (lambda g, shape=tuple(x.shape), i=i: shards.to_shard(g, shape, i)))
        at += int(idx.size)
    dense, nbytes = collectives.sparse_mean_segments(jnp.concatenate(idx_parts), values, segments, axis_name,
                                                     maps=maps, dtypes=None if dtypes is None else list(dtypes))
    means = [buf.reshape(x.shape).astype(x.dtype if dtypes is None else buf.dtype) for buf, x in zip(dense, leaves)]
    local = [shards.to_shard(idx, x.shape, i) for i, (x, idx) in enumerate(zip(leaves, idx_parts))]
    return means, local, nbytes
