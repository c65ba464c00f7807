"""Mixed precision in data_parallel_step (compute_dtype=): the loss and its gradient in bfloat16, float32 master
parameters and optimizer state, the gradient cast back where tx takes it; 1-D, replicated 2-D and sharded."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import CASES

import compjax as cj
from compjax import collectives, parallel

SLOW, FAST = 2, 4
LR = 0.5


def _params():
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.normal(size=(64, 256)) * 0.1, jnp.float32), "b1": jnp.zeros(256),
            "w2": jnp.asarray(rng.normal(size=(256, 32)) * 0.1, jnp.float32), "b2": jnp.zeros(32)}


def _batches(steps=3):
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(32, 64)).astype(np.float32), rng.normal(size=(32, 32)).astype(np.float32))
            for _ in range(steps)]


def _loss(seen):
    def loss(p, batch):
        seen.update(jnp.result_type(v).name for v in jax.tree.leaves(p))  # at trace time: what the loss sees
        x, y = batch
        h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
        out = h @ p["w2"] + p["b2"]
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)
    return loss


def _recorder(seen):
    """An optax transform (first in the chain) recording the dtypes of the gradients tx takes, at trace time."""
    def update(g, state, params=None):
        seen.update(jnp.result_type(v).name for v in jax.tree.leaves(g))
        return g, state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _reference(init, batches, parts):
    """One device: the same bfloat16 cast, the mean of ``parts`` chunks' losses, the float32 SGD update."""
    p = init
    for x, y in batches:
        def mean_loss(cp):
            chunks = zip(np.split(x, parts), np.split(y, parts))
            return jnp.mean(jnp.stack([_loss(set())(cp, c) for c in chunks]))
        g = jax.grad(mean_loss)(jax.tree.map(lambda v: v.astype(jnp.bfloat16), p))
        p = jax.tree.map(lambda v, d: v - LR * d.astype(jnp.float32), p, g)
    return p


def _close(got, want, init):
    for k in want:  # against the step each parameter took: bfloat16 sums in another order differ by rounding
        delta = np.abs(np.asarray(want[k]) - np.asarray(init[k])).max()
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=0, atol=0.02 * delta + 1e-7,
                                   err_msg=k)


@pytest.mark.parametrize("layout", ["sharded", "replicated_2d", "one_axis"])
def test_compute_dtype_runs_the_loss_in_bfloat16_and_keeps_float32_master_and_state(layout):
    init, batches = _params(), _batches()
    loss_seen, grad_seen = set(), set()
    tx = optax.chain(_recorder(grad_seen), cj.identity(axis_name="data"), optax.sgd(LR))
    if layout == "one_axis":
        mesh = parallel.make_mesh(SLOW * FAST)
        kw, place = {}, {}
    else:
        mesh = parallel.make_2d_mesh(SLOW, FAST)
        specs = parallel.fsdp_specs(init, mesh, min_size=1024)
        kw = {"specs": specs} if layout == "sharded" else {"fast_axis": "fast"}
        place = {"specs": specs} if layout == "sharded" else {"fast_axis": "fast"}
    params = parallel.replicate(init, mesh, **place)
    state = parallel.init_worker_state(tx, init, mesh, **place)
    step = parallel.data_parallel_step(_loss(loss_seen), tx, mesh, compute_dtype=jnp.bfloat16, **kw)
    for b in batches:
        params, state, loss = step(params, state, parallel.shard_batch(b, mesh, **({} if layout == "one_axis"
                                                                                   else {"fast_axis": "fast"})))
    assert loss_seen == {"bfloat16"}  # the loss sees the cast copy
    assert grad_seen == {"float32"}  # tx takes gradients in the parameters' dtype
    assert {jnp.result_type(v).name for v in jax.tree.leaves(params)} == {"float32"}
    got = parallel.gather(params)
    got = {k: v[0] for k, v in got.items()}
    _close(got, _reference(init, batches, SLOW * FAST), init)


def test_compute_dtype_halves_the_gradient_bytes_the_loss_produces():
    """The gradient leaves of the sharded step's loss are bfloat16 in the compiled program (the converts to float32
    sit on the device's shards, where tx takes them)."""
    init = _params()
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    specs = parallel.fsdp_specs(init, mesh, min_size=1024)
    tx = optax.chain(cj.identity(axis_name="data"), optax.sgd(LR))
    params = parallel.replicate(init, mesh, specs=specs)
    state = parallel.init_worker_state(tx, init, mesh, specs=specs)
    batch = parallel.shard_batch(_batches(1)[0], mesh, fast_axis="fast")
    casts = {}
    for name, dtype in (("bf16", jnp.bfloat16), ("f32", None)):
        step = parallel.data_parallel_step(_loss(set()), tx, mesh, specs=specs, compute_dtype=dtype)
        text = step.lower(params, state, batch).as_text()
        casts[name] = set(re.findall(r"convert[^\n]*\(tensor<([0-9x]+)xbf16>\) -> tensor<[0-9x]+xf32>", text))
    # w1's gradient shard (64 x 64 of 64 x 256) and w2's (64 x 32 of 256 x 32) come out of the loss in bfloat16
    # and are cast to float32 on the device; the float32 step has no bfloat16 at all.
    assert {"64x64", "64x32"} <= casts["bf16"], casts["bf16"]
    assert casts["f32"] == set()


@pytest.mark.parametrize("bad", ["int32", jnp.int8, "nope", 3, jnp.complex64])  # complex: not floating
def test_compute_dtype_must_be_a_floating_point_dtype(bad):
    mesh = parallel.make_mesh(SLOW * FAST)
    tx = optax.chain(cj.identity(axis_name="data"), optax.sgd(LR))
    with pytest.raises(ValueError, match="compute_dtype"):
        parallel.data_parallel_step(_loss(set()), tx, mesh, compute_dtype=bad)


# --- compute_cast: the cast where parameters are used, the gradient left in the compute dtype ------------------------

def _cast_loss(seen):
    """``_loss`` with every parameter passed through ``parallel.compute_cast`` where it is used."""
    inner = _loss(seen)
    return lambda p, batch: inner(parallel.compute_cast(p), batch)


def test_compute_cast_is_astype_forward_and_keeps_the_gradient_in_bfloat16():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 4)), jnp.float32)
    tree = {"w": w, "n": jnp.arange(3)}
    out = parallel.compute_cast(tree)
    assert out["w"].dtype == jnp.bfloat16 and out["n"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32))

    def loss(ws):  # used layer by layer under lax.scan: the stacked gradient stays bfloat16
        def body(x, wl):
            return jnp.tanh(x @ parallel.compute_cast(wl)), None
        x, _ = jax.lax.scan(body, jnp.ones((2, 4), jnp.bfloat16), ws)
        return x.astype(jnp.float32).sum()

    def plain(ws):
        def body(x, wl):
            return jnp.tanh(x @ wl.astype(jnp.bfloat16)), None
        x, _ = jax.lax.scan(body, jnp.ones((2, 4), jnp.bfloat16), ws)
        return x.astype(jnp.float32).sum()

    g, want = jax.grad(loss)(w), jax.grad(plain)(w)
    assert g.dtype == jnp.bfloat16 and want.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want))  # the same bfloat16 values


@pytest.mark.parametrize("bad", ["int32", jnp.int8, "nope", "complex64"])
def test_compute_cast_dtype_must_be_a_floating_point_dtype(bad):
    with pytest.raises(ValueError, match="dtype"):
        parallel.compute_cast({"w": jnp.ones(3)}, bad)


@pytest.mark.parametrize("layout", ["sharded", "replicated_2d"])
def test_compute_cast_gradients_reach_tx_in_bfloat16_and_identity_sends_them_so(layout):
    """Without ``compute_dtype`` the step hands ``tx`` the gradients as the loss gives them: bfloat16 from
    ``compute_cast`` (the parameters and their update stay float32), and ``cj.identity`` sends 2 bytes per
    parameter instead of 4; the parameters follow the float32 update of the bfloat16 gradient."""
    init, batches = _params(), _batches()
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    specs = parallel.fsdp_specs(init, mesh, min_size=1024)
    place = {"specs": specs} if layout == "sharded" else {"fast_axis": "fast"}
    count = sum(int(np.prod(v.shape)) for v in init.values())
    sent = {}
    for name, loss in (("cast", _cast_loss), ("astype", _loss)):
        loss_seen, grad_seen = set(), set()
        tx = optax.chain(_recorder(grad_seen), cj.identity(axis_name="data"), optax.sgd(LR))
        params = parallel.replicate(init, mesh, **place)
        state = parallel.init_worker_state(tx, init, mesh, **place)
        step = parallel.data_parallel_step(loss(loss_seen), tx, mesh, **place)
        for b in batches:
            params, state, _ = step(params, state, parallel.shard_batch(b, mesh, fast_axis="fast"))
        sent[name] = np.asarray(cj.payload_bytes(state))
        if name == "cast":
            assert loss_seen == {"bfloat16"} and grad_seen == {"bfloat16"}
            assert {jnp.result_type(v).name for v in jax.tree.leaves(params)} == {"float32"}
            got = {k: v[0] for k, v in parallel.gather(params).items()}
            _close(got, _reference(init, batches, SLOW * FAST), init)
            text = step.lower(params, state, parallel.shard_batch(batches[0], mesh, fast_axis="fast")).as_text()
            types = re.findall(r'"stablehlo.all_reduce".*?\}\) : \(tensor<\d+x(\w+)>\)', text, flags=re.DOTALL)
            assert "bf16" in types, types  # the slow-axis mean of the gradients, in bfloat16 before XLA:CPU widens it
        else:
            assert grad_seen == {"float32"}
    # The bfloat16 mean's bytes are reduce_bytes' (XLA:CPU widens a bfloat16 all-reduce to float32, so on CPU
    # they equal the float32 ones); both counts carry the same non-finite vote beside the gradients.
    bf16 = collectives.reduce_bytes(jax.ShapeDtypeStruct((count,), jnp.bfloat16))
    assert (sent["cast"] - bf16).tolist() == (sent["astype"] - 4 * count).tolist(), sent
    assert 0 <= sent["astype"][0] - 4 * count <= 64, sent


def _battery_loss(p, batch):
    p = parallel.compute_cast(p)
    x, y = batch
    h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"] + p["b2"] + p["s"]).astype(jnp.float32) - y) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_registry_case_takes_bfloat16_gradients_of_float32_parameters(name):
    """``compute_cast``'s bfloat16 gradients reach every registered transform: five steps in the sharded and the
    replicated 2-D layouts run, stay finite, keep the parameters and every floating-point state leaf float32 and
    count the same ``payload_bytes``; the two layouts agree within bfloat16 rounding (their fast-axis sums of the
    bfloat16 gradients round in different orders, and a top-k may then pick another entry of equal rank)."""
    from tests.helpers import battery_problem, replicated_and_sharded

    case = CASES[name]
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init, batches = battery_problem()
    specs = parallel.fsdp_specs(init, mesh, min_size=1)
    tx = optax.chain(case.make(axis_name="data"), optax.sgd(0.1))
    (rp, rs), (sp, ss), _ = replicated_and_sharded(_battery_loss, tx, init, specs, batches, mesh)
    for tree in (sp, ss, rp, rs):
        floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert {x.dtype for x in floats} <= {jnp.dtype(jnp.float32)}, name
        assert all(np.all(np.isfinite(np.asarray(x))) for x in floats), name
    np.testing.assert_array_equal(np.asarray(cj.payload_bytes(ss)), np.asarray(cj.payload_bytes(rs)))
    got, want = parallel.gather(sp), parallel.gather(rp)
    for k in want:
        np.testing.assert_allclose(got[k], want[k][::FAST], rtol=0, atol=0.05, err_msg=k)
