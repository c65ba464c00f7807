"""Random-k: k distinct random entries per layer, unbiased without error feedback, mass kept with it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from compjax.codecs import randomk_select
from tests.helpers import AXIS, VOTE, init_stacked, run_workers, stack
from tests.test_error_feedback import _check_one_worker

RNG = np.random.default_rng(11)


def test_select_draws_k_distinct_entries():
    x = jnp.arange(1, 101, dtype=jnp.float32)
    idx, val = randomk_select(x, 7, jax.random.PRNGKey(0))
    idx = np.asarray(idx)
    assert idx.shape == (7,) and len(set(idx.tolist())) == 7
    np.testing.assert_array_equal(np.asarray(val), idx + 1)
    assert not np.array_equal(idx, np.asarray(randomk_select(x, 7, jax.random.PRNGKey(1))[0]))


def test_unbiased_without_error_feedback():
    """The mean of 2,000 seeded draws is within 4 standard errors of the input, per element."""
    g = {"w": jnp.asarray(RNG.normal(size=(6, 5)), jnp.float32), "b": jnp.asarray(RNG.normal(size=5), jnp.float32)}

    def draw(key):
        tx = cj.randomk(0.2, key=key, error_feedback=False)
        return tx.update(g, tx.init(g))[0]

    draws = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(5), 2000))
    for k, gk in g.items():
        d = np.asarray(draws[k], np.float64)
        kept = np.count_nonzero(d, axis=tuple(range(1, d.ndim)))
        assert np.all(kept == max(1, math.ceil(0.2 * gk.size)))  # k entries, scaled by size / k
        se = d.std(0) / np.sqrt(len(d))
        assert np.all(np.abs(d.mean(0) - np.asarray(gk)) <= 4 * se + 1e-6), k


def test_error_feedback_conserves_mass():
    for seed in range(3):
        _check_one_worker(cj.randomk(0.3, key=seed), [(4, 5), (7,)], seed)


def test_workers_draw_different_entries(mesh):
    n = 8
    g = {"w": np.ones((16, 16), np.float32)}
    tx = cj.randomk(0.05, key=0, axis_name=AXIS)
    out, state = run_workers(tx, stack([g] * n), init_stacked(tx, g, n), "shard_map", mesh)
    sent = [np.flatnonzero(state.residual["w"][w] == 0) for w in range(n)]
    assert all(len(s) == 13 for s in sent) and len({tuple(s) for s in sent}) == n
    # The mean holds every worker's ones, divided by n (duplicates add up).
    assert out["w"][0].sum() == pytest.approx(13.0)
    assert np.all(cj.payload_bytes(state) == 13 * 8 + VOTE)


@pytest.mark.parametrize("ratio", [0.0, 1.5, -1])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        cj.randomk(ratio, key=0)
