"""Random-k's index draw (compjax.codecs.permutation): a NumPy replay of the keyed Feistel permutation with
cycle walking, distinct indices, and each index kept with probability k/d."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax.codecs import permutation as cp
from compjax.codecs import random as cr
from tests.test_random import M32, np_bits, np_stream


def np_perm(st, layer, d, x):
    """The module docstring's permutation of range(d) at the points x (uint64 arithmetic)."""
    a, b = cp.grid(d)
    L, R = np.asarray(x, np.uint64) // np.uint64(b), np.asarray(x, np.uint64) % np.uint64(b)

    def net(L, R):
        for r in range(cp.ROUNDS):
            m, v = (a, R) if r % 2 == 0 else (b, L)
            u = ((np_bits(st, ((np.uint64(layer * cp.ROUNDS + r) << np.uint64(16)) + v) & M32) >> np.uint64(8))
                 .astype(np.float32) * np.float32(2.0**-24))
            f = np.minimum((u * np.float32(m)).astype(np.uint64), np.uint64(m - 1))
            if r % 2 == 0:
                L = (L + f) % np.uint64(a)
            else:
                R = (R + f) % np.uint64(b)
        return L, R

    L, R = net(L, R)
    while True:
        out = L * np.uint64(b) + R >= np.uint64(d)
        if not out.any():
            return (L * np.uint64(b) + R).astype(np.int64)
        L2, R2 = net(L, R)
        L, R = np.where(out, L2, L), np.where(out, R2, R)


def test_subsets_replay_the_definition_in_numpy():
    """Several layers in one call, each equal to its own replay; sizes with and without grid points outside."""
    key = np.asarray(jax.random.PRNGKey(11))
    st = cr.stream(key, jnp.int32(5), jnp.int32(2))
    sizes, ks = [36864, 1000, 7, 50_003, 1], [369, 100, 7, 600, 1]
    got = jax.jit(lambda st: cp.subsets(st, sizes, ks))(st)
    np_st = np_stream(key, 5, 2)
    for layer, (d, k, idx) in enumerate(zip(sizes, ks, got)):
        idx = np.asarray(idx)
        assert idx.dtype == np.int32 and idx.shape == (k,)
        np.testing.assert_array_equal(idx, np_perm(np_st, layer, d, np.arange(k)))
        assert len(set(idx.tolist())) == k and idx.min() >= 0 and idx.max() < d


@pytest.mark.parametrize("d", [pytest.param(1000, marks=pytest.mark.slow), pytest.param(50_003, marks=pytest.mark.slow),
                               7])
def test_whole_permutation_is_a_permutation(d):
    """k = d: the draw is all of range(d) (cycle walking keeps the permutation inside it)."""
    st = cr.stream(jax.random.PRNGKey(3), 0, 0)
    [idx] = cp.subsets(st, [d], [d])
    np.testing.assert_array_equal(np.sort(np.asarray(idx)), np.arange(d))


def test_each_index_is_kept_with_probability_k_over_d():
    """Over 10,000 streams every index of a layer of 300 (grid 18 x 17, 6 points outside) is drawn about
    k/d = 0.1 of the time (binomial, 5 sd), and pairs are not strongly tied together."""
    d, k, n = 300, 30, 10_000
    streams = jax.vmap(lambda s: cr.stream(jnp.array([7, 9], jnp.uint32), s, 0))(jnp.arange(n))
    idx = np.asarray(jax.jit(jax.vmap(lambda st: cp.subsets(st, [d], [k])[0]))(streams))
    hits = np.zeros((n, d), bool)
    hits[np.arange(n)[:, None], idx] = True
    p = k / d
    counts = hits.sum(0)
    assert np.all(np.abs(counts - n * p) < 5 * math.sqrt(n * p * (1 - p)))
    # pairwise: neighbours (i, i+1) are drawn together about p * (k-1)/(d-1) of the time, as a uniform subset
    both = (hits[:, :-1] & hits[:, 1:]).sum(0).mean()
    want = n * p * (k - 1) / (d - 1)
    assert abs(both - want) < 5 * math.sqrt(want / (d - 1))


def test_bad_input_names_the_parameter():
    st = cr.stream(jax.random.PRNGKey(0), 0, 0)
    with pytest.raises(ValueError, match="k must be in"):
        cp.subsets(st, [10], [11])
    with pytest.raises(ValueError, match="sizes must be in"):
        cp.subsets(st, [0], [1])
    with pytest.raises(ValueError, match="one k per layer"):
        cp.subsets(st, [10, 10], [1])
