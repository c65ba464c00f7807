"""The battery's transforms with local steps (DiLoCo, SparseLoCo, Streaming DiLoCo) through a user's own step under
``parallel.worker_step`` that calls ``cj.apply_gradients``: their in-place form (or their merge) gives what
``tx.update`` then ``optax.apply_updates`` give on each worker.  Full tier (about 10 s a case); the fast tier
checks the same path for Streaming DiLoCo in ``tests/test_streaming_diloco_builders.py``."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS
from tests.registry import CASES
from tests.test_battery import (
    NAMES,
    SHAPES,
    STEPS,
    N,
    assert_trees_equal,
    linear_loss,
    local_grads,
    per_worker,
    put,
    stacked_init,
    zeros_params,
)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if CASES[n].local_steps])
def test_worker_step_with_apply_gradients_equals_update_then_apply_updates(mesh, name):
    """The transforms with local steps (their in-place form, or their merge) through a user's step under
    ``parallel.worker_step`` that calls ``cj.apply_gradients``: what ``tx.update`` then ``optax.apply_updates``
    give on each worker."""
    tx = CASES[name].make(AXIS)
    init = jax.tree.map(lambda x: x + 0.5, zeros_params({"dense": SHAPES["dense"]}))

    def user_step(params, state, grads):
        return cj.apply_gradients(tx, jax.grad(linear_loss)(params, grads), state, params)

    def plain(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    ref, step = per_worker(plain, mesh), parallel.worker_step(user_step, mesh)
    params, state = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    want_params = put(jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), init), mesh)
    want_state = put(stacked_init(tx, init), mesh)
    for t in range(STEPS):
        grads = local_grads(seed=t, shapes={"dense": SHAPES["dense"]})
        params, state = step(params, state, grads)
        want_params, want_state = ref(want_params, put(grads, mesh), want_state)
        assert_trees_equal(params, want_params, atol=1e-5, err=f"{name}: parameters, step {t + 1}")
        assert_trees_equal(state, want_state, atol=1e-5, err=f"{name}: state, step {t + 1}")
