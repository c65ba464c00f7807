"""1-bit, 2-bit, TernGrad, QSGD, EF-signSGD and fp16/bf16 against NumPy references, with their bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from compjax.codecs import quantize as q
from tests.helpers import AXIS, init_stacked, run_workers
from tests.test_accounting import batch_data, init_params, loss_fn

RNG = np.random.default_rng(0)


# --- codecs against NumPy references written from the papers -----------------------------


def test_onebit_codec_matches_numpy():
    x = RNG.normal(size=(3, 3, 2, 5)).astype(np.float32)  # flax conv: columns = 5 output units
    codes, scales = q.onebit_encode(jnp.asarray(x))
    cols = x.reshape(-1, 5)
    pos = np.array([cols[:, j][cols[:, j] >= 0].mean() for j in range(5)])
    neg = np.array([cols[:, j][cols[:, j] < 0].mean() for j in range(5)])
    np.testing.assert_allclose(np.asarray(scales), np.concatenate([pos, neg]), rtol=1e-5)
    want = np.where(cols >= 0, pos, neg).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(q.onebit_decode(codes, scales, x.shape)), want, rtol=1e-5)


def test_twobit_residual_over_three_steps_matches_mxnet_rules():
    thr = 0.5
    gs = [RNG.normal(scale=0.4, size=(4, 8)).astype(np.float32) for _ in range(3)]
    tx = cj.twobit(thr)
    state = tx.init(jnp.zeros((4, 8)))
    res = np.zeros((4, 8), np.float32)
    for g in gs:
        out, state = tx.update(jnp.asarray(g), state)
        p = g + res  # MXNet: quantize gradient + residual
        dec = np.where(p >= thr, thr, np.where(p <= -thr, -thr, 0.0))
        res = p - dec
        np.testing.assert_allclose(np.asarray(out), dec, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.residual), res, atol=1e-6)
    assert int(state.payload_bytes) == 4 * 32 // 16


def test_sign_codec_matches_numpy():
    p = RNG.normal(size=(7, 3)).astype(np.float32)
    codes, scales = q.sign_encode(jnp.asarray(p))
    want = np.abs(p).sum() / p.size * np.where(p >= 0, 1.0, -1.0)
    np.testing.assert_allclose(np.asarray(q.sign_decode(codes, scales, p.shape)), want, rtol=1e-6)


def test_qsgd_codec_levels_and_bits():
    assert q.qsgd_bits(256) == 10 and q.qsgd_bits(2) == 3 and q.qsgd_bits(255) == 9
    v = RNG.normal(size=50).astype(np.float32)
    codes, scales = q.qsgd_encode(jnp.asarray(v), 4, jax.random.PRNGKey(0))
    dec = np.asarray(q.qsgd_decode(codes, scales, 4, v.shape))
    norm = np.linalg.norm(v)
    r = 4 * np.abs(v) / norm  # the two admissible levels per element (Alistarh et al., Sec. 3.1)
    lvl = np.abs(dec) / norm * 4
    assert np.all((np.isclose(lvl, np.floor(r), atol=1e-4)) | np.isclose(lvl, np.floor(r) + 1, atol=1e-4))
    assert np.all(np.sign(dec[dec != 0]) == np.sign(v[dec != 0]))


def test_terngrad_clip_at_c_sigma():
    x = np.concatenate([RNG.normal(size=999), [100.0]]).astype(np.float32)
    c = np.asarray(q.terngrad_clip(jnp.asarray(x), 2.5))
    assert np.isclose(c.max(), 2.5 * x.std(), rtol=1e-5) and np.array_equal(c[:999], np.clip(x[:999], -2.5 * x.std(), 2.5 * x.std()))


# --- unbiasedness: the mean of 2,000 seeded draws within 4 standard errors -----------------


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
def test_unbiased(name):
    g = {"w": jnp.asarray(RNG.normal(size=(6, 5)), jnp.float32), "b": jnp.asarray(RNG.normal(size=5), jnp.float32)}

    def draw(key):
        tx = cj.terngrad(key=key) if name == "terngrad" else cj.qsgd(4, key=key)
        return tx.update(g, tx.init(g))[0]

    keys = jax.random.split(jax.random.PRNGKey(123), 2000)
    draws = jax.jit(jax.vmap(draw))(keys)
    target = jax.tree.map(lambda x: q.terngrad_clip(x, 2.5), g) if name == "terngrad" else g
    for k in g:
        d = np.asarray(draws[k], np.float64)
        se = d.std(0) / np.sqrt(len(d))
        err = np.abs(d.mean(0) - np.asarray(target[k]))
        assert np.all(err <= 4 * se + 1e-6), (k, err.max(), se.max())


# --- error feedback conserves mass (one worker) -------------------------------------------


@pytest.mark.parametrize("make", [cj.onebit, lambda: cj.twobit(0.3), cj.signsgd], ids=["onebit", "twobit", "signsgd"])
def test_error_feedback_conserves_mass(make):
    tx = make()
    gs = [{"w": jnp.asarray(RNG.normal(size=(5, 4)), jnp.float32), "b": jnp.asarray(RNG.normal(size=4), jnp.float32)}
          for _ in range(4)]
    state = tx.init(gs[0])
    sent = jax.tree.map(jnp.zeros_like, gs[0])
    for g in gs:
        out, state = jax.jit(tx.update)(g, state)
        sent = jax.tree.map(jnp.add, sent, out)
    total = jax.tree.map(lambda *xs: sum(xs), *gs)
    for k in total:
        np.testing.assert_allclose(np.asarray(sent[k] + state.residual[k]), np.asarray(total[k]), atol=1e-5)


# --- multi-worker: the mean of every worker's decoded payload, backends agree --------------


def test_twobit_mean_over_workers_matches_numpy(mesh):
    n = 8
    g = {"w": RNG.normal(scale=0.6, size=(n, 4, 8)).astype(np.float32)}
    tx = cj.twobit(0.5, axis_name=AXIS)
    out, _ = run_workers(tx, g, init_stacked(tx, {"w": jnp.zeros((4, 8))}, n), "shard_map", mesh)
    dec = np.where(g["w"] >= 0.5, 0.5, np.where(g["w"] <= -0.5, -0.5, 0.0))
    for w in range(n):
        np.testing.assert_allclose(out["w"][w], dec.mean(0), atol=1e-6)


@pytest.mark.parametrize(
    "make", [lambda: cj.onebit(axis_name=AXIS), lambda: cj.qsgd(8, key=3, axis_name=AXIS)], ids=["onebit", "qsgd"]
)
def test_backends_agree(mesh, make):
    tx = make()
    g = {"w": RNG.normal(size=(8, 6, 5)).astype(np.float32), "b": RNG.normal(size=(8, 5)).astype(np.float32)}
    s0 = init_stacked(tx, {"w": jnp.zeros((6, 5)), "b": jnp.zeros(5)}, 8)
    ref = run_workers(tx, g, s0, "shard_map", mesh)
    for backend in ("pmap", "vmap"):
        got = run_workers(tx, g, s0, backend, mesh)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_randomness_differs_across_workers_and_steps():
    tx = cj.terngrad(key=0, axis_name=AXIS)
    g = {"w": np.tile(RNG.normal(size=(1, 64)).astype(np.float32), (4, 1))}  # same gradient on 4 workers
    s = init_stacked(tx, {"w": jnp.zeros(64)}, 4)

    def per_worker(gw, sw):
        return tx.update(gw, sw)

    out1, s = jax.vmap(per_worker, axis_name=AXIS)(g, s)
    out2, _ = jax.vmap(per_worker, axis_name=AXIS)(g, s)
    assert not np.allclose(np.asarray(out1["w"][0]), np.asarray(out2["w"][0]))  # a new draw each step
    one = cj.terngrad(key=0)  # a lone worker's draw is not the 4-worker mean: workers drew differently
    assert not np.allclose(np.asarray(one.update({"w": g["w"][0]}, one.init({"w": g["w"][0]}))[0]["w"]),
                           np.asarray(out1["w"][0]))


# --- bytes: payload_bytes equals the compiled step's collectives ---------------------------

QUANTIZERS = {
    "onebit": lambda: cj.onebit(axis_name=AXIS),
    "twobit": lambda: cj.twobit(0.01, axis_name=AXIS),
    "terngrad": lambda: cj.terngrad(key=0, axis_name=AXIS),
    "qsgd": lambda: cj.qsgd(256, key=0, axis_name=AXIS),
    "signsgd": lambda: cj.signsgd(axis_name=AXIS),
    "cast_f16": lambda: cj.cast(jnp.float16, axis_name=AXIS),
    "cast_bf16": lambda: cj.cast(jnp.bfloat16, axis_name=AXIS),
}


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_payload_bytes_equals_audited_bytes(mesh, name):
    params = init_params()
    tx = optax.chain(QUANTIZERS[name](), optax.sgd(0.05, momentum=0.9))
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    batch = batch_data(mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    ops = cj.audit_collectives(step, p, s, batch)
    p, s, loss = jax.block_until_ready(step(p, s, batch))
    assert int(np.asarray(cj.payload_bytes(s))[0]) == sum(op.bytes for op in ops)
    assert 1 <= len(ops) <= 3 and np.all(np.isfinite(np.asarray(loss)))
    if name == "cast_bf16":
        assert [o.dtype for o in ops] == ["u16"]


def test_twobit_is_exactly_16x_and_sign_codecs_at_least_28x():
    sizes16 = {"a": jnp.zeros((16, 16)), "b": jnp.zeros((3, 3, 16, 32)), "c": jnp.zeros(48)}
    ident = 4 * sum(x.size for x in jax.tree.leaves(sizes16))
    tx = cj.twobit()
    _, st = tx.update(sizes16, tx.init(sizes16))
    assert ident / int(st.payload_bytes) == 16.0
    from experiments import models

    params, _, _ = models.build(0)  # the main job's CNN
    dense = 4 * sum(x.size for x in jax.tree.leaves(params))
    for tx in (cj.onebit(), cj.signsgd()):
        _, st = jax.jit(tx.update)(params, tx.init(params))
        assert dense / int(st.payload_bytes) >= 28


def test_fp16_cast_does_not_overflow_in_the_sum(mesh):
    g = {"w": np.full((8, 4), 60000.0, np.float32)}  # 8 x 60000 overflows float16 (max 65504)
    tx = cj.cast(jnp.float16, axis_name=AXIS)
    out, st = run_workers(tx, g, init_stacked(tx, {"w": jnp.zeros(4)}, 8), "shard_map", mesh)
    np.testing.assert_allclose(out["w"], 60000.0, rtol=1e-3)
    assert int(st.payload_bytes[0]) == 8


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: cj.twobit(0.0), "threshold"),
        (lambda: cj.twobit(-1.0), "threshold"),
        (lambda: cj.terngrad(clip_sigma=0.0), "clip_sigma"),
        (lambda: cj.qsgd(1), "levels"),
        (lambda: cj.qsgd(2.5), "levels"),
        (lambda: cj.cast(jnp.int8), "dtype"),
        (lambda: cj.cast(jnp.float32), "dtype"),
        (lambda: cj.cast("fp8"), "dtype"),
    ],
)
def test_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("make", [cj.onebit, cj.twobit, cj.signsgd])
def test_mismatched_tree(make):
    tx = make()
    state = tx.init({"w": jnp.zeros((4, 3))})
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": jnp.zeros((4, 1))}, state)
