"""E3M0 (Streaming DiLoCo's 4-bit floats): the codec against a NumPy reference, packing, error, the wire.

The reference below is written from the format's rule (``compjax.codecs.e3m0``)
with float64 ``log2``; the codec works on float32 bits.  On 8 workers every
worker must end with the mean of all workers' decoded payloads, and
``payload_bytes`` must equal the compiled step's collectives and the formula
``4 * sum_leaves ceil(size / 8) + 4 * leaves + 4``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax.codecs import bitpack
from compjax.codecs import e3m0 as codec
from tests.helpers import AXIS, VOTE, init_stacked

N = 8


def np_encode(x):
    """The rule, in float64: scale = 2**ceil(log2 max|x|); c = min(round(log2(|x|/scale)), 0) + 7, 0 below 2**-6.5."""
    a = np.abs(np.asarray(x, np.float32).ravel().astype(np.float64))
    normal = a >= 2.0**-126  # subnormal float32 entries encode as 0
    amax = a.max() if a.size else 0.0
    e = int(np.clip(np.ceil(np.log2(amax)), -126, 127)) if amax >= 2.0**-126 else 0
    with np.errstate(divide="ignore"):
        t = np.round(np.log2(a / 2.0**e))  # no ties: the midpoints 2**(j + 0.5) are irrational
    zero = ~normal | (t < -6)
    c = np.where(zero, 0, np.minimum(t, 0) + 7).astype(np.uint32)
    sign = np.where((np.asarray(x, np.float32).ravel() < 0) & ~zero, 8, 0).astype(np.uint32)
    return c | sign, np.float32(2.0**e)


def np_decode(codes, scale, shape):
    c = (codes & 7).astype(np.int64)
    mag = np.where(c == 0, 0.0, np.float64(scale) * 2.0 ** (c - 7))
    return np.where(codes & 8, -mag, mag).reshape(shape)


encode = jax.jit(codec.encode)
decode = jax.jit(codec.decode, static_argnums=2)


def roundtrip(x):
    codes, scales = encode(jnp.asarray(x))
    return np.asarray(decode(codes, scales, np.shape(x)))


# --- 1. exact on representable values ---------------------------------------------------------------


@pytest.mark.parametrize("scale", [2.0**-120, 2.0**-20, 1.0, 2.0**10, 2.0**127])
def test_representable_values_round_trip_exactly(scale):
    rng = np.random.default_rng(0)
    k = rng.integers(0, 8, size=1001)  # 0: zero, 1..7: scale * 2**(k - 7)
    s = rng.choice([-1.0, 1.0], size=k.size)
    k[0] = 7  # max|x| == scale
    x = np.where(k == 0, 0.0, s * scale * 2.0 ** (k - 7)).astype(np.float32)
    codes, scales = encode(jnp.asarray(x))
    assert codes.dtype == jnp.uint32 and codes.shape == (x.size,)
    assert scales.dtype == jnp.float32 and scales.shape == (1,) and float(scales[0]) == scale
    np.testing.assert_array_equal(np.asarray(codes), np.where(k == 0, 0, k + 8 * (s < 0)))
    np.testing.assert_array_equal(roundtrip(x), x)


# --- 2. packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 9, 13, 1001])
def test_codes_pack_8_per_word_and_unpack_exactly(n):
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    codes, _ = encode(jnp.asarray(x))
    words = bitpack.pack(codes, codec.BITS)  # what compjax.compressors.quantized sends
    assert words.dtype == jnp.uint32 and words.shape == (math.ceil(n / 8),)
    np.testing.assert_array_equal(np.asarray(bitpack.unpack(words, codec.BITS, n)), np.asarray(codes))
    # code i of a word in bits [4 i, 4 i + 4)
    padded = np.zeros(8 * words.shape[0], np.uint64)
    padded[:n] = np.asarray(codes)
    expected = (padded.reshape(-1, 8) << (4 * np.arange(8, dtype=np.uint64))).sum(1)
    np.testing.assert_array_equal(np.asarray(words, np.uint64), expected)


# --- 3. the codec against the NumPy reference -----------------------------------------------------


def boundary_values(scale):
    """float32 values at and around every rounding midpoint scale * 2**(j + 0.5) and every code value."""
    out = []
    for j in range(-8, 1):
        for v in (scale * 2.0 ** (j + 0.5), scale * 2.0**j):
            f = np.float32(v)
            lo, hi = f, f
            for _ in range(3):
                lo, hi = np.nextafter(lo, np.float32(0)), np.nextafter(hi, np.float32(np.inf))
                out += [lo, hi]
            out.append(f)
    out = np.array(out, np.float32)
    out = out[out <= np.float32(scale)]
    return np.concatenate([out, -out, [0.0, -0.0]]).astype(np.float32)


@pytest.mark.parametrize("scale", [2.0**-126, 2.0**-20, 1.0, 3.7, 2.0**10])  # 2**-126: subnormals around
def test_codec_matches_numpy_reference_bitwise(scale):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=5000) * scale / 5, boundary_values(2.0 ** math.ceil(math.log2(scale)))])
    x = x.astype(np.float32)
    x[0] = scale  # the maximum: its own scale when a power of two, else the next power of two
    codes, scales = encode(jnp.asarray(x))
    ref_codes, ref_scale = np_encode(x)
    assert float(scales[0]) == ref_scale == 2.0 ** math.ceil(math.log2(scale))
    np.testing.assert_array_equal(np.asarray(codes), ref_codes)
    np.testing.assert_array_equal(roundtrip(x), np_decode(ref_codes, ref_scale, x.shape).astype(np.float32))


def test_max_just_above_a_power_of_two_takes_the_next_scale():
    x = np.array([np.nextafter(np.float32(2.0), np.float32(3.0)), 0.5, -0.1], np.float32)
    codes, scales = encode(jnp.asarray(x))
    assert float(scales[0]) == 4.0 == np_encode(x)[1]
    np.testing.assert_array_equal(np.asarray(codes), np_encode(x)[0])


# --- 4. error on Gaussian data, and error feedback ------------------------------------------------

#: ||decode(encode(x)) - x|| / ||x|| measured on 100,000 N(0, 1) entries: 0.2027 ... 0.2050 over seeds 0..4
#: (scale 8: every |x| below 8 * 2**-6.5 = 0.088 is sent as 0, the rest within a factor sqrt(2)).
GAUSSIAN_REL_ERR = (0.19, 0.22)


def test_relative_error_on_gaussian_data():
    x = np.random.default_rng(0).normal(size=100_000).astype(np.float32)
    rel = np.linalg.norm(roundtrip(x) - x) / np.linalg.norm(x)
    print(f"E3M0 relative error on N(0, 1), 100,000 entries: {rel:.4f}")
    assert GAUSSIAN_REL_ERR[0] < rel < GAUSSIAN_REL_ERR[1]


def test_error_feedback_tracks_the_accumulated_gradient():
    """Sum of what was sent = sum of gradients - residual; the residual stays about 0.2 ||g||."""
    rng = np.random.default_rng(2)
    steps, d = 200, 10_000
    results = {}
    for ef in (True, False):
        tx = cj.e3m0(error_feedback=ef)
        state = tx.init({"w": jnp.zeros(d)})
        update = jax.jit(tx.update)
        total_g, total_sent, worst = np.zeros(d), np.zeros(d), 0.0
        for _ in range(steps):
            g = rng.normal(size=d).astype(np.float32)
            out, state = update({"w": g}, state)
            total_g += g
            total_sent += np.asarray(out["w"])
            if ef:
                worst = max(worst, float(np.linalg.norm(np.asarray(state.residual["w"])) / np.linalg.norm(g)))
        results[ef] = np.linalg.norm(total_sent - total_g) / np.linalg.norm(total_g)
        if ef:
            assert worst < 0.25, worst  # measured 0.213: bounded, does not grow with the steps
            np.testing.assert_allclose(total_g - total_sent, np.asarray(state.residual["w"]), atol=1e-3)
        else:
            assert state.residual is None
    print(f"relative error of the accumulated sum after {steps} steps: {results}")
    assert results[True] < 0.02  # measured 0.015 (||e|| / (sqrt(200) ||g||))
    assert results[False] > 0.15  # measured 0.20: without feedback the error of every step stays


# --- 5. 8 workers: the mean of every worker's decoded payload; bytes -------------------------------


def per_worker(tx, mesh):
    def body(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s)
        return jax.tree.map(lambda x: x[None], (u, s))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def put(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P(AXIS)))


def formula(shapes, vote=True):
    sizes = [math.prod(s) for s in shapes.values()]
    return 4 * sum(math.ceil(n / 8) for n in sizes) + 4 * len(sizes) + (VOTE if vote else 0)


@pytest.mark.parametrize("shapes", [
    {"b": (5,), "k": (16, 8), "w": (3, 4, 5)},  # sizes 5, 128, 60: partly filled words
    {"b": (8,), "k": (16, 12)},  # multiples of 8: exactly 8x fewer bytes than float32, plus the scales
])
@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_mean_over_8_workers_and_audited_bytes(mesh, shapes, skip_nonfinite):
    tx = cj.e3m0(axis_name=AXIS, skip_nonfinite=skip_nonfinite)
    rng = np.random.default_rng(3)
    g = {k: (rng.normal(size=(N, *s)) * 10.0 ** rng.uniform(-3, 3, size=(N,) + (1,) * len(s))).astype(np.float32)
         for k, s in shapes.items()}  # each worker its own magnitude: different scales
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in shapes.items()}, N)
    f = per_worker(tx, mesh)
    args = put((g, state), mesh)
    ops = cj.audit_collectives(f, *args)
    out, state = jax.tree.map(np.asarray, jax.block_until_ready(f(*args)))
    for k, s in shapes.items():
        dec = np.stack([np_decode(*np_encode(g[k][w]), s) for w in range(N)])
        for w in range(N):  # the same mean on every worker
            np.testing.assert_allclose(out[k][w], dec.mean(0), rtol=1e-6, atol=0)
        np.testing.assert_allclose(state.residual[k], g[k] - dec, rtol=1e-6, atol=1e-6 * np.abs(g[k]).max())
    kinds = sorted((o.op, o.dtype) for o in ops)
    assert kinds == sorted([("all-gather", "u32"), ("all-gather", "f32")]
                           + ([("all-reduce", "s32")] if skip_nonfinite else []))
    audited = sum(o.bytes for o in ops)
    nbytes = cj.payload_bytes(state)
    assert np.all(nbytes == audited) and audited == formula(shapes, skip_nonfinite), (nbytes, audited)
    if all(math.prod(s) % 8 == 0 for s in shapes.values()):
        assert 8 * (audited - 4 * len(shapes) - VOTE * skip_nonfinite) == 4 * sum(math.prod(s) for s in shapes.values())


# --- 6. bfloat16 leaves and all-zero leaves ------------------------------------------------------


def test_bf16_and_all_zero_leaves_keep_dtype_and_stay_finite(mesh):
    shapes = {"bf16": ((6, 5), jnp.bfloat16), "zeros": ((9,), jnp.float32), "zeros_bf16": ((4,), jnp.bfloat16),
              "tiny": ((3,), jnp.float32)}
    rng = np.random.default_rng(4)
    g = {"bf16": rng.normal(size=(N, 6, 5)).astype(jnp.bfloat16), "zeros": np.zeros((N, 9), np.float32),
         "zeros_bf16": np.zeros((N, 4), jnp.bfloat16), "tiny": np.full((N, 3), 1e-40, np.float32)}  # subnormal
    tx = cj.e3m0(axis_name=AXIS)
    state = init_stacked(tx, {k: jnp.zeros(s, d) for k, (s, d) in shapes.items()}, N)
    out, state = jax.tree.map(np.asarray, jax.block_until_ready(per_worker(tx, mesh)(*put((g, state), mesh))))
    for k, (s, d) in shapes.items():
        assert out[k].dtype == jnp.dtype(d) and out[k].shape == (N, *s), k
        assert state.residual[k].dtype == jnp.dtype(d), k
        assert np.all(np.isfinite(out[k].astype(np.float32))), k
        assert np.all(np.isfinite(state.residual[k].astype(np.float32))), k
    for k in ("zeros", "zeros_bf16", "tiny"):
        np.testing.assert_array_equal(out[k].astype(np.float32), 0.0)
    dec = np.stack([np_decode(*np_encode(g["bf16"][w].astype(np.float32)), (6, 5)) for w in range(N)])
    np.testing.assert_array_equal(out["bf16"], np.broadcast_to(dec.mean(0).astype(jnp.bfloat16), out["bf16"].shape))
    # The codec alone: scale 1 and code 0 for a leaf of zeros; no log2(0).
    for x in (jnp.zeros(7), jnp.zeros(7, jnp.bfloat16), jnp.full(3, 1e-40, jnp.float32)):
        codes, scales = encode(x)
        assert float(scales[0]) == 1.0 and not np.any(np.asarray(codes))
        assert np.all(roundtrip(x) == 0.0)
