"""Streaming DiLoCo with overlap through the step builders users call, against the paper's update in NumPy.

``cj.diloco(..., overlap=tau > 0)`` keeps optax's two calls (its merge ``θ ← α θ + (1 − α) θ̃`` is part of
the updates); every step builder goes through :func:`compjax.apply_gradients`.  Run through
``parallel.data_parallel_step``, ``parallel.worker_step`` (a user's step calling ``cj.apply_gradients``)
and ``parallel.nnx_data_parallel_step`` (on a 1-D mesh it runs ``nnx.Optimizer.update``, optax's two calls; on
a ``slow x fast`` mesh its own step core calls ``cj.apply_gradients``), the local parameters must follow
Douillard et al.
2025, Algorithm 2: fragments with offsets, the outer gradient kept ``tau`` steps, outer Nesterov, mixing
``α`` (``tests.test_diloco.np_diloco``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS
from tests.test_diloco import init_params, np_diloco, targets

N = 8
H, FRAGMENTS, TAU, ALPHA = 2, 2, 1, 0.3
STEPS = 2 * H + TAU + 1  # every fragment starts twice and merges at least once


def streaming_tx():
    """Inner SGD(0.1); outer Nesterov SGD(0.7, 0.9) (the default); fp32 mean of the outer gradients."""
    return cj.diloco(optax.sgd(0.1), sync_every=H, fragments=FRAGMENTS, overlap=TAU, alpha=ALPHA, axis_name=AXIS)


def quadratic(params, c):
    """``0.5 ||θ - c||²`` summed over leaves; ``c`` is one worker's batch: the targets with a leading 1."""
    return sum(0.5 * jnp.sum((p - t[0]) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(c)))


def reference(n=N, init=None, cs=None):
    return np_diloco(STEPS, n, H=H, P=FRAGMENTS, tau=TAU, alpha=ALPHA, lr=0.1, outer_lr=0.7, momentum=0.9,
                     nesterov=True, init=init, cs=cs)


def small_problem(n=N, seed=4):
    """Two leaves (one per fragment: offsets 0 and 1) and per step the workers' minima: a program that
    compiles in about a second."""
    rng = np.random.default_rng(seed)
    init = {"a": rng.normal(size=(3,)).astype(np.float32), "b": rng.normal(size=(2, 2)).astype(np.float32)}
    cs = [jax.tree.map(lambda x: rng.normal(size=(n, *x.shape)).astype(np.float32), init) for _ in range(STEPS)]
    return init, cs


def assert_follows(history, want):
    """``history[t]``: worker-stacked parameters after step t + 1 (a tree like ``SHAPES``)."""
    for t, (got, ref) in enumerate(zip(history, want)):
        for w in range(len(ref)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref[w])):
                np.testing.assert_allclose(np.asarray(a)[w], b, rtol=1e-5, atol=1e-5,
                                           err_msg=f"step {t + 1}, worker {w}")


def test_data_parallel_step_follows_streaming_diloco_with_overlap(mesh):
    tx = streaming_tx()
    init, cs = small_problem()
    params, opt_state = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    step = parallel.data_parallel_step(quadratic, tx, mesh)
    history = []
    for c in cs:
        params, opt_state, _ = step(params, opt_state, parallel.shard_batch(c, mesh))
        history.append(jax.tree.map(np.asarray, params))
    assert_follows(history, reference(init=init, cs=cs))


@pytest.mark.slow
def test_worker_step_with_apply_gradients_follows_streaming_diloco_with_overlap(mesh):
    tx = streaming_tx()

    def train_step(params, opt_state, c):  # a user's single-device step
        grads = jax.grad(quadratic)(params, c)
        return cj.apply_gradients(tx, grads, opt_state, params)

    init, cs = small_problem()
    params, opt_state = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    step = parallel.worker_step(train_step, mesh)
    history = []
    for c in cs:
        params, opt_state = step(params, opt_state, c)
        history.append(jax.tree.map(np.asarray, params))
    assert_follows(history, reference(init=init, cs=cs))


class Block(nnx.Module):
    def __init__(self, w, b):
        self.w, self.b = nnx.Param(jnp.asarray(w)), nnx.Param(jnp.asarray(b))


class Model(nnx.Module):
    """The parameters of ``SHAPES`` as NNX Params: four blocks (strided into fragments) and an embedding."""

    def __init__(self, init):
        self.blocks = nnx.List([Block(b["w"], b["b"]) for b in init["blocks"]])
        self.embed = nnx.Param(jnp.asarray(init["embed"]))

    def tree(self):
        return {"blocks": [{"w": b.w[...], "b": b.b[...]} for b in self.blocks], "embed": self.embed[...]}


@pytest.mark.slow
@pytest.mark.parametrize("fast", [1, 2])
def test_nnx_data_parallel_step_follows_streaming_diloco_with_overlap(mesh, fast):
    """fast = 2: 4 workers of 2 devices each (``make_2d_mesh``), both devices of a worker given its target."""
    n = N // fast
    tx = streaming_tx()
    model = Model(init_params())
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grid = mesh if fast == 1 else parallel.make_2d_mesh(n, fast)
    parallel.nnx_replicate(grid, model, optimizer)
    step = parallel.nnx_data_parallel_step(lambda m, c: quadratic(m.tree(), c), grid,
                                           fast_axis=None if fast == 1 else "fast")
    history = []
    for c in targets(STEPS, n):
        step(model, optimizer, jax.tree.map(lambda x: np.repeat(x, fast, axis=0), c))
        history.append(jax.tree.map(np.asarray, model.tree()))
    assert_follows(history, reference(n))
