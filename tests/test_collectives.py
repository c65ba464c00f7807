"""The wire layer: each collective's result and its byte count, on one and on 8 workers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax import collectives
from tests.helpers import AXIS


def test_dense_mean_one_worker_is_identity_and_counts_bytes():
    x = jnp.arange(6.0).reshape(2, 3)
    y, nbytes = collectives.dense_mean(x, None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert nbytes == 24


def test_dense_mean_arrays_buckets_by_dtype():
    xs = np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32)
    hs = xs[:, :3].astype(np.float16)

    def f(a, h):
        (ma, mh), nbytes = collectives.dense_mean_arrays([a, h], AXIS)
        return ma, mh, jnp.asarray(nbytes)

    ma, mh, nbytes = jax.vmap(f, axis_name=AXIS)(xs, hs)
    np.testing.assert_allclose(np.asarray(ma)[0], xs.mean(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mh)[0], hs.astype(np.float32).mean(0), rtol=2e-3)
    assert mh.dtype == jnp.float16
    assert int(nbytes[0]) == 10 * 4 + 3 * 2


def test_sparse_mean_scatter_adds_duplicates():
    idx = np.array([[0, 2], [2, 3], [2, 2]], np.int32)
    val = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)

    def f(i, v):
        out, nbytes = collectives.sparse_mean(i, v, 5, AXIS)
        return out, jnp.asarray(nbytes)

    out, nbytes = jax.vmap(f, axis_name=AXIS)(idx, val)
    want = np.zeros(5, np.float32)
    np.add.at(want, idx.ravel(), val.ravel())
    np.testing.assert_allclose(np.asarray(out), np.stack([want / 3] * 3), rtol=1e-6)
    assert int(nbytes[0]) == 2 * 4 + 2 * 4


def test_sparse_mean_segments_equals_one_dense_mean_split_at_the_segments():
    """Three workers' pairs into two buffers (entries 0:4 and 4:10): each buffer is its slice of the dense mean."""
    rng = np.random.default_rng(3)
    idx = np.stack([np.concatenate([rng.choice(4, 2, replace=False), 4 + rng.choice(6, 3, replace=False)])
                    for _ in range(3)]).astype(np.int32)
    val = rng.standard_normal(idx.shape).astype(np.float32)

    def f(i, v):
        means, nbytes = collectives.sparse_mean_segments(i, v, [(0, 2, 0, 4), (2, 5, 4, 6)], AXIS)
        return means, jnp.asarray(nbytes)

    (lo, hi), nbytes = jax.vmap(f, axis_name=AXIS)(idx, val)
    want = np.zeros(10, np.float32)
    np.add.at(want, idx.ravel(), val.ravel())
    np.testing.assert_allclose(np.asarray(lo)[1], want[:4] / 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(hi)[2], want[4:] / 3, rtol=1e-6)
    assert int(nbytes[0]) == 5 * 4 + 5 * 4


def test_sparse_mean_segments_rejects_a_segment_outside_the_pairs():
    idx, val = jnp.arange(3, dtype=jnp.int32), jnp.ones(3)
    with pytest.raises(ValueError, match="segments must lie in"):
        collectives.sparse_mean_segments(idx, val, [(0, 4, 0, 8)], None)
