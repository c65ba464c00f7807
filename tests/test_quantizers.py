"""Quantizing codecs and compressors on one worker: NumPy references from the papers' equations.

1-bit SGD (Seide et al. 2014), MXNet 2-bit, TernGrad (Wen et al. 2017), QSGD
(Alistarh et al. 2017), EF-signSGD (Karimireddy et al. 2019), fp16/bf16 casts.
The random codecs take uniform draws ``u``; the references apply the paper's
rule to the same ``u``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from compjax.codecs import quantize as q

RNG = np.random.default_rng(0)


def np_clip(x, c):
    """TernGrad's clipping at c·σ (σ: population std of the layer)."""
    b = c * x.astype(np.float64).std()
    return np.clip(x, -b, b)


def np_terngrad(x, s, u):
    """Wen et al. 2017: s · sign(x) · b, b = [u < |x| / s]."""
    return s * np.where(x >= 0, 1.0, -1.0) * (u < np.abs(x) / s)


def np_qsgd(v, s, u):
    """Alistarh et al. 2017, Sec. 3.1: ‖v‖ sign(v) ξ, ξ = (l + [u < r - l]) / s, r = s|v|/‖v‖, l = floor(r)."""
    v = v.astype(np.float32)
    norm = np.linalg.norm(v).astype(np.float32)
    r = np.float32(s) * np.abs(v) / norm
    lo = np.floor(r)
    xi = (lo + (u < r - lo)) / s
    return norm * np.where(v < 0, -1.0, 1.0) * xi


def np_onebit(x):
    """Seide et al. 2014: per column (last axis), mean of entries >= 0 and mean of entries < 0."""
    cols = x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(-1, 1)
    out = np.empty_like(cols)
    for j in range(cols.shape[1]):
        c = cols[:, j]
        pos, neg = c >= 0, c < 0
        out[pos, j] = c[pos].mean() if pos.any() else 0.0
        out[neg, j] = c[neg].mean() if neg.any() else 0.0
    return out.reshape(x.shape)


def np_twobit(x, t):
    """MXNet 2-bit: >= t -> +t, <= -t -> -t, else 0."""
    return np.where(x >= t, t, np.where(x <= -t, -t, 0.0))


def np_sign(p):
    """Karimireddy et al. 2019: (‖p‖₁ / d) sign(p), sign(0) = +."""
    return np.abs(p).mean() * np.where(p >= 0, 1.0, -1.0)


# --- codecs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 3, 2, 5), (7, 4), (6,), ()])
def test_onebit_codec_matches_numpy(shape):
    x = RNG.normal(size=shape).astype(np.float32)
    if len(shape) == 2:
        x[:, 0] = np.abs(x[:, 0])  # a column with no negative entry: its negative value is 0
    codes, scales = jax.jit(q.onebit_encode)(jnp.asarray(x))
    cols = q.onebit_columns(shape)
    assert codes.dtype == jnp.uint32 and codes.shape == (x.size,) and scales.shape == (2 * cols,)
    assert cols == (shape[-1] if len(shape) >= 2 else 1)  # flax (..., in, out): a column is an output unit
    got = jax.jit(q.onebit_decode, static_argnums=2)(codes, scales, shape)
    np.testing.assert_allclose(np.asarray(got), np_onebit(x), rtol=1e-5, atol=1e-7)


def test_twobit_codes_and_decode_match_mxnet_rules():
    x = np.array([0.5, 0.49, -0.5, -0.51, 0.0, 2.0, -3.0], np.float32)
    codes = np.asarray(q.twobit_encode(jnp.asarray(x), 0.5))
    np.testing.assert_array_equal(codes, [0b11, 0b00, 0b10, 0b10, 0b00, 0b11, 0b10])
    np.testing.assert_array_equal(np.asarray(q.twobit_decode(jnp.asarray(codes), 0.5, x.shape)), np_twobit(x, 0.5))


def test_terngrad_clip_at_c_sigma():
    x = np.concatenate([RNG.normal(size=999), [100.0]]).astype(np.float32)
    np.testing.assert_allclose(np.asarray(q.terngrad_clip(jnp.asarray(x), 2.5)), np_clip(x, 2.5), rtol=1e-5)
    assert np.asarray(q.terngrad_clip(jnp.asarray(x), 2.5)).max() < 10  # the outlier was clipped


def test_terngrad_codec_matches_numpy():
    x = np_clip(RNG.normal(size=200).astype(np.float32), 2.5)
    s = np.float32(np.abs(x).max() * 1.5)  # a shared scaler above this worker's max
    u = RNG.uniform(size=x.size).astype(np.float32)
    codes = q.terngrad_encode(jnp.asarray(x), jnp.float32(s), jnp.asarray(u))
    assert set(np.unique(np.asarray(codes))) <= {0, 1, 2}
    got = np.asarray(q.terngrad_decode(codes, jnp.float32(s), x.shape))
    np.testing.assert_allclose(got, np_terngrad(x, s, u), rtol=1e-6)


@pytest.mark.parametrize("levels", [2, 7, 256])
def test_qsgd_codec_matches_numpy(levels):
    v = RNG.normal(size=(9, 11)).astype(np.float32)
    u = RNG.uniform(size=v.size).astype(np.float32)
    codes, scales = jax.jit(q.qsgd_encode, static_argnums=1)(jnp.asarray(v), levels, jnp.asarray(u))
    assert int(np.asarray(codes).max()) < 2 ** q.qsgd_bits(levels)  # fits the declared width
    got = np.asarray(jax.jit(q.qsgd_decode, static_argnums=(2, 3))(codes, scales, levels, v.shape))
    np.testing.assert_allclose(got, np_qsgd(v.ravel(), levels, u).reshape(v.shape), rtol=1e-5, atol=1e-7)


def test_qsgd_bits_are_the_fewest_whole_bits():
    for s in (2, 3, 4, 7, 8, 15, 16, 255, 256, 1000):
        b = q.qsgd_bits(s)
        assert 2 ** (b - 1) >= s + 1 > 2 ** (b - 2)  # levels 0..s in b - 1 bits, plus the sign bit


def test_sign_codec_matches_numpy():
    p = RNG.normal(size=(7, 3)).astype(np.float32)
    p[0, 0] = 0.0
    codes, scales = q.sign_encode(jnp.asarray(p))
    np.testing.assert_allclose(np.asarray(q.sign_decode(codes, scales, p.shape)), np_sign(p), rtol=1e-6)


# --- transforms on one worker ----------------------------------------------------------------


def test_twobit_residual_over_three_steps_matches_mxnet_rules():
    thr = 0.5
    gs = [{"w": RNG.normal(scale=0.4, size=(4, 8)).astype(np.float32), "b": RNG.normal(scale=0.4, size=3).astype(np.float32)}
          for _ in range(3)]
    tx = cj.twobit(thr)
    state = tx.init(jax.tree.map(jnp.zeros_like, gs[0]))
    update = jax.jit(tx.update)
    res = {k: np.zeros_like(v) for k, v in gs[0].items()}
    for g in gs:
        out, state = update(g, state)
        for k in g:
            p = g[k] + res[k]  # MXNet: quantize gradient + residual
            dec = np_twobit(p, thr)
            res[k] = p - dec
            np.testing.assert_allclose(np.asarray(out[k]), dec, atol=1e-6)
            np.testing.assert_allclose(np.asarray(state.residual[k]), res[k], atol=1e-6)
    assert int(cj.message_bytes(state)) == 4 * -(-35 // 16)  # 35 codes -> 3 words


def test_signsgd_without_error_feedback_sends_the_scaled_sign():
    g = {"w": RNG.normal(size=(5, 4)).astype(np.float32), "b": RNG.normal(size=4).astype(np.float32)}
    tx = cj.signsgd(error_feedback=False)
    state, update = tx.init(g), jax.jit(tx.update)
    for _ in range(2):  # no memory: the same output every step
        out, state = update(g, state)
        assert state.residual is None
        for k, gk in g.items():
            np.testing.assert_allclose(np.asarray(out[k]), np_sign(gk), rtol=1e-6)
    assert int(cj.message_bytes(state)) == 4 * (1 + 1) + 4 * 2  # one word of signs per layer (20 and 4) + a scale each


@pytest.mark.parametrize(
    "make,codec",
    [
        (cj.onebit, np_onebit),
        (lambda: cj.twobit(0.3), lambda p: np_twobit(p, np.float32(0.3))),
        (cj.signsgd, np_sign),
    ],
    ids=["onebit", "twobit", "signsgd"],
)
def test_error_feedback_follows_the_codec_and_conserves_mass(make, codec):
    """Each step sends the paper's decode of p = g + residual (NumPy references), and sent + residual = g."""
    tx = make()
    gs = [{"w": jnp.asarray(RNG.normal(size=(5, 4)), jnp.float32), "b": jnp.asarray(RNG.normal(size=4), jnp.float32)}
          for _ in range(4)]
    state = tx.init(gs[0])
    update = jax.jit(tx.update)
    sent = jax.tree.map(jnp.zeros_like, gs[0])
    res = {k: np.zeros(v.shape, np.float32) for k, v in gs[0].items()}
    for t, g in enumerate(gs):
        out, state = update(g, state)
        for k in g:
            p = np.asarray(g[k]) + res[k]
            dec = codec(p).astype(np.float32)
            res[k] = p - dec
            assert np.any(dec != 0), "the reference sends something"
            np.testing.assert_allclose(np.asarray(out[k]), dec, rtol=1e-5, atol=1e-6, err_msg=f"step {t} {k}")
            np.testing.assert_allclose(
                np.asarray(state.residual[k]), res[k], rtol=1e-5, atol=1e-5, err_msg=f"residual {t} {k}"
            )
        sent = jax.tree.map(jnp.add, sent, out)
    total = jax.tree.map(lambda *xs: sum(xs), *gs)
    for k in total:
        np.testing.assert_allclose(np.asarray(sent[k] + state.residual[k]), np.asarray(total[k]), atol=1e-5)


@pytest.mark.parametrize("name", ["terngrad", pytest.param("qsgd", marks=pytest.mark.slow),
                                  pytest.param("randomk", marks=pytest.mark.slow)])
def test_unbiased(name):
    """The mean of 10,000 seeded draws is within 4.5 standard errors of the (clipped) input, per element.

    TernGrad and QSGD round stochastically and random-k (no error feedback)
    samples with the counter-based generator (compjax.codecs.random); each draw
    is a different key, and each key's steps and workers are different streams.
    """
    w = RNG.normal(size=(6, 5)).astype(np.float32)
    w[0, 0] = 8.0  # an outlier, clipped by TernGrad at 2.5 sigma
    g = {"w": jnp.asarray(w), "b": jnp.asarray(RNG.normal(size=5), jnp.float32)}
    make = {"terngrad": lambda key: cj.terngrad(key=key), "qsgd": lambda key: cj.qsgd(4, key=key),
            "randomk": lambda key: cj.randomk(0.2, key=key, error_feedback=False)}[name]

    def draw(key):
        tx = make(key)
        return tx.update(g, tx.init(g))[0]

    draws = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(123), 10_000))
    for k, gk in g.items():
        target = np_clip(np.asarray(gk), 2.5) if name == "terngrad" else np.asarray(gk)
        d = np.asarray(draws[k], np.float64)
        assert d.std(0).max() > 0  # the draws are random
        se = d.std(0) / np.sqrt(len(d))
        err = np.abs(d.mean(0) - target)
        assert np.all(err <= 4.5 * se + 1e-6), (k, err.max(), se.max())
    if name == "terngrad":
        assert np.asarray(draws["w"])[:, 0, 0].max() < 8.0  # unbiased for the clipped value, not the raw one


def test_random_key_forms_are_accepted_and_equivalent():
    g = {"w": jnp.zeros(4)}
    want = np.asarray(jax.random.PRNGKey(3))
    for key in (3, np.int64(3), jnp.asarray(3), jax.random.PRNGKey(3), jax.random.key(3)):
        for make in (cj.qsgd, cj.terngrad):
            np.testing.assert_array_equal(np.asarray(make(key=key).init(g).key), want)


def test_the_stream_advances_with_the_step():
    g = {"w": jnp.asarray(RNG.normal(size=64), jnp.float32)}
    tx = cj.terngrad(key=0)
    update = jax.jit(tx.update)
    s0 = tx.init(g)
    out1, s1 = update(g, s0)
    out2, s2 = update(g, s1)
    assert int(s2.count) == 2 and not np.array_equal(np.asarray(out1["w"]), np.asarray(out2["w"]))
    np.testing.assert_array_equal(np.asarray(update(g, s0)[0]["w"]), np.asarray(out1["w"]))  # reproducible


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, "float16", "bfloat16"])
def test_cast_one_worker_is_a_round_trip_through_the_dtype(dtype):
    g = {"w": jnp.asarray(RNG.normal(size=(3, 5)), jnp.float32)}
    tx = cj.cast(dtype)
    out, state = tx.update(g, tx.init(g))
    want = np.asarray(g["w"].astype(jnp.dtype(dtype)).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out["w"]), want)
    assert out["w"].dtype == jnp.float32 and int(cj.message_bytes(state)) == 2 * 15


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: cj.twobit(0.0), "threshold"),
        (lambda: cj.twobit(-1.0), "threshold"),
        (lambda: cj.twobit(float("nan")), "threshold"),
        (lambda: cj.terngrad(key=0, clip_sigma=0.0), "clip_sigma"),
        (lambda: cj.terngrad(key=0, clip_sigma=-2.5), "clip_sigma"),
        (lambda: cj.terngrad(key=1.5), "key"),
        (lambda: cj.qsgd(1, key=0), "levels"),
        (lambda: cj.qsgd(2.5, key=0), "levels"),
        (lambda: cj.qsgd(4, key="seed"), "key"),
        (lambda: cj.cast(jnp.int8), "dtype"),
        (lambda: cj.cast(jnp.float32), "dtype"),
        (lambda: cj.cast("fp8"), "dtype"),
    ],
)
def test_bad_input(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("make", [cj.onebit, cj.twobit, cj.signsgd])
def test_mismatched_tree_is_a_clear_error(make):
    tx = make()
    state = tx.init({"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": jnp.zeros((4, 1)), "b": jnp.zeros(3)}, state)  # would broadcast silently
    with pytest.raises(ValueError, match="structure"):
        tx.update({"w": jnp.zeros((4, 3))}, state)
