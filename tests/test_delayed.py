"""Delayed Gradient Averaging against a NumPy reference of its update rule, and its program's data flow."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from compjax.codecs.sparse import layer_k
from tests.helpers import AXIS, VOTE, init_stacked, run_workers

SHAPES = {"w": (6, 5), "b": (7,)}


def grads_steps(steps, n, seed=0):
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]


def np_topk_mean(ps, ratio):
    """Exact top-k of each worker's p (ties to the lowest index, as lax.top_k), summed and divided by n."""
    sent = np.zeros_like(ps)
    for w, p in enumerate(ps):
        flat = p.reshape(-1)
        k = layer_k(flat.size, ratio)
        idx = np.argsort(-np.abs(flat), kind="stable")[:k]
        s = np.zeros_like(flat)
        s[idx] = flat[idx]
        sent[w] = s.reshape(p.shape)
    return sent


def np_dga(steps, delay, ratio=None):
    """Zhu et al. 2021: update_t = g_t - g_{t-D} + mean_j g^j_{t-D} (g_t alone while t < D), per worker.

    ``ratio``: the delayed exchange goes through top-k with error feedback (residual per worker).
    Returns the per-step updates {leaf: (n, *shape)}, float64.
    """
    res = {k: np.zeros(v.shape) for k, v in steps[0].items()}
    outs = []
    for t, g in enumerate(steps):
        if t < delay:
            outs.append({k: v.astype(np.float64) for k, v in g.items()})
            continue
        out = {}
        for k, v in g.items():
            old = steps[t - delay][k].astype(np.float64)
            if ratio is None:
                mean = old.mean(0)
            else:
                p = old + res[k]
                sent = np_topk_mean(p, ratio)
                res[k] = p - sent
                mean = sent.mean(0)
            out[k] = v - old + mean[None]
        outs.append(out)
    return outs


@pytest.mark.parametrize("delay", [1, 3])
def test_matches_numpy_reference_over_30_steps(delay):
    n, steps = 4, 30
    gs = grads_steps(steps, n, seed=delay)
    tx = cj.delayed_averaging(delay, axis_name=AXIS)
    f = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, n)
    want = np_dga(gs, delay)
    for t in range(steps):
        out, state = f(gs[t], state)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(out[k]), want[t][k], rtol=1e-5, atol=1e-5, err_msg=f"{k} step {t}")
    # The ring buffer holds the last D local gradients, slot t mod D.
    for j in range(delay):
        t = steps - delay + j
        np.testing.assert_array_equal(np.asarray(state.history[0])[:, t % delay], gs[t]["b"])


def test_delayed_exchange_through_topk_with_error_feedback_matches_numpy():
    n, steps, delay, ratio = 4, 12, 2, 0.2
    gs = grads_steps(steps, n, seed=7)
    tx = cj.delayed_averaging(delay, axis_name=AXIS, compressor=cj.topk(ratio, axis_name=AXIS, skip_nonfinite=False))
    f = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, n)
    want = np_dga(gs, delay, ratio=ratio)
    for t in range(steps):
        out, state = f(gs[t], state)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(out[k]), want[t][k], rtol=1e-5, atol=1e-5, err_msg=f"{k} step {t}")
    # Top-k's bytes are counted in the inner state, from the first exchange on.
    k_total = sum(layer_k(int(np.prod(s)), ratio) for s in SHAPES.values())
    assert np.all(cj.payload_bytes(state) == 8 * k_total + VOTE)


def test_delay_zero_is_synchronous_data_parallel_sgd(mesh):
    """delay=0: every step's update is the mean of this step's local gradients, as the dense baseline."""
    gs = grads_steps(4, 8, seed=3)
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    for tx_d, tx_i in [(cj.delayed_averaging(0, axis_name=AXIS), cj.identity(axis_name=AXIS))]:
        s_d, s_i = init_stacked(tx_d, params, 8), init_stacked(tx_i, params, 8)
        for g in gs:
            out_d, s_d = run_workers(tx_d, g, s_d, "shard_map", mesh)
            out_i, s_i = run_workers(tx_i, g, s_i, "shard_map", mesh)
            for k in SHAPES:
                np.testing.assert_allclose(out_d[k], out_i[k], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(out_d[k][0], g[k].mean(0), rtol=1e-6, atol=1e-6)
        assert np.all(cj.payload_bytes(s_d) == cj.payload_bytes(s_i))


def test_nothing_is_sent_before_the_first_average_is_due(mesh):
    delay = 3
    gs = grads_steps(delay + 2, 8, seed=4)
    tx = cj.delayed_averaging(delay, axis_name=AXIS, skip_nonfinite=False)
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, 8)
    dense = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    seen = []
    for g in gs:
        _, state = run_workers(tx, g, state, "shard_map", mesh)
        seen.append(int(cj.payload_bytes(state)[0]))
    assert seen == [0] * delay + [dense] * 2



def np_dga_period(steps, delay, period):
    """Zhu et al. 2021, Algorithm 1 with period K: S_p = sum of a worker's g over steps pK .. pK + K - 1;
    at t = pK + K - 1 + D the update is g_t - S_p + mean_j S^j_p, at every other step g_t.  Per worker, float64."""
    outs = []
    for t, g in enumerate(steps):
        out = {k: v.astype(np.float64) for k, v in g.items()}
        end = t - delay  # the last step of the period whose average arrives now, if one does
        if end >= period - 1 and end % period == period - 1:
            first = end - period + 1
            for k, v in out.items():
                s = sum(steps[u][k].astype(np.float64) for u in range(first, end + 1))
                out[k] = v - s + s.mean(0)[None]
        outs.append(out)
    return outs


@pytest.mark.parametrize("delay,period", [pytest.param(0, 3, marks=pytest.mark.slow), (2, 3), (5, 2),
                                          pytest.param(1, 4, marks=pytest.mark.slow),
                                          pytest.param(3, 1, marks=pytest.mark.slow)])
def test_period_matches_numpy_reference_over_30_steps(delay, period):
    n, steps = 4, 30
    gs = grads_steps(steps, n, seed=10 * delay + period)
    tx = cj.delayed_averaging(delay, axis_name=AXIS, period=period, skip_nonfinite=False)
    f = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, n)
    assert state.history[0].shape[1] == cj.algorithms.history_slots(delay, period) == 1 + -(-(delay - 1) // period)
    want = np_dga_period(gs, delay, period)
    dense = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    for t in range(steps):
        out, state = f(gs[t], state)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(out[k]), want[t][k], rtol=1e-5, atol=1e-5, err_msg=f"{k} step {t}")
        arrives = t - delay >= period - 1 and (t - delay) % period == period - 1
        assert np.all(cj.payload_bytes(state) == (dense if arrives else 0)), t  # one exchange per period
    np.testing.assert_allclose(np_dga_period(gs, delay, 1)[-1]["w"], np_dga(gs, delay)[-1]["w"])  # K = 1 rule


def test_period_without_delay_is_local_sgd_with_model_averaging():
    """D = 0, K = 3, plain SGD: every worker steps on its own gradients; at each period's end all models
    equal the average of the models the workers reached (the update makes them so)."""
    n, period, lr = 4, 3, 0.1
    gs = grads_steps(9, n, seed=5)
    tx = optax.chain(cj.delayed_averaging(0, axis_name=AXIS, period=period, skip_nonfinite=False), optax.sgd(lr))
    params = {k: jnp.zeros((n, *s)) for k, s in SHAPES.items()}
    local = {k: np.zeros((n, *s)) for k, s in SHAPES.items()}
    f = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, n)
    for t, g in enumerate(gs):
        upd, state = f(g, state, params)
        params = optax.apply_updates(params, upd)
        local = {k: local[k] - lr * g[k] for k in SHAPES}
        if t % period == period - 1:
            local = {k: np.broadcast_to(v.mean(0), v.shape) for k, v in local.items()}
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(params[k]), local[k], rtol=1e-5, atol=1e-6, err_msg=f"{k} {t}")


# --- the collective of step t reads no gradient of step t ---------------------------------------

COLLECTIVES = {"psum", "psum2", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
               "psum_invariant", "all_gather_invariant"}


def _sub_jaxprs(eqn):
    """(sub-jaxpr, how its invars map to eqn.invars) for higher-order primitives."""
    p = eqn.params
    if eqn.primitive.name == "cond":
        return [(b.jaxpr, eqn.invars[1:]) for b in p["branches"]]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p:
            j = p[key]
            return [(getattr(j, "jaxpr", j), eqn.invars)]
    if eqn.primitive.name == "while":
        return [(p["body_jaxpr"].jaxpr, eqn.invars[p["cond_nconsts"]:])]
    return []


def collective_inputs_depend_on(jaxpr, tainted):
    """For each collective reached from ``jaxpr``: whether one of its operands depends on a ``tainted`` invar.

    Dependencies are followed through every equation (conservatively: an equation's outputs depend on all
    its inputs) and into the sub-jaxprs of cond/pjit/shard_map/while with their operands mapped.
    """
    found = []

    def walk(jx, taint):  # taint: set of tainted Vars of jx
        taint = set(taint)
        for eqn in jx.eqns:
            ins = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
            bad = any(v in taint for v in ins)
            if eqn.primitive.name in COLLECTIVES:
                found.append((eqn.primitive.name, bad))
            for sub, mapped in _sub_jaxprs(eqn):
                sub_taint = {sv for sv, ov in zip(sub.invars, mapped)
                             if not isinstance(ov, jax.extend.core.Literal) and ov in taint}
                walk(sub, sub_taint)
            if bad:
                taint.update(eqn.outvars)

    walk(jaxpr, tainted)
    return found


@pytest.mark.parametrize("skip_nonfinite,period", [(False, 1), (True, 1), (False, 3)])
def test_the_exchange_does_not_read_this_steps_gradient(mesh, skip_nonfinite, period):
    """In the traced step, no collective's operand depends on the gradient given to this update
    (except the non-finite vote, when the guard is on: one int32 pmax), with or without a period."""
    tx = cj.delayed_averaging(2, axis_name=AXIS, compressor=cj.topk(0.2, axis_name=AXIS, skip_nonfinite=False),
                              skip_nonfinite=skip_nonfinite, period=period)
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    spec = jax.sharding.PartitionSpec(AXIS)

    def body(g, s):
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s))
        return jax.tree.map(lambda x: x[None], (out, s))

    f = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))
    put = lambda t: jax.device_put(t, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    g = put({k: jnp.zeros((8, *s)) for k, s in SHAPES.items()})
    closed = jax.make_jaxpr(f)(g, put(init_stacked(tx, params, 8)))
    n_grads = len(jax.tree.leaves(g))
    found = collective_inputs_depend_on(closed.jaxpr, set(closed.jaxpr.invars[:n_grads]))
    exchange = [bad for name, bad in found if name != "pmax"]
    assert len(exchange) >= 2 and not any(exchange), found  # top-k's indices and values all-gathers
    votes = [bad for name, bad in found if name == "pmax"]
    assert votes == ([True] if skip_nonfinite else [])
    # The walker does see a dependency where there is one: the same check on the state's history finds it.
    hist = [v for v in closed.jaxpr.invars[n_grads:]]
    assert any(bad for name, bad in collective_inputs_depend_on(closed.jaxpr, set(hist)) if name != "pmax")


def test_payload_bytes_equal_the_audited_exchange(mesh):
    tx = optax.chain(cj.delayed_averaging(1, axis_name=AXIS, compressor=cj.powersgd(1, axis_name=AXIS,
                                                                                     skip_nonfinite=False)),
                     optax.sgd(0.1))
    params = {"w": jnp.ones((8, 6)), "b": jnp.zeros(6)}

    def loss_fn(p, batch):
        return jnp.mean((batch @ p["w"] + p["b"]) ** 2)

    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    batch = parallel.shard_batch(np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32), mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    ops = cj.audit_collectives(step, p, s, batch)
    for _ in range(2):  # the first step sends nothing; the second sends the first step's gradient
        p, s, _ = jax.block_until_ready(step(p, s, batch))
    assert int(cj.payload_bytes(s)[0]) == sum(op.bytes for op in ops) > VOTE


@pytest.mark.parametrize(
    "kwargs,name",
    [({"delay": -1}, "delay"), ({"delay": 1.5}, "delay"), ({"delay": "2"}, "delay"),
     ({"delay": 2, "compressor": "topk"}, "compressor"), ({"delay": 2, "period": 0}, "period"),
     ({"delay": 2, "period": 2.5}, "period")],
)
def test_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        cj.delayed_averaging(axis_name=AXIS, **kwargs)
