"""Chunk-wise top-k with quantized values and packed tile-local indices (cj.chunktopk) against NumPy references.

The references are written from the reference code: tplr-ai/SparseLoCo ``src/tplr/sparseloco.py``
(``ChunkingTransform.encode``, ``TopKCompressor.compress``/``_quantize``/``_dequantize``/``batch_decompress``,
``SparseLoCo.step``) and bloc97/DeMo ``demo.py`` (``TransformDCT``, ``CompressDCT``), with the DCT from SciPy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.fft
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax.codecs import bitpack
from compjax.codecs import chunked as ck
from tests.helpers import AXIS, VOTE

SHAPES = {"w": (16, 24), "b": (24,), "c": (3, 5, 8), "s": ()}


def is_shape(x):
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


# --- NumPy references -------------------------------------------------------------------------------


def np_split(n, target):
    """``_get_smaller_split``: the divisor of n equal to target, else the one just below the first above it."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    for i, d in enumerate(divs):
        if d == target:
            return d
        if d > target:
            return d if i == 0 else divs[i - 1]
    return n


def np_view(shape):
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


def np_tile(x, chunk):
    """``rearrange(x, "(y h) (x w) -> y x (h w)")`` of the layer's matrix view; returns (tiles, h, w)."""
    r, c = np_view(x.shape)
    h, w = np_split(r, chunk), np_split(c, chunk)
    m = x.reshape(r // h, h, c // w, w).transpose(0, 2, 1, 3).reshape(-1, h * w)
    return m, h, w


def np_untile(t, shape, h, w):
    r, c = np_view(shape)
    return t.reshape(r // h, c // w, h, w).transpose(0, 2, 1, 3).reshape(shape)


def np_dct2(t, h, w, inverse=False):
    """Orthonormal 2-D DCT-II (or its inverse) of every tile, by SciPy."""
    m = t.reshape(-1, h, w).astype(np.float64)
    f = scipy.fft.idctn if inverse else scipy.fft.dctn
    return f(m, type=2, norm="ortho", axes=(1, 2)).reshape(t.shape)


def np_quantize(v, bits, range_sigmas):
    """``TopKCompressor._quantize`` then ``_dequantize``: the values the receiver decodes."""
    bins = 2**bits
    v = v.astype(np.float32)
    shift = v.mean(dtype=np.float32)
    c = v - shift
    std = np.linalg.norm(c) / np.sqrt(c.size - 1) if c.size > 1 else 0.0
    scale = np.float32(range_sigmas * std / bins)
    if scale == 0 or not np.isfinite(scale):
        scale = np.float32(1.0)
    q = np.clip(np.round(c / scale + bins // 2), 0, bins - 1).astype(int)
    lookup = np.array([c[q == b].mean() if np.any(q == b) else 0.0 for b in range(bins)], np.float32)
    return lookup[q] + shift


def np_encode(p, cfg):
    """One worker's layer: its (tiles, L) decoded values and indicators, and what it sent (layer shape)."""
    t, h, w = np_tile(np.asarray(p, np.float64), cfg["chunk"])
    if cfg["dct"]:
        t = np_dct2(t, h, w)
    n = t.shape[1]
    k = min(cfg["k"], n) if cfg["dct"] else min(n, max(1, round(n * cfg["k"] / cfg["chunk"] ** 2)))
    idx = np.argsort(-np.abs(t), axis=1, kind="stable")[:, :k]  # ties: the lowest index first
    vals = np.take_along_axis(t, idx, axis=1)
    if cfg["values"] == "statistical":
        vals = np_quantize(vals.ravel(), cfg["value_bits"], 6.0).reshape(vals.shape)
    elif cfg["values"] == "sign":
        vals = np.where(vals >= 0, 1.0, -1.0) * np.abs(vals).mean()
    dense, ind = np.zeros_like(t), np.zeros_like(t)
    np.put_along_axis(dense, idx, vals, axis=1)
    np.put_along_axis(ind, idx, 1.0, axis=1)
    back = np_dct2(dense, h, w, inverse=True) if cfg["dct"] else dense
    return dense, ind, np_untile(back, p.shape, h, w), (h, w)


def np_exchange(ps, acc, name, cfg):
    """One layer's exchange over the workers: each worker's accumulated ``ps[r]`` encoded (its accumulator
    ``acc[r][name]`` keeps what was not sent), then the per-tile aggregate (``(tiles, L)``) and the tile shape."""
    parts = []
    for r, p in enumerate(ps):
        dense, ind, sent, hw = np_encode(p, cfg)
        acc[r][name] = p - sent
        parts.append((dense, ind))
    total = sum(d for d, _ in parts)
    if cfg["aggregate"] == "senders":
        cnt = sum(i for _, i in parts)
        return np.where(cnt > 0, total / np.where(cnt > 0, cnt, 1), 0.0), hw
    return total / len(ps), hw


def np_chunktopk(grads, cfg, steps):
    """Per step: the aggregated output per layer (worker-independent) and every worker's accumulator."""
    n = len(grads[0])
    acc = [{k: np.zeros(s, np.float64) for k, s in SHAPES.items()} for _ in range(n)]
    outs = []
    for g in grads:
        out = {}
        for name, shape in SHAPES.items():
            mean, hw = np_exchange([cfg["decay"] * acc[r][name] + g[r][name] for r in range(n)], acc, name, cfg)
            if cfg["dct"]:
                mean = np_dct2(mean, *hw, inverse=True)
            out[name] = np_untile(mean, shape, *hw)
        outs.append(out)
    return outs, acc


def config(k, chunk, dct, values, value_bits, decay, aggregate):
    return {"k": k, "chunk": chunk, "dct": dct, "values": values, "value_bits": value_bits, "decay": decay,
            "aggregate": aggregate}


CONFIGS = {
    "sparseloco": config(5, 8, False, "statistical", 2, 0.9, "mean"),
    "3-bit, senders": config(12, 8, False, "statistical", 3, 1.0, "senders"),
    "demo": config(5, 8, True, "float32", 2, 0.8, "senders"),
    "dct, sign": config(3, 4, True, "sign", 2, 0.5, "mean"),
}


@pytest.mark.parametrize("name", [n if n in ("3-bit, senders", "dct, sign") 
                                  else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CONFIGS)])
def test_chunktopk_matches_the_numpy_reference_over_steps(name):
    cfg = CONFIGS[name]
    n, steps = 4, 3
    rng = np.random.default_rng(0)
    grads = [[{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]
             for _ in range(steps)]
    want, want_acc = np_chunktopk(grads, cfg, steps)
    tx = cj.chunktopk(cfg["k"], chunk=cfg["chunk"], dct=cfg["dct"], values=cfg["values"],
                      value_bits=cfg["value_bits"], decay=cfg["decay"], aggregate=cfg["aggregate"], axis_name=AXIS)
    state = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init({k: np.zeros(s, np.float32)
                                                                           for k, s in SHAPES.items()}))
    f = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    for t, g in enumerate(grads):
        out, state = f(jax.tree.map(lambda *xs: np.stack(xs), *g), state)
        for k in SHAPES:
            for r in range(n):
                np.testing.assert_allclose(np.asarray(out[k])[r], want[t][k], atol=1e-5, rtol=1e-5, err_msg=(t, k, r))
    for k in SHAPES:
        for r in range(n):
            np.testing.assert_allclose(np.asarray(state.accumulator[k])[r], want_acc[r][k], atol=1e-5, rtol=1e-5)


def test_nothing_is_lost_without_decay():
    """With β = 1, per worker: the sum of what it sent plus its accumulator is the sum of its gradients."""
    tx = cj.chunktopk(3, chunk=8, axis_name=None)
    rng = np.random.default_rng(1)
    g = [{"w": rng.normal(size=(16, 16)).astype(np.float32)} for _ in range(4)]
    state, sent = tx.init(g[0]), 0.0
    for x in g:
        out, state = tx.update(x, state)
        sent = sent + np.asarray(out["w"])
    np.testing.assert_allclose(sent + np.asarray(state.accumulator["w"]), sum(x["w"] for x in g), atol=1e-5)


# --- bytes on the wire -------------------------------------------------------------------------------


def test_payload_equals_the_audited_bytes_and_the_formula(mesh):
    """64 x 64 tiles, k = 128, 2-bit values: 12-bit indices + 2-bit codes = 1.75 bytes per kept entry."""
    shapes = {"w": (64, 128), "b": (128,)}
    tx = cj.chunktopk(128, chunk=64, axis_name=AXIS)
    n = mesh.shape[AXIS]
    params = {k: jnp.zeros(s) for k, s in shapes.items()}

    def body(g, s):
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s))
        return jax.tree.map(lambda x: x[None], (out, s))

    spec = P(AXIS)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))
    rng = np.random.default_rng(0)
    g = put({k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in shapes.items()})
    s = put(jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init(params)))
    ops = cj.audit_collectives(f, g, s)
    _, state = jax.block_until_ready(f(g, s))
    # w: 2 tiles x 128 = 256 entries: 12-bit indices in 256/4 + 256/8 = 96 words, 2-bit codes in 16 words,
    # shift + 4 lookup values; b: two tiles of 64 keeping round(64 * 128 / 4096) = 2 each: 6-bit indices
    # (fields of 4 + 2 bits: 1 + 1 words), 1 word of codes, 5 floats.
    w_bytes = 4 * (96 + 16 + 5)
    b_len = 64
    assert ck.chunk_layout((128,), 64).length == b_len
    b_bytes = 4 * (bitpack.num_words(2 * 2, 6) + bitpack.num_words(4, 2) + 5)
    assert w_bytes == 256 * 1.75 + 20
    want = w_bytes + b_bytes
    assert cj.chunktopk_bytes(shapes.values(), 128, chunk=64) == want
    assert np.all(cj.payload_bytes(state) == want + VOTE)
    assert sum(op.bytes for op in ops) == want + VOTE, [(o.op, o.dtype, o.bytes) for o in ops]


# --- the codec -----------------------------------------------------------------------------------------


def test_codec_tiles_dct_and_split_match_the_references():
    for n in (1, 7, 12, 64, 65, 67, 96, 128, 1000, 4096):
        for t in (1, 8, 64):
            assert ck.split_size(n, t) == np_split(n, t), (n, t)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 40)).astype(np.float32)
    lay = ck.chunk_layout(x.shape, 8)
    want, h, w = np_tile(x, 8)
    np.testing.assert_array_equal(np.asarray(ck.tile(jnp.asarray(x), lay)), want)
    np.testing.assert_array_equal(np.asarray(ck.untile(ck.tile(jnp.asarray(x), lay), lay)), x)
    np.testing.assert_allclose(np.asarray(ck.dct_tiles(jnp.asarray(want), lay)), np_dct2(want, h, w), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ck.idct_tiles(ck.dct_tiles(jnp.asarray(want), lay), lay)), want, atol=1e-5)
    assert ck.index_bits(4096) == 12 and ck.index_bits(64) == 6 and ck.index_bits(1) == 0


# --- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"chunk": 0}, "chunk"), ({"chunk": 2.5}, "chunk"), ({"chunk": "64"}, "chunk"),
    ({"k": 0}, "k must"), ({"k": 4097}, r"k must be an integer in \[1, 4096\]"), ({"k": 1.5}, "k must"),
    ({"decay": -0.1}, "decay"), ({"decay": 1.5}, "decay"), ({"decay": 0.5, "error_feedback": False}, "decay"),
    ({"values": "twobit"}, "values='twobit' cannot quantize the kept values"),
    ({"values": "terngrad"}, "values='terngrad' cannot"), ({"values": "int4"}, "values must be one of"),
    ({"value_bits": 9}, "value_bits"), ({"value_bits": 0}, "value_bits"),
    ({"range_sigmas": 0.0}, "range_sigmas"), ({"aggregate": "sum"}, "aggregate"),
])
def test_bad_input_names_the_parameter(kwargs, match):
    args = {"k": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        cj.chunktopk(args.pop("k"), **args)
