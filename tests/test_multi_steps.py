"""cj.multi_steps: optax.MultiSteps' gradient accumulation with the inner exchange only on the k-th step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel

K, WORKERS = 3, 4


def _loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def _init():
    return {"w1": jnp.ones((6, 8)) * 0.1, "w2": jnp.ones((8, 3)) * 0.1, "b": jnp.zeros(3)}


def _batches(n, size):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(size, 6)).astype(np.float32), rng.normal(size=(size, 3)).astype(np.float32))
            for _ in range(n)]


def _chain():
    return optax.chain(cj.topk(0.25, axis_name="w"), optax.sgd(0.5))


def test_matches_optax_multisteps_under_vmap_and_sends_only_on_the_kth_step():
    def run(tx):
        def step(p, s, b):
            g = jax.grad(_loss)(p, b)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        vstep = jax.jit(jax.vmap(step, axis_name="w"))
        stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * WORKERS), t)
        p, s = stack(_init()), stack(tx.init(_init()))
        sent = []
        for x, y in _batches(2 * K, WORKERS * 4):
            p, s = vstep(p, s, (x.reshape(WORKERS, 4, 6), y.reshape(WORKERS, 4, 3)))
            if isinstance(s, cj.MultiStepsState):
                sent.append(cj.payload_bytes(s).tolist())
        return p, sent

    ours, sent = run(cj.multi_steps(_chain(), K))
    ref, _ = run(optax.MultiSteps(_chain(), K).gradient_transformation())
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(ours["w1"], _init()["w1"])  # it trained
    x = sent[K - 1][0]
    assert x > 0 and sent == ([[0] * WORKERS] * (K - 1) + [[x] * WORKERS]) * 2


def test_the_audit_counts_the_kth_steps_exchange_on_data_parallel_step():
    mesh = parallel.make_mesh()
    tx = cj.multi_steps(optax.chain(cj.topk(0.25, axis_name="data"), optax.sgd(0.1)), K)
    p, s = parallel.replicate(_init(), mesh), parallel.init_worker_state(tx, _init(), mesh)
    step = parallel.data_parallel_step(_loss, tx, mesh)
    sent = []
    for b in _batches(K, 32):
        b = parallel.shard_batch(b, mesh)
        p, s, _ = step(p, s, b)
        sent.append(int(cj.payload_bytes(s)[0]))
    assert sent[:-1] == [0] * (K - 1) and sent[-1] > 0
    ops = cj.audit_collectives(step, p, s, b)
    assert cj.worker_bytes(ops, mesh) == sent[-1]
    mine = [op for op in ops if op.issuer == "compjax"]
    assert mine and all(op.branch for op in mine)  # the exchange sits in the cond's branch: not run on micro-steps


@pytest.mark.parametrize("every_k", [0, -2, 1.5, True])
def test_bad_every_k_is_refused_naming_it(every_k):
    with pytest.raises(ValueError, match="every_k"):
        cj.multi_steps(optax.sgd(0.1), every_k)


def test_a_nonfinite_micro_gradient_skips_that_inner_step_on_every_worker_and_the_next_cycle_trains():
    """As optax.MultiSteps without should_skip_update_fn: the NaN enters the mean; the compressor's vote skips."""
    tx = cj.multi_steps(optax.chain(cj.topk(0.5, axis_name="w"), optax.sgd(1.0)), 2)
    s = jax.vmap(tx.init)({"w": jnp.zeros((WORKERS, 4))})
    vstep = jax.jit(jax.vmap(lambda s, g: tx.update(g, s), axis_name="w"))
    ones = jnp.ones((WORKERS, 4))
    outs = []
    for g in (ones, ones.at[1, 2].set(jnp.nan), ones, ones):
        u, s = vstep(s, {"w": g})
        outs.append(np.asarray(u["w"]))
    assert all(np.isfinite(o).all() for o in outs)
    assert not outs[1].any() and not np.asarray(s.acc_grads["w"]).any()  # skipped everywhere, accumulator reset
    np.testing.assert_allclose(outs[3], np.tile([-1.0, -1.0, 0.0, 0.0], (WORKERS, 1)))


def test_the_step_builders_see_the_compressor_inside_and_not_the_wrapper_itself():
    from compjax.compressors import chains

    assert chains.holds_exchange(cj.multi_steps(optax.chain(cj.topk(0.5, axis_name="w"), optax.sgd(0.1)), 2))
    assert not chains.holds_exchange(cj.multi_steps(optax.sgd(0.1), 2))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2d", "sharded"])
def test_two_d_and_sharded_layouts_send_on_the_kth_step_only_and_match_the_audit(layout):
    from test_byte_units import _run

    tx = cj.multi_steps(optax.chain(cj.topk(0.25, axis_name="data"), optax.sgd(0.1)), 2)
    _, s1, _ = _run(layout, tx, steps=1)
    mesh, s2, ops = _run(layout, tx, steps=2)
    assert cj.payload_bytes(s1).tolist() == [0, 0]
    sent = cj.payload_bytes(s2).tolist()
    assert sent[0] > 0 and sent == [sent[0]] * 2 and cj.worker_bytes(ops, mesh) == sent[0]


def test_nested_counters_read_zero_on_micro_steps():
    """A counter inside a state that has one of its own (delayed averaging over top-k) is silenced too."""
    inner = cj.delayed_averaging(0, axis_name="w", compressor=cj.topk(0.5, axis_name="w", skip_nonfinite=False))
    tx = cj.multi_steps(optax.chain(inner, optax.sgd(0.1)), 2)
    s = jax.vmap(tx.init)({"w": jnp.zeros((WORKERS, 4))})
    vstep = jax.jit(jax.vmap(lambda s, g: tx.update(g, s), axis_name="w"))
    sent = []
    for t in range(4):
        _, s = vstep(s, {"w": jnp.arange(16.0).reshape(WORKERS, 4) + t})
        sent.append(int(cj.payload_bytes(s)[0]))
    assert sent[0] == sent[2] == 0 and sent[1] == sent[3] > 4  # more than delayed averaging's 4-byte vote


def test_counters_follow_optax_multisteps():
    """``gradient_step`` counts inner steps (one every K micro-steps) and ``mini_step`` the micro-steps since
    the last, step by step as ``optax.MultiSteps``' state does."""
    ours, ref = cj.multi_steps(optax.sgd(0.1), K), optax.MultiSteps(optax.sgd(0.1), K)
    params = {"w": jnp.ones(3)}
    s, r = ours.init(params), ref.init(params)
    up, rup = jax.jit(ours.update), jax.jit(ref.update)
    for t in range(2 * K + 1):
        g = {"w": jnp.full(3, float(t))}
        _, s = up(g, s, params)
        _, r = rup(g, r, params)
        assert (int(s.gradient_step), int(s.mini_step)) == (int(r.gradient_step), int(r.mini_step)) == (
            (t + 1) // K, (t + 1) % K), f"micro-step {t + 1}"
