"""Top-k of a layer from its shards when a shard holds fewer non-zero entries than k.

``compressors.sparsified.topk_on_shards`` takes each fast device's top ``k`` of its shard and keeps the ``k`` of
largest magnitude among the gathered candidates, ties to the lowest index: exactly ``jax.lax.top_k`` of the whole
layer.  A shard with fewer than ``k`` non-zero entries sends exact zeros among its candidates; they must sort
after every non-zero candidate of the other shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from compjax import layout
from compjax.compressors.sparsified import topk_on_shards

FAST, SHARD, K = 4, 64, 8


def numpy_topk(x, k):
    """Indices of the k largest |x|, ties to the lowest index (jax.lax.top_k's order)."""
    return np.lexsort((np.arange(x.size), -np.abs(x)))[:k]


def test_a_shard_with_fewer_non_zeros_than_k_sends_zeros_that_sort_last():
    rng = np.random.default_rng(0)
    x = (rng.uniform(0.1, 1.0, FAST * SHARD) * rng.choice([-1, 1], FAST * SHARD)).astype(np.float32)
    x[:SHARD] = 0.0
    x[[5, 40]] = [3.0, -2.0]  # shard 0: two non-zero entries (< K), both in the layer's top K
    mesh = jax.make_mesh((FAST,), ("fast",), devices=jax.devices()[:FAST])

    def body(shard):
        with layout.fast_layout("fast"):
            [(idx, val)] = topk_on_shards([shard], [K], layout.Shards("fast", (0,)))
        return idx[None], val[None]

    sharded = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("fast")))
    idx, val = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fast"), out_specs=P("fast")))(sharded)
    want = numpy_topk(x, K)
    for f in range(FAST):  # every device of the host holds the layer's pairs, by decreasing magnitude
        np.testing.assert_array_equal(np.asarray(idx)[f], want)
        np.testing.assert_array_equal(np.asarray(val)[f], x[want])
