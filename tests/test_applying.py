"""``cj.apply_gradients``: one step with its updates applied, in place for DiLoCo and SparseLoCo.

The in-place step must equal optax's two calls (``tx.update`` then ``optax.apply_updates``), skip a
non-finite step without touching the parameters or the inner state, and hold fewer temporaries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax.compressors import applying
from tests.helpers import AXIS, USERS_CODEGEN
from tests.test_diloco import init_params, stack, targets
from tests.test_diloco_memory import _params, _small_sharded_step

N = 4


def _methods():
    return {
        "diloco": lambda: cj.diloco(optax.adamw(0.05), sync_every=2, axis_name=AXIS),
        "diloco_fragments_topk": lambda: cj.diloco(optax.sgd(0.1, momentum=0.9), sync_every=3, fragments=2,
                                                   compressor=cj.topk(0.3, axis_name=AXIS), axis_name=AXIS),
        "diloco_no_skip": lambda: cj.diloco(optax.adamw(0.05), sync_every=2, skip_nonfinite=False, axis_name=AXIS),
        "sparseloco": lambda: cj.sparseloco(optax.adamw(0.05), sync_every=2, k=2, chunk=2, axis_name=AXIS),
    }


def test_a_plain_optax_transform_is_update_then_apply_updates():
    tx = optax.adam(0.1)
    params = {"w": jnp.arange(3.0), "h": jnp.ones((2, 2), jnp.bfloat16)}
    grads = {"w": jnp.array([1.0, -2.0, 0.5]), "h": jnp.full((2, 2), 0.5, jnp.bfloat16)}
    state = tx.init(params)
    got, got_state = cj.apply_gradients(tx, grads, state, params)
    u, want_state = tx.update(grads, state, params)
    want = optax.apply_updates(params, u)
    for k, before in params.items():
        np.testing.assert_array_equal(got[k], want[k])
        assert got[k].dtype == before.dtype and not np.array_equal(got[k], before)
    np.testing.assert_array_equal(got_state[0].mu["w"], want_state[0].mu["w"])
    assert applying.in_place_apply(tx) is None


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in ("sparseloco", "diloco_fragments_topk")
                                  else m for m in _methods()])
def test_in_place_step_equals_update_then_apply_updates(name):
    """Four workers, six steps (syncs after 2, 3, 4 or 6), a NaN on worker 2 at step 5: both forms agree to 1e-6."""
    tx = _methods()[name]()
    assert applying.in_place_apply(tx) is not None
    params = stack(init_params(), N)
    state = stack(tx.init(init_params()), N)

    def two(p, s, c):
        u, s = tx.update(jax.tree.map(lambda x, y: x - y, p, c), s, p)
        return optax.apply_updates(p, u), s

    def one(p, s, c):
        return cj.apply_gradients(tx, jax.tree.map(lambda x, y: x - y, p, c), s, p)

    f2, f1 = (jax.jit(jax.vmap(f, axis_name=AXIS)) for f in (two, one))
    p1, s1 = params, state
    p2, s2 = params, state
    for step, c in enumerate(targets(6, N, seed=3)):
        if step == 4 and name != "diloco_no_skip":
            c = jax.tree.map(np.copy, c)
            c["embed"][2, 0, 0] = np.nan
        before = jax.tree.map(np.asarray, (p1, s1))
        p1, s1 = f1(p1, s1, c)
        p2, s2 = f2(p2, s2, c)
        for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        if step == 4 and name != "diloco_no_skip":  # not a sync step: worker 2 keeps everything bit for bit
            assert np.asarray(s1.skipped).tolist() == [0, 0, 1, 0]
            for a, b in zip(jax.tree.leaves((p1, s1.inner)), jax.tree.leaves((before[0], before[1].inner))):
                np.testing.assert_array_equal(np.asarray(a)[2], np.asarray(b)[2])
    assert int(np.asarray(s1.count)[0]) == 6
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(p1))


def test_after_a_sync_the_workers_hold_the_new_global_parameters_exactly():
    """With ``apply`` the local parameters take ``θ̃`` itself (two calls: ``p + (θ̃ − p)``, rounded)."""
    tx = _methods()["diloco"]()
    p, s = stack(init_params(), N), stack(tx.init(init_params()), N)
    f = jax.jit(jax.vmap(lambda p, s, c: cj.apply_gradients(tx, jax.tree.map(lambda x, y: x - y, p, c), s, p),
                         axis_name=AXIS), compiler_options=USERS_CODEGEN)
    for c in targets(2, N, seed=4):
        p, s = f(p, s, c)
    for x, a in zip(jax.tree.leaves(p), [a for frag in s.anchor for a in frag]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(a))


def _temp_over_params(step, tx, grad_dtype):
    params = _params()
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, grad_dtype), params)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), grads).compile(USERS_CODEGEN)
    return compiled.memory_analysis().temp_size_in_bytes / sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


@pytest.mark.parametrize(("name", "kwargs", "bound"), [
    ("diloco", {}, 1.0), ("diloco", {"skip_nonfinite": False}, 1.0),
    pytest.param("sparseloco", {"k": 8, "chunk": 16}, 1.5, marks=pytest.mark.slow)])
def test_in_place_step_holds_no_copy_of_the_updates(name, kwargs, bound):
    """bfloat16 gradients: the two calls hold the float32 updates beside the gradients, the in-place step does not.

    Measured (temporaries over the parameters' bytes): DiLoCo 1.75 two calls, 0.75 in place (0.50
    without the guard; 2.00 when that step left its loop of one trip); SparseLoCo 2.07 and 1.07.
    """
    tx = getattr(cj, name)(optax.adamw(1e-3), sync_every=4, axis_name=None, **kwargs)

    def two(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def one(p, s, g):
        return cj.apply_gradients(tx, g, s, p)

    two_ratio, one_ratio = (_temp_over_params(f, tx, jnp.bfloat16) for f in (two, one))
    assert one_ratio < bound <= two_ratio, f"in place {one_ratio:.2f}, two calls {two_ratio:.2f} (bound {bound})"


@pytest.mark.slow
def test_sharded_step_applies_in_place():
    """``data_parallel_step(specs=...)`` goes through the in-place step: at least the largest leaf's updates fewer.

    Measured: 260,472 bytes of temporaries in place, 326,552 through the two calls.
    """
    tx = cj.sparseloco(optax.adamw(1e-3), sync_every=4, k=8, chunk=16, axis_name="data")
    in_place = _small_sharded_step(tx).memory_analysis().temp_size_in_bytes
    del applying._APPLY[tx.update]  # the same transformation through optax's two calls
    two_calls = _small_sharded_step(tx).memory_analysis().temp_size_in_bytes
    layer_shard = 4 * (4 * 128 * 128) // 4  # the stacked layers' float32 updates on one of the 4 fast devices
    assert two_calls - in_place >= layer_shard, (two_calls, in_place, layer_shard)


def test_registration_checks_its_function():
    with pytest.raises(TypeError, match="apply must be a function"):
        applying.applies_in_place(optax.sgd(0.1), "not a function")


def _scaled_by_gain():
    """An inner transform that reads an extra argument: ``updates * gain`` (``gain`` passed to ``update``)."""

    def update(updates, state, params=None, *, gain, **extra_args):
        del params, extra_args
        return jax.tree.map(lambda u: u * gain, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_extra_args_reach_the_inner_optimizer_of_the_in_place_step():
    """``cj.apply_gradients(tx, ..., gain=g)`` passes ``gain`` on to ``tx``'s in-place step as ``tx.update`` gets
    it: the first inner step (no sync before step 2) moves the parameters by ``-0.1 * gain * g``."""
    tx = cj.diloco(optax.chain(_scaled_by_gain(), optax.sgd(0.1)), sync_every=2, axis_name=None)  # one worker
    assert applying.in_place_apply(tx) is not None
    params = {"w": jnp.arange(4.0)}
    grads = {"w": jnp.array([1.0, -2.0, 0.5, 4.0])}
    got, state = jax.jit(lambda g, s, p: cj.apply_gradients(tx, g, s, p, gain=0.25))(grads, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(got["w"]), np.arange(4.0) - 0.1 * 0.25 * np.asarray(grads["w"]), rtol=1e-6)
    assert int(state.count) == 1
