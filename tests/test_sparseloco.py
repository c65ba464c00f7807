"""SparseLoCo (cj.sparseloco) against a NumPy reference of its outer step: 4 workers, 3 synchronizations.

The reference is written from Sarfi et al. 2025 (Algorithm 1) and the reference code tplr-ai/SparseLoCo:
``src/tplr/strategies.py`` (``Diloco.outer_step``: ``param.grad = θ_global − θ_local``, the worker restarts
from the global parameters) and ``src/tplr/sparseloco.py`` (``SparseLoCo.step``: decoupled weight decay,
``error_buffer = β error_buffer + lr · grad``, chunk top-k, quantize, subtract the local decode, aggregate the
gathered decodes, plain SGD step with momentum 0).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import compjax as cj
from tests.helpers import AXIS, vmap_quadratic_trainer
from tests.test_chunked import SHAPES, config, np_exchange, np_untile

N, H, SYNCS = 4, 2, 3


def np_sparseloco(init, targets, cfg, inner_lr, outer_lr, wd):
    """Per step: every worker's parameters; at the end: the global parameters and the accumulators."""
    glob = {k: v.astype(np.float64) for k, v in init.items()}
    local = [dict(glob) for _ in range(N)]
    acc = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(N)]
    hist = []
    for s, c in enumerate(targets, start=1):
        local = [{k: p[k] - inner_lr * (p[k] - c[r][k]) for k in SHAPES} for r, p in enumerate(local)]
        if s % H == 0:
            new = {}
            for k, shape in SHAPES.items():
                es = [cfg["decay"] * acc[r][k] + (glob[k] - local[r][k]) for r in range(N)]  # e ← β e + Δ_r
                mean, hw = np_exchange(es, acc, k, cfg)
                delta = np_untile(mean, shape, *hw)
                new[k] = glob[k] - outer_lr * (delta + wd * glob[k])  # θ ← θ(1 − αλ) − α Δ
            glob = new
            local = [dict(glob) for _ in range(N)]
        hist.append(local)
    return hist, glob, acc


@pytest.mark.parametrize("aggregate, wd", [("mean", 0.0), ("senders", 0.1)])
def test_sparseloco_matches_the_numpy_reference(aggregate, wd):
    cfg = config(6, 8, False, "statistical", 2, 0.9, aggregate)
    inner_lr, outer_lr = 0.1, 0.8
    rng = np.random.default_rng(0)
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    targets = [[{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(N)]
               for _ in range(H * SYNCS)]
    want, want_global, want_acc = np_sparseloco(init, targets, cfg, inner_lr, outer_lr, wd)

    tx = cj.sparseloco(optax.sgd(inner_lr), sync_every=H, k=cfg["k"], chunk=cfg["chunk"], decay=cfg["decay"],
                       outer_lr=outer_lr, outer_weight_decay=wd, aggregate=aggregate, axis_name=AXIS)
    params, state, step = vmap_quadratic_trainer(tx, init, N)
    sent = []
    for t, c in enumerate(targets):
        params, state = step(params, state, c)
        sent.append(int(cj.payload_bytes(state)[0]))
        for k in SHAPES:
            for r in range(N):
                np.testing.assert_allclose(np.asarray(params[k])[r], want[t][r][k], atol=1e-5, rtol=1e-5,
                                           err_msg=(t, k, r))
    glob = cj.diloco_global_params(state, params)
    comm = state.comm[0]
    leaves = jax.tree_util.tree_leaves_with_path(init)
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(glob[k])[0], want_global[k], atol=1e-5, rtol=1e-5)
    for (path, _), e in zip(leaves, comm.accumulator):
        k = path[0].key
        for r in range(N):
            np.testing.assert_allclose(np.asarray(e)[r], want_acc[r][k], atol=1e-5, rtol=1e-5)
    # Bytes only on the sync steps: the chunk top-k payload, 2-bit values and packed indices.
    per_sync = cj.chunktopk_bytes(list(SHAPES.values()), cfg["k"], chunk=cfg["chunk"])
    assert sent == [0, per_sync] * SYNCS


def test_sparseloco_bad_input():
    with pytest.raises(ValueError, match="outer_lr"):
        cj.sparseloco(optax.sgd(0.1), sync_every=2, outer_lr=0.0, axis_name=None)
    with pytest.raises(ValueError, match="outer_weight_decay"):
        cj.sparseloco(optax.sgd(0.1), sync_every=2, outer_weight_decay=-1.0, axis_name=None)
    with pytest.raises(ValueError, match="decay"):
        cj.sparseloco(optax.sgd(0.1), sync_every=2, decay=1.2, axis_name=None)
    with pytest.raises(ValueError, match="k must"):
        cj.sparseloco(optax.sgd(0.1), sync_every=2, k=0, axis_name=None)


@pytest.mark.slow  # the reproduction's rows
def test_the_reproduction_rows_build_and_step():
    """The SparseLoCo and DeMo rows of ``experiments/reproduce/diloco.py`` build from its config and take a step."""
    import jax.numpy as jnp

    from experiments.configs import diloco_tiny_shakespeare
    from experiments.reproduce import diloco as repro

    config = diloco_tiny_shakespeare.get_config()
    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    for row in ("sparseloco", "sparseloco-h50", "demo"):
        assert row in repro.ROWS and repro.labels(config)[row]
        tx = repro.make_tx(row, config)(None)
        updates, _ = tx.update(params, tx.init(params), params)
        assert jax.tree.structure(updates) == jax.tree.structure(params)
