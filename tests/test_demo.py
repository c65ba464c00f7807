"""DeMo (cj.demo) against a NumPy reference of bloc97/DeMo ``demo.py`` (``DeMo.step``), DCT from SciPy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from tests.helpers import AXIS, vmap_quadratic_trainer
from tests.test_chunked import SHAPES, config, np_dct2, np_encode, np_untile

N, STEPS = 4, 3


def np_demo(init, targets, cfg, lrs, wd):
    """``DeMo.step`` for every worker: weight decay, δ ← β δ + η g, DCT top-k, δ −= sent, sign of the mean."""
    params = [{k: v.astype(np.float64) for k, v in init.items()} for _ in range(N)]
    delta = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(N)]
    hist = []
    for lr, c in zip(lrs, targets):
        grads = [{k: params[r][k] - c[r][k] for k in SHAPES} for r in range(N)]
        new = [dict(p) for p in params]
        for k, shape in SHAPES.items():
            parts = []
            for r in range(N):
                delta[r][k] = cfg["decay"] * delta[r][k] + lr * grads[r][k]
                dense, ind, sent, hw = np_encode(delta[r][k], cfg)
                delta[r][k] = delta[r][k] - sent
                parts.append((dense, ind))
            total, cnt = sum(d for d, _ in parts), sum(i for _, i in parts)
            mean = np.where(cnt > 0, total / np.where(cnt > 0, cnt, 1), 0.0)  # scatter_reduce "mean", no self
            agg = np_untile(np_dct2(mean, *hw, inverse=True), shape, *hw)
            for r in range(N):
                new[r][k] = params[r][k] * (1 - lr * wd) - lr * np.sign(agg)
        params = new
        hist.append(params)
    return hist, delta


@pytest.mark.parametrize("schedule", [pytest.param(False, marks=pytest.mark.slow), True])
def test_demo_matches_the_numpy_reference(schedule):
    cfg = config(5, 8, True, "float32", 2, 0.9, "senders")
    wd = 0.05
    lr = optax.linear_schedule(0.1, 0.04, STEPS) if schedule else 0.05
    lrs = [float(lr(t)) if schedule else lr for t in range(STEPS)]
    rng = np.random.default_rng(0)
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    targets = [[{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(N)]
               for _ in range(STEPS)]
    want, want_delta = np_demo(init, targets, cfg, lrs, wd)

    tx = cj.demo(lr, decay=cfg["decay"], k=cfg["k"], chunk=cfg["chunk"], weight_decay=wd, axis_name=AXIS)
    params, state, step = vmap_quadratic_trainer(tx, init, N)
    for t, c in enumerate(targets):
        params, state = step(params, state, c)
        for k in SHAPES:
            for r in range(N):
                np.testing.assert_allclose(np.asarray(params[k])[r], want[t][r][k], atol=1e-5, rtol=1e-5,
                                           err_msg=(t, k, r))
    for k in SHAPES:
        for r in range(N):
            np.testing.assert_allclose(np.asarray(state.momentum[k])[r], want_delta[r][k], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(state.count) == STEPS)


def test_demo_bad_input():
    for kwargs, match in [({"decay": 1.0}, "decay"), ({"decay": -0.1}, "decay"),
                          ({"weight_decay": -1.0}, "weight_decay"), ({"k": 0}, "k must"), ({"chunk": 0}, "chunk"),
                          ({"values": "qsgd"}, "values")]:
        with pytest.raises(ValueError, match=match):
            cj.demo(0.1, **kwargs)
    with pytest.raises(ValueError, match="learning_rate"):
        cj.demo(0.0)
    tx = cj.demo(0.1, weight_decay=0.1)
    g = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match="params"):
        tx.update(g, tx.init(g))
