"""Delayed Nesterov, the outer optimizer of asynchronous partial merges: Nesterov SGD at full rounds, the reference
rule of Liu et al. 2024 (as HALoS's code writes it) for N equal arrivals, and the share a syncer passes it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from compjax.decoupled import Contribution, Header, Syncer, delayed_nesterov

LR, BETA = 0.7, 0.9


def test_full_rounds_are_nesterov_sgd():
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(5)]
    ours, ref = delayed_nesterov(LR, BETA), optax.sgd(LR, momentum=BETA, nesterov=True)
    s, r = ours.init(jnp.zeros((3, 2))), ref.init(jnp.zeros((3, 2)))
    for g in grads:
        a, s = ours.update(jnp.asarray(g), s, share=1.0)
        b, r = ref.update(jnp.asarray(g), r)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def reference_delayed_nesterov(arrivals, n, lr=LR, beta=BETA):
    """Liu et al. 2024's Delayed Nesterov update with momentum activation c = 0 (HALoS ``opt.py``), in float64:
    every arrival moves θ by -lr g / n; every n-th also steps m = β m + (sum of the buffered g) / n and adds -lr β m."""
    theta, m, delta, out = np.zeros_like(arrivals[0], np.float64), 0.0, 0.0, []
    for t, g in enumerate(arrivals):
        delta = delta + g
        if (t + 1) % n == 0:
            m = beta * m + delta / n
            theta = theta - lr * (beta * m + g / n)
            delta = 0.0
        else:
            theta = theta - lr * g / n
        out.append(theta.copy())
    return out


def test_n_equal_arrivals_follow_the_reference_rule():
    rng = np.random.default_rng(1)
    n = 3
    arrivals = [rng.normal(size=(4,)) for _ in range(8)]
    tx = delayed_nesterov(LR, BETA)
    state, theta = tx.init(jnp.zeros(4)), np.zeros(4)
    for g, want in zip(arrivals, reference_delayed_nesterov(arrivals, n)):
        step, state = tx.update(jnp.asarray(g / n, jnp.float32), state, share=1.0 / n)
        theta = theta + np.asarray(step, np.float64)
        np.testing.assert_allclose(theta, want, rtol=2e-6, atol=2e-6)


def test_a_syncer_passes_each_merge_its_share_of_a_full_round():
    """Two learners of cap 8 tokens, quorum 1: each merge holds half a round (share 0.5), so the first moves the
    global values by -lr g/2 without momentum and the second steps the momentum with both halves."""
    params = {"w": np.zeros(4, np.float32)}
    s = Syncer(params, learners=["a", "b"], min_quorum=1, outer=delayed_nesterov(LR, BETA), partial_rounds="share",
               max_tokens=8.0)
    g1, g2 = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    for seq, (name, g) in enumerate([("a", g1), ("b", g2)], start=1):
        h = Header(name, 0, seq - 1, 8.0, 1, (g.shape,), (g.dtype.str,), g.nbytes, seq)
        assert s.submit(Contribution(h, (g,)))[0].accepted
        if seq == 1:
            np.testing.assert_allclose(s.fragment_values(0)[0], -LR * g1 / 2, rtol=1e-6)
    m = (g1 + g2) / 2
    np.testing.assert_allclose(s.fragment_values(0)[0], -LR * g1 / 2 - LR * (g2 / 2 + BETA * m), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs", [{"learning_rate": 0.0}, {"momentum": 1.0}, {"momentum": -0.1}])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        delayed_nesterov(**kwargs)
