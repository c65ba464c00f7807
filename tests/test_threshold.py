"""Sampled-threshold top-k (DGC's selection) returns exactly k entries, equal to exact top-k here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax.codecs import topk_select
from compjax.codecs.threshold import sample_size, sampled_topk


@pytest.mark.parametrize("dist", ["gaussian", pytest.param("student_t2", marks=pytest.mark.slow)])
def test_sampled_selection_is_exact_k_and_keeps_the_mass(dist):
    rng = np.random.default_rng(0)
    n, k = 1_000_000, 1_000
    x = rng.standard_normal(n) if dist == "gaussian" else rng.standard_t(2, n)
    x = jnp.asarray(x, jnp.float32)
    idx, val, settled = jax.jit(lambda x, key: sampled_topk(x, k, 0.01, key, return_settled=True))(
        x, jax.random.PRNGKey(1)
    )
    assert bool(settled)  # the fast path chose, not the fallback to exact top-k
    idx = np.asarray(idx)
    assert idx.shape == (k,) and len(set(idx.tolist())) == k
    np.testing.assert_array_equal(np.asarray(val), np.asarray(x)[idx])
    exact_idx, _ = topk_select(x, k)
    mass = np.sum(np.asarray(x)[idx] ** 2) / np.sum(np.asarray(x)[np.asarray(exact_idx)] ** 2)
    assert mass >= 0.95


@pytest.mark.slow
def test_fallback_when_threshold_cannot_settle():
    # Many ties at the threshold: more than `capacity` entries pass, so exact top-k is used.
    x = jnp.concatenate([jnp.ones(5000), jnp.zeros(5000)])
    idx, val, settled = sampled_topk(x, 10, 0.01, jax.random.PRNGKey(0), capacity=20, return_settled=True)
    assert not bool(settled)
    assert idx.shape == (10,) and np.all(np.asarray(val) == 1.0) and len(set(np.asarray(idx).tolist())) == 10


def test_sample_size():
    assert sample_size(1_000_000, 1_000, 0.01) == 10_000
    assert sample_size(1_000_000, 10, 0.01) == 200_000  # at least ~2/ratio
    assert sample_size(50, 5, 0.01) == 20


@pytest.mark.parametrize("size,k", [pytest.param(100_003, 100, marks=pytest.mark.slow), (65_536, 7),
                                    pytest.param(250_000, 2_000, marks=pytest.mark.slow)])
def test_equals_exact_topk_when_it_settles_including_the_tail(size, k):
    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(np.float32)
    x[-3:] = [50.0, -60.0, 70.0]  # the largest entries sit in the tail (size % 32 entries)
    idx, val, settled = jax.jit(lambda x, key: sampled_topk(x, k, 0.01, key, return_settled=True))(
        jnp.asarray(x), jax.random.PRNGKey(2)
    )
    assert bool(settled)
    exact_idx, _ = topk_select(jnp.asarray(x), k)
    assert set(np.asarray(idx).tolist()) == set(np.asarray(exact_idx).tolist())
    assert {size - 3, size - 2, size - 1} <= set(np.asarray(idx).tolist())
    np.testing.assert_array_equal(np.asarray(val), x[np.asarray(idx)])


@pytest.mark.slow
def test_threshold_is_refined_from_a_bad_sample():
    # A sample that sees only the bulk: the few large entries sit between the sampled positions.
    x = np.full(1_000_000, 1e-3, np.float32)
    x[np.arange(1, 1_000_000, 997)] = np.linspace(1.0, 2.0, len(range(1, 1_000_000, 997)))
    k = 500
    idx, _, settled = sampled_topk(jnp.asarray(x), k, 0.01, jax.random.PRNGKey(0), return_settled=True)
    assert bool(settled)  # refined until it settled, not rescued by the fallback
    exact_idx, _ = topk_select(jnp.asarray(x), k)
    assert set(np.asarray(idx).tolist()) == set(np.asarray(exact_idx).tolist())


@pytest.mark.slow
def test_default_return_is_indices_and_values():
    x = jnp.asarray(np.random.default_rng(5).standard_normal(100_000), jnp.float32)
    out = sampled_topk(x, 50, 0.01, jax.random.PRNGKey(0))
    assert len(out) == 2
    idx, val, settled = sampled_topk(x, 50, 0.01, jax.random.PRNGKey(0), return_settled=True)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(out[0]))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(out[1]))
    assert settled.shape == () and settled.dtype == jnp.bool_ and bool(settled)


def test_small_inputs_use_exact_topk_and_say_so():
    x = jnp.asarray(np.random.default_rng(6).standard_normal(1_000), jnp.float32)
    idx, _, settled = sampled_topk(x, 100, 0.01, jax.random.PRNGKey(0), return_settled=True)
    assert not bool(settled)  # capacity * block >= size / 2: exact top-k directly
    assert set(np.asarray(idx).tolist()) == set(np.asarray(topk_select(x, 100)[0]).tolist())


def test_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        sampled_topk(jnp.ones(10), 0, 0.01, jax.random.PRNGKey(0))
