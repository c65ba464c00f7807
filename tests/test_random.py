"""The counter-based generator (compjax.codecs.random): NumPy replay from its definition, uniformity,
streams that differ across steps and workers, and the exact selections built on it (codecs.select)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from compjax.codecs import random as cr
from compjax.codecs import select

M32 = np.uint64(0xFFFFFFFF)


def np_mix(x):
    """The module docstring's mix, in uint64 arithmetic masked to 32 bits."""
    x = np.asarray(x, np.uint64) & M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x21F0AAAD)) & M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x735A2D97)) & M32
    return x ^ (x >> np.uint64(15))


def np_stream(key, step, worker):
    k0, k1 = (np.uint64(int(v)) for v in np.asarray(key, np.uint32))
    s, w = np.uint64(step % 2**32), np.uint64(worker % 2**32)
    a = np_mix(np_mix(np_mix(np_mix(np.uint64(0x243F6A88) ^ k0) ^ k1) ^ s) ^ w)
    b = np_mix(np_mix(np_mix(np_mix(np.uint64(0x85A308D3) ^ k1) ^ k0) ^ w) ^ s) ^ np.uint64(0x9E3779B9)
    return a, b


def np_bits(st, index):
    a, b = st
    return np_mix((np_mix(np.asarray(index, np.uint64) ^ a) + b) & M32)


def np_uniform(key, step, worker, size, offset=0):
    """float32 draws of elements offset .. offset + size - 1 of stream(key, step, worker)."""
    bits = np_bits(np_stream(key, step, worker), np.arange(offset, offset + size, dtype=np.uint64))
    return ((bits >> np.uint64(8)).astype(np.float64) * 2.0**-24).astype(np.float32)


def test_replays_the_definition_in_numpy():
    key = np.asarray(jax.random.PRNGKey(7))
    for step, worker in [(0, 0), (3, 5), (2**31 - 1, 7)]:
        st = cr.stream(key, jnp.int32(step), jnp.int32(worker))
        np.testing.assert_array_equal(np.asarray(st), np.array(np_stream(key, step, worker), np.uint32))
        np.testing.assert_array_equal(np.asarray(cr.uniform(st, 1000, 123)), np_uniform(key, step, worker, 1000, 123))
    # the mix is the published constants' hash: a known value, and a bijection (no collision on 2**16 inputs)
    assert int(cr.mix(jnp.uint32(1))) == int(np_mix(1))
    assert len(np.unique(np.asarray(cr.mix(jnp.arange(2**16, dtype=jnp.uint32))))) == 2**16


def test_uniformity_mean_variance_and_buckets():
    n = 1_000_000
    u = np.asarray(cr.uniform(cr.stream(jax.random.PRNGKey(0), 0, 0), n), np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    counts = np.bincount((u * 256).astype(int), minlength=256)
    chi2 = np.sum((counts - n / 256) ** 2 / (n / 256))
    assert chi2 < 255 + 5 * math.sqrt(2 * 255)  # chi-square with 255 dof: mean 255, sd 22.6
    pairs = np.bincount((u[0::2] * 16).astype(int) * 16 + (u[1::2] * 16).astype(int), minlength=256)
    chi2 = np.sum((pairs - n / 2 / 256) ** 2 / (n / 2 / 256))  # neighbours independent: 2-D buckets
    assert chi2 < 255 + 5 * math.sqrt(2 * 255)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(n)


def test_streams_differ_across_steps_workers_and_keys():
    n = 100_000
    key = jax.random.PRNGKey(0)
    draws = {(s, w): np.asarray(cr.uniform(cr.stream(key, s, w), n)) for s in range(3) for w in range(4)}
    draws["key1"] = np.asarray(cr.uniform(cr.stream(jax.random.PRNGKey(1), 0, 0), n))
    names = list(draws)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = draws[a], draws[b]
            assert np.mean(x == y) < 1e-3, (a, b)
            assert abs(np.corrcoef(x, y)[0, 1]) < 5 / math.sqrt(n), (a, b)
    np.testing.assert_array_equal(draws[(1, 2)], np.asarray(cr.uniform(cr.stream(key, 1, 2), n)))  # reproducible


@pytest.mark.parametrize("size,k", [pytest.param(100_003, 1_001, marks=pytest.mark.slow), (65_536, 7),
                                    pytest.param(250_000, 2_500, marks=pytest.mark.slow)])
def test_threshold_topk_equals_exact_topk(size, k):
    rng = np.random.default_rng(size)
    x = rng.standard_normal(size).astype(np.float32)
    x[-3:] = [50.0, -60.0, 70.0]  # the largest entries in the last, partial block of 32
    x[:5] = 3.0  # ties at a large magnitude: the lowest indices win, as in lax.top_k
    idx, val, settled = jax.jit(lambda x: select.topk(x, k, return_settled=True))(jnp.asarray(x))
    assert bool(settled)
    idx = np.asarray(idx)
    want = np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(x)), k)[1])
    assert idx.shape == (k,) and set(idx.tolist()) == set(want.tolist())
    assert len(set(idx.tolist())) == k
    np.testing.assert_array_equal(np.asarray(val), x[idx])


def test_threshold_topk_with_more_ties_at_the_kth_than_it_needs_is_lowest_index_first():
    """95 large entries and 20 equal ones for k = 100: the threshold settles with 115 candidates, but only the
    5 lowest-index ties belong to lax.top_k's answer; they lie in different flag words of one chunk (stride 9
    against the word stride 8), so word order is not index order: the index cut must pick them."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * 0.1).astype(np.float32)
    x[rng.choice(np.arange(1_000, 100_000), 95, replace=False)] = 10.0 + rng.random(95).astype(np.float32)
    ties = 3 + 9 * np.arange(20)
    x[ties] = -5.0
    idx, _, settled = jax.jit(lambda x: select.topk(x, 100, return_settled=True))(jnp.asarray(x))
    assert bool(settled)  # no fallback: ties are cut by index
    want = np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(x)), 100)[1])
    assert set(np.asarray(idx).tolist()) == set(want.tolist()) and set(ties[:5]) <= set(want.tolist())


@pytest.mark.slow
def test_threshold_topk_falls_back_when_it_cannot_settle():
    x = jnp.concatenate([jnp.ones(20_000), jnp.zeros(20_000)])  # 20,000 equal magnitudes for k = 10
    idx, val, settled = select.topk(x, 10, return_settled=True)
    assert not bool(settled)
    assert np.all(np.asarray(val) == 1.0) and len(set(np.asarray(idx).tolist())) == 10


def test_randomk_compressor_keeps_each_entry_with_probability_k_over_d():
    """Over 2,000 steps every entry is sent about k/d of the time (binomial, 5 sd)."""
    g = {"w": jnp.ones((40, 25), jnp.float32)}
    tx = cj.randomk(0.1, key=1, error_feedback=False)
    s0 = tx.init(g)

    def sent(count):
        return tx.update(g, s0._replace(count=count))[0]["w"] != 0

    hits = np.asarray(jax.jit(jax.vmap(sent))(jnp.arange(2000, dtype=jnp.int32))).sum(0)
    p, n = 0.1, 2000
    assert np.all(np.abs(hits - n * p) < 5 * math.sqrt(n * p * (1 - p)))


# far too low (every entry passes) and far too high (none)
@pytest.mark.parametrize("thr0", [pytest.param(1, marks=pytest.mark.slow), 0x7F000000])
def test_threshold_moves_until_it_settles(thr0):
    x = jnp.asarray(np.random.default_rng(5).standard_normal(50_000).astype(np.float32))
    scores = select.magnitude_scores(x)
    idx, settled = select.threshold_select(scores, lambda i: scores[i], 500, jnp.uint32(thr0), 2**20,
                                           return_settled=True)
    assert bool(settled)
    assert set(np.asarray(idx).tolist()) == set(np.asarray(jax.lax.top_k(jnp.abs(x), 500)[1]).tolist())


@pytest.mark.slow
def test_topk_many_is_exact_per_layer_and_one_fallback_leaves_the_others_settled():
    """Layers selected together (one loop and one fallback branch for all): each equals its own lax.top_k;
    a layer that cannot settle (ties) falls back alone, a small layer uses lax.top_k, a low first guess moves."""
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(100_000).astype(np.float32),
          # 20,000 ties, then 50 larger entries at the end, k = 100: no threshold has between k and the capacity
          # above it, and the first flagged entries (ties only) would miss the large ones without the fallback
          np.concatenate([np.ones(20_000), np.zeros(20_000), np.full(50, 2.0)]).astype(np.float32),
          rng.standard_normal(3_000).astype(np.float32),  # small: lax.top_k directly
          (rng.standard_normal(60_000) * np.exp(rng.standard_normal(60_000) * 3)).astype(np.float32),  # heavy tails
          rng.standard_normal(2_000_000).astype(np.float32)]
    ks = [1_000, 100, 30, 600, 2_000]
    out = jax.jit(lambda xs: select.topk_many(xs, ks, return_settled=True))([jnp.asarray(x) for x in xs])
    assert [bool(s) for _, _, s in out] == [True, False, False, True, True]
    for x, k, (idx, val, _) in zip(xs, ks, out):
        idx = np.asarray(idx)
        want = np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(x)), k)[1])
        assert idx.shape == (k,) and set(idx.tolist()) == set(want.tolist())
        np.testing.assert_array_equal(np.asarray(val), x[idx])
