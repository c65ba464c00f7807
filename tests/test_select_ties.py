"""Threshold top-k when more candidates tie with the k-th score than are needed.

:func:`compjax.codecs.select.threshold_select` (and the magnitude top-k built on it) takes the candidates above
the k-th score and, among those equal to it, the lowest indices: exactly ``k`` entries, the set
``jax.lax.top_k`` picks.  Here the threshold settles with 25 candidates of which 20 tie for the last 5 places,
so the cut among the tied candidates (the second bisection) decides the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax.codecs import select

SIZE, K = 8192, 10


def numpy_topk(scores, k):
    """Indices of the k largest scores, ties to the lowest index (jax.lax.top_k's choice)."""
    return np.lexsort((np.arange(scores.size), -scores.astype(np.int64)))[:k]


def tied_scores(size=SIZE):
    """5 scores of 100 and 20 of 50 at random places (none at index 0), the rest 0 (never a candidate)."""
    rng = np.random.default_rng(0)
    places = rng.choice(np.arange(1, size), 25, replace=False)
    scores = np.zeros(size, np.uint32)
    scores[places[:5]], scores[places[5:]] = 100, 50
    return scores


def test_threshold_select_cuts_ties_at_the_lowest_indices():
    scores = jnp.asarray(tied_scores(1024))
    f = jax.jit(lambda s: select.threshold_select(s, lambda i: s[i], K, jnp.uint32(50), 1, return_settled=True))
    idx, settled = f(scores)
    assert bool(settled)  # the threshold landed on the first try: the cut, not the fallback, chose
    assert sorted(np.asarray(idx).tolist()) == sorted(numpy_topk(np.asarray(scores), K).tolist())


@pytest.mark.slow  # 8,192 entries (the threshold path's smallest layer): a larger program than the test above
def test_magnitude_topk_with_tied_magnitudes_equals_lax_top_k():
    """Magnitudes 2 (5 entries) and +-1 (20 entries) among zeros: the threshold settles between the two."""
    scores = tied_scores()
    sign = np.where(np.arange(SIZE) % 2 == 0, 1.0, -1.0)
    x = np.where(scores == 100, 2.0, np.where(scores == 50, 1.0, 0.0)) * sign
    idx, val, settled = jax.jit(lambda v: select.topk(v, K, sample_ratio=1.0, return_settled=True))(
        jnp.asarray(x, jnp.float32))
    assert bool(settled)
    want = np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(x, jnp.float32)), K)[1])
    assert sorted(np.asarray(idx).tolist()) == sorted(want.tolist())
    np.testing.assert_array_equal(np.asarray(val), x[np.asarray(idx)].astype(np.float32))
