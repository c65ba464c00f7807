"""A program ported from pmap or from a jit + NamedSharding step trains what its user believes, and counts it right.

Each test is the shape of a user's program (a few layers, a few steps): a leftover ``lax.pmean`` of the
gradients is refused under ``shard_map`` and flagged by the audit under ``pmap``; a compressor with no worker
axis reports nothing as sent; ``payload_bytes`` reads 0 on the steps a wrapper sent nothing.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import accounting, parallel
from tests.helpers import AXIS

N = 8
PARAMS = {"w1": jnp.full((8, 16), 0.1), "b1": jnp.zeros(16), "w2": jnp.full((16, 1), 0.1)}
GRAD_BYTES = (8 * 16 + 16 + 16) * 4


def mlp_loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def batch(n=N * 2, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(n, 8)), jnp.float32), jnp.asarray(rng.normal(size=(n, 1)), jnp.float32)


def stacked(tree, n=N):
    return jax.tree.map(lambda v: jnp.stack([jnp.asarray(v)] * n), tree)


# --- a leftover lax.pmean(grads) -------------------------------------------------------------------------------


def pmap_style_step(tx, leftover_pmean):
    """The train step of a pmap program: grads, (the old pmean), the optimizer, a metrics pmean."""

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        if leftover_pmean:
            grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

    return train_step


def test_leftover_pmean_under_shard_map_is_refused_naming_the_axis_and_the_fix(mesh):
    tx = optax.chain(cj.topk(0.1, axis_name=AXIS), optax.sgd(0.1))
    x, y = batch()
    state = parallel.replicate((PARAMS, tx.init(PARAMS)), mesh)
    bad = parallel.worker_step(lambda s, x, y: pmap_style_step(tx, True)(*s, x, y), mesh, batch_argnums=(1, 2))
    with pytest.raises(ValueError, match=r"cj\.topk \(axis_name='data'\).*already invariant over the worker axis "
                                         r"'data'.*Remove the user's pmean/psum of the gradients \(compjax averages"):
        bad(state, x, y)
    good = parallel.worker_step(lambda s, x, y: pmap_style_step(tx, False)(*s, x, y), mesh, batch_argnums=(1, 2))
    _, s, _ = good(state, x, y)  # without it the same step runs, and the metrics pmean is no gradient
    assert np.all(cj.payload_bytes(s) > 0)


def test_leftover_pmean_under_pmap_is_flagged_by_the_audit(mesh):
    tx = optax.chain(cj.topk(0.1, axis_name=AXIS), optax.sgd(0.1))
    x, y = (v.reshape(N, 2, -1) for v in batch())
    args = (stacked(PARAMS), stacked(tx.init(PARAMS)), x, y)
    with pytest.warns(UserWarning, match=r"not issued by compjax carry 6[0-9]{2} B per device, at least the 640 B of "
                                         r"gradients.*leftover `grads = jax.lax.pmean\(grads, axis\)`.*remove it"):
        ops = cj.audit_collectives(jax.pmap(pmap_style_step(tx, True), axis_name=AXIS), *args)
    flagged = [op for op in ops if op.flag == accounting.DENSE_GRADIENTS]
    assert flagged and sum(op.bytes for op in flagged) >= GRAD_BYTES
    assert all(op.op == "all-reduce" and op.issuer is None for op in flagged)
    assert "[dense gradients, not compjax]" in accounting.format_collectives(ops)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the port done right: the metrics pmean (4 B) is no gradient all-reduce
        ops = cj.audit_collectives(jax.pmap(pmap_style_step(tx, False), axis_name=AXIS), *args)
    assert not any(op.flag for op in ops)
    assert any(op.issuer is None for op in ops)  # the metrics pmean is listed, not flagged


# --- the jit + NamedSharding form: no worker axis, nothing sent ------------------------------------------------


def test_jit_named_sharding_step_reports_nothing_sent_and_keeps_the_message_size(mesh):
    """NNX's data-parallel toy: nnx.jit over a replicated model and a batch sharded over the devices, topk inside."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(cj.topk(0.1), optax.sgd(0.1)), wrt=nnx.Param)
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    x, y = (jax.device_put(v, data) for v in batch())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = cj.audit_collectives(nnx.jit(lambda m, o, x, y: train_step(m, o, x, y)), model, optimizer, x, y)
    said = [str(w.message) for w in caught]
    assert any("crossed the wire densely" in m for m in said)  # the audit: XLA's dense all-reduce of the gradients
    assert any("cj.topk has axis_name=None" in m and "mesh of 8 devices" in m and "nothing is exchanged" in m
               for m in said)  # and, at trace time, the compressor itself
    train_step(model, optimizer, x, y)
    k = -(-(8 * 16) // 10) + -(-16 // 10) + -(-16 // 10) + 1  # top-k of each layer (kernel, bias, kernel, bias)
    assert int(cj.payload_bytes(optimizer)) == 0  # compjax sent nothing: not presented as sent
    assert int(cj.message_bytes(optimizer)) == k * (4 + 4)  # what one worker's message would carry
    assert accounting.bytes_by_issuer(ops)["compjax"] == 0


# --- payload_bytes under optax's wrappers ----------------------------------------------------------------------


def run_wrapped(tx, mesh, steps):
    def train_step(p, s, x, y):
        u, s = tx.update(jax.grad(mlp_loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    step = parallel.worker_step(train_step, mesh, batch_argnums=(2, 3))
    p, s = parallel.replicate(PARAMS, mesh), parallel.replicate(tx.init(PARAMS), mesh)
    x, y = batch()
    audited = accounting.bytes_by_issuer(cj.audit_collectives(step, p, s, x, y))["compjax"]
    states = []
    for _ in range(steps):
        p, s = step(p, s, x, y)
        states.append(s)
    return audited, states


def test_multisteps_micro_steps_warn_that_the_exchange_ran_and_the_count_is_the_last_kept_one(mesh):
    """optax.MultiSteps(k=4) around a top-k chain: the exchange runs on every micro-step (MultiSteps computes the
    inner update each time and keeps it every 4th), so reading the count between kept steps warns."""
    inner = optax.chain(cj.topk(0.1, axis_name=AXIS), optax.sgd(0.1))
    audited, states = run_wrapped(optax.MultiSteps(inner, every_k_schedule=4), mesh, 8)
    assert audited > 0  # the compiled step (every micro-step) carries the exchange
    seen = []
    for t, s in enumerate(states, start=1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen.append(int(cj.payload_bytes(s)[0]))
        micro = t % 4 != 0
        assert bool(caught) == micro, t
        if micro:
            assert "MultiSteps runs the compressor's exchange on every micro-step" in str(caught[0].message)
            assert "accumulate the micro-batches' gradients inside the step" in str(caught[0].message)
            assert "with cj.multi_steps(inner, k)" in str(caught[0].message)
    assert seen == [0, 0, 0, audited] + [audited] * 4  # the kept count; the warning says what it is


@pytest.mark.parametrize("wrap", ["apply_if_finite", "masked", "multi_transform", "inject_hyperparams", "k=1"])
def test_wrappers_that_exchange_every_step_count_every_step_without_a_warning(mesh, wrap):
    labels = {"w1": "c", "b1": "z", "w2": "c"}
    txs = {
        "apply_if_finite": lambda: optax.apply_if_finite(cj.topk(0.1, axis_name=AXIS), 3),
        "masked": lambda: optax.masked(cj.topk(0.1, axis_name=AXIS), {"w1": True, "b1": False, "w2": True}),
        "multi_transform": lambda: optax.multi_transform({"c": cj.topk(0.1, axis_name=AXIS),
                                                          "z": optax.set_to_zero()}, labels),
        "inject_hyperparams": lambda: optax.inject_hyperparams(cj.topk, static_args=("ratio",))(0.1, axis_name=AXIS),
        "k=1": lambda: optax.MultiSteps(cj.topk(0.1, axis_name=AXIS), every_k_schedule=1),
    }
    audited, states = run_wrapped(optax.chain(txs[wrap](), optax.sgd(0.1)), mesh, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [int(cj.payload_bytes(s)[0]) for s in states] == [audited, audited]
