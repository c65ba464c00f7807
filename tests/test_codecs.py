"""Codecs: bucketing, top-k selection, matrix view and Gram-Schmidt against NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compjax.codecs import (
    back_project,
    from_matrix,
    layer_k,
    make_bucket,
    matrix_shape,
    orthonormalize,
    project,
    reconstruct,
    to_matrix,
    topk_select,
    use_lowrank,
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=5))
def test_bucket_roundtrip(shapes):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s).astype(np.float32) for s in shapes]
    bucket = make_bucket([a.shape for a in arrays])
    flat = bucket.flatten([jnp.asarray(a) for a in arrays])
    assert flat.shape == (sum(a.size for a in arrays),)
    for a, b in zip(arrays, bucket.unflatten(flat)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize(
    "size,ratio,k",
    [(100, 0.01, 1), (100, 0.011, 2), (1000, 0.001, 1), (7, 1.0, 7), (10, 1e-9, 1), (3, 0.5, 2),
     (3_000_001, 0.001, 3001), (1_500_000_001, 0.5, 750_000_001), (10**12, 0.001, 10**9)],  # large layers
)
def test_layer_k(size, ratio, k):
    assert layer_k(size, ratio) == k


def test_topk_select_matches_numpy():
    x = np.random.default_rng(1).normal(size=(6, 7)).astype(np.float32)
    idx, val = topk_select(jnp.asarray(x), 5)
    want = np.argsort(-np.abs(x.ravel()))[:5]
    assert set(np.asarray(idx).tolist()) == set(want.tolist())
    np.testing.assert_array_equal(np.asarray(val), x.ravel()[np.asarray(idx)])
    assert idx.dtype == jnp.int32


def test_matrix_view_is_out_by_rest():
    x = np.arange(3 * 3 * 2 * 4, dtype=np.float32).reshape(3, 3, 2, 4)  # flax conv (kh, kw, in, out)
    assert matrix_shape(x.shape) == (4, 18)
    m = np.asarray(to_matrix(jnp.asarray(x)))
    np.testing.assert_array_equal(m, x.reshape(-1, 4).T)
    np.testing.assert_array_equal(np.asarray(from_matrix(jnp.asarray(m), x.shape)), x)


@pytest.mark.parametrize("shape", [(3, 3, 2, 4), (5, 7), (1, 1, 6, 3), (2, 3, 8)])
# 6: one product, above CPU_COLUMNWISE_MAX_RANK
@pytest.mark.parametrize("r", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow),
                               6])
def test_lowrank_products_match_numpy_on_the_matrix_view(shape, r):
    """M Q, Mᵀ P and P Qᵀ (as a parameter) on M = x.reshape(-1, out).T, computed without transposing M."""
    rng = np.random.default_rng(r)
    x = rng.normal(size=shape).astype(np.float32)
    m = x.reshape(-1, shape[-1]).T  # (out, rest)
    q = rng.normal(size=(m.shape[1], r)).astype(np.float32)
    p = rng.normal(size=(m.shape[0], r)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(project(jnp.asarray(x), jnp.asarray(q))), m @ q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(back_project(jnp.asarray(x), jnp.asarray(p))), m.T @ p, rtol=1e-5,
                               atol=1e-5)
    out = np.asarray(reconstruct(jnp.asarray(p), jnp.asarray(q), shape))
    np.testing.assert_allclose(out, (p @ q.T).T.reshape(shape), rtol=1e-5, atol=1e-5)


def test_use_lowrank_rule():
    assert not use_lowrank((10,), 1, 0.0)  # vectors go dense
    assert use_lowrank((100, 100), 2, 2.0)  # 200*2*2 = 800 < 10000
    assert not use_lowrank((4, 4), 2, 2.0)  # 8*2*2 = 32 >= 16
    assert use_lowrank((4, 4), 8, 0.0)  # rank clamps to 4, rate 0 always compresses


def test_orthonormalize_matches_numpy_gram_schmidt():
    p = np.random.default_rng(2).normal(size=(9, 3))
    q = np.asarray(orthonormalize(jnp.asarray(p, jnp.float32), method="gram_schmidt"))
    ref = np.zeros_like(p)
    for i in range(3):  # classical textbook Gram-Schmidt in float64
        v = p[:, i] - ref[:, :i] @ (ref[:, :i].T @ p[:, i])
        ref[:, i] = v / np.linalg.norm(v)
    np.testing.assert_allclose(q, ref, atol=1e-5)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-5)


def test_orthonormalize_zero_column_stays_finite():
    q = np.asarray(orthonormalize(jnp.zeros((5, 2)), method="gram_schmidt"))
    assert np.all(np.isfinite(q)) and np.all(q == 0)
    q = np.asarray(orthonormalize(jnp.zeros((5, 2)), method="qr"))  # QR completes to an orthonormal basis
    np.testing.assert_allclose(q.T @ q, np.eye(2), atol=1e-6)


def test_orthonormalize_qr_spans_the_columns_and_is_batched():
    """QR's columns span those of p (same projector as Gram-Schmidt), one (m, r) matrix per batch entry."""
    p = np.random.default_rng(3).normal(size=(4, 9, 3)) * np.array([1.0, 1e-2, 1e-4])  # columns of very different norms
    q = np.asarray(orthonormalize(jnp.asarray(p, jnp.float32)))  # rank 3: QR
    assert q.shape == (4, 9, 3)
    for b in range(4):
        ref = np.linalg.qr(p[b])[0]
        np.testing.assert_allclose(q[b] @ q[b].T, ref @ ref.T, atol=1e-5)
        np.testing.assert_allclose(q[b].T @ q[b], np.eye(3), atol=1e-5)
    with pytest.raises(ValueError, match="method"):
        orthonormalize(jnp.asarray(p[0]), method="svd")
