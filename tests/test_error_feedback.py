"""Error feedback conserves mass: sum of what was sent + final residual = sum of local gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import compjax as cj
from tests.helpers import AXIS, init_stacked, run_workers

shape_st = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def _grads(shapes, steps, n, seed):
    rng = np.random.default_rng(seed)
    return [[{f"l{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)} for _ in range(n)]
            for _ in range(steps)]


def _check_one_worker(tx, shapes, seed, steps=3):
    """One worker: the output of each step is exactly what this worker sent."""
    gs = [g[0] for g in _grads(shapes, steps, 1, seed)]
    state = tx.init(jax.tree.map(jnp.zeros_like, gs[0]))
    update = jax.jit(tx.update)
    sent_total = jax.tree.map(np.zeros_like, gs[0])
    for g in gs:
        out, state = update(g, state)
        sent_total = jax.tree.map(lambda a, b: a + np.asarray(b, np.float64), sent_total, out)
    g_total = jax.tree.map(lambda *xs: np.sum(xs, axis=0, dtype=np.float64), *gs)
    for k in g_total:
        np.testing.assert_allclose(sent_total[k] + np.asarray(state.residual[k]), g_total[k], atol=1e-4)


@settings(max_examples=15, deadline=None)
@given(st.lists(shape_st, min_size=1, max_size=3), st.floats(0.01, 1.0), st.integers(0, 2**16))
def test_topk_conserves_mass(shapes, ratio, seed):
    _check_one_worker(cj.topk(ratio), shapes, seed)


@settings(max_examples=10, deadline=None)
@given(st.lists(shape_st, min_size=1, max_size=3), st.integers(1, 3), st.integers(0, 2**16))
def test_powersgd_conserves_mass(shapes, rank, seed):
    _check_one_worker(cj.powersgd(rank=rank, min_compression_rate=0.0), shapes, seed)


def test_conservation_across_workers():
    """With 4 workers the averaged output times n plus all residuals equals all gradients."""
    n, steps = 4, 3
    shapes = [(5, 4), (7,), (2, 3, 4)]
    for tx in (cj.topk(0.1, axis_name=AXIS), cj.powersgd(1, min_compression_rate=0.0, axis_name=AXIS)):
        gs = _grads(shapes, steps, n, seed=7)
        state = init_stacked(tx, {k: jnp.zeros(v.shape) for k, v in gs[0][0].items()}, n)
        total_out = None
        for t in range(steps):
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *gs[t])
            out, state = run_workers(tx, stacked, state, "vmap")
            total_out = out if total_out is None else jax.tree.map(np.add, total_out, out)
        g_sum = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *[g for step in gs for g in step])
        for k in g_sum:
            np.testing.assert_allclose(
                total_out[k][0] * n + state.residual[k].sum(0), g_sum[k], atol=1e-4, err_msg=k
            )
