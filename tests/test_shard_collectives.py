"""Compressors on shards: in a sharded step (parameters sharded over the fast axis of a 2 x 4 mesh, ``specs=``), the
collectives a compressor issues over the fast axis carry per-shard candidates or per-layer statistics, never a layer.

The audit reads the compiled step (``cj.audit_collectives``): every collective that runs over the fast axis alone and
was traced inside the compressor's scope (``cj.topk/...``) must carry less than a quarter of the smallest sharded
leaf's shard.  Gathering a layer's shards (what the pipeline does for a compressor that does not work on shards)
puts a whole shard into one all-gather and fails this.  The leaves here are large enough for the paths that the
battery's small model does not reach (top-k's threshold selection, chunk top-k's tiles inside shards), so the same
run checks the sharded layout against the replicated 2-D layout too (1e-6, equal ``payload_bytes``); every registry
case's exactness is tests/test_battery_sharded.py's; the last test here runs every registry case again with leaves
that 4 does not divide, stored padded (``parallel.Padded``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import CASES

import compjax as cj
from compjax import parallel
from tests.helpers import assert_same_params, replicated_and_sharded

SLOW, FAST = 2, 4

#: The compressors that work on their shards, and the scope their collectives carry in the program.
CONVERTED = {
    "topk": (lambda: cj.topk(0.01, axis_name="data"), "cj.topk"),
    # 16 x 16 tiles: w1's column shards and w2's row shards hold whole tiles.
    "chunktopk": (lambda: cj.chunktopk(8, chunk=16, decay=0.9, axis_name="data"), "cj.chunktopk"),
    "powersgd": (lambda: cj.powersgd(2, axis_name="data"), "cj.powersgd"),
    "powersgd_rank1_start": (lambda: cj.powersgd(1, start_step=1, warm_start=False, axis_name="data"),
                             "cj.powersgd"),
    "dgc": (lambda: cj.dgc(0.01, momentum=0.9, clip_norm=0.5, key=3, axis_name="data"), "cj.dgc"),
    "dgc_exact_dense_vectors": (lambda: cj.dgc(0.02, sample_ratio=None, sparsify_vectors=False, clip_norm=0.5,
                                               axis_name="data"), "cj.dgc"),
    "onebit": (lambda: cj.onebit(axis_name="data"), "cj.onebit"),
    "identity": (lambda: cj.identity(axis_name="data"), "cj.identity"),
    "cast_bf16": (lambda: cj.cast("bfloat16", axis_name="data"), "cj.cast"),
    "cast_f16": (lambda: cj.cast("float16", axis_name="data"), "cj.cast"),
    "twobit": (lambda: cj.twobit(0.01, axis_name="data"), "cj.twobit"),
    "signsgd": (lambda: cj.signsgd(axis_name="data"), "cj.signsgd"),
    "e3m0": (lambda: cj.e3m0(axis_name="data"), "cj.e3m0"),
    "terngrad": (lambda: cj.terngrad(key=3, axis_name="data"), "cj.terngrad"),
    "qsgd": (lambda: cj.qsgd(16, key=3, axis_name="data"), "cj.qsgd"),
    "randomk": (lambda: cj.randomk(0.01, key=3, axis_name="data"), "cj.randomk"),
    "randomk_unbiased": (lambda: cj.randomk(0.01, key=3, error_feedback=False, axis_name="data"), "cj.randomk"),
    "delayed_averaging_topk": (lambda: cj.delayed_averaging(1, compressor=cj.topk(0.01, axis_name="data"),
                                                            axis_name="data"), "cj.delayed_averaging"),
    "delayed_averaging_period": (lambda: cj.delayed_averaging(1, period=2, axis_name="data"), "cj.delayed_averaging"),
    "chunktopk_dct_senders": (lambda: cj.chunktopk(4, chunk=16, dct=True, values="float32", aggregate="senders",
                                                   axis_name="data"), "cj.chunktopk"),
}


def loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _params():
    rng = np.random.default_rng(0)
    # w1 sharded along its columns, w2 along its rows (fsdp_specs: the largest divisible dimension), b1 whole.
    return {"w1": jnp.asarray(rng.normal(size=(64, 256)) * 0.1, jnp.float32), "b1": jnp.zeros(256),
            "w2": jnp.asarray(rng.normal(size=(256, 32)) * 0.1, jnp.float32), "b2": jnp.zeros(32)}


def _run(tx, steps=3, loss_fn=None, tol=1e-6):
    """``steps`` steps of the sharded layout and of the replicated 2-D layout; the sharded compiled step's audit."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1024)
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(32, 64)).astype(np.float32), rng.normal(size=(32, 32)).astype(np.float32))
               for _ in range(steps)]
    (rp, rs), (sp, ss), sharded = replicated_and_sharded(loss if loss_fn is None else loss_fn, tx, init, specs,
                                                         batches, mesh)
    assert_same_params(sp, rp, FAST, tol=tol)
    np.testing.assert_array_equal(np.asarray(cj.payload_bytes(ss)), np.asarray(cj.payload_bytes(rs)))  # one entry per host in both layouts
    shard_bytes = [int(np.prod(v.shape)) * 4 // FAST for k, v in init.items() if specs[k] != jax.P()]
    return cj.audit_collectives(sharded), mesh, shard_bytes


# The two layouts reduce the float32 gradient in different orders (XLA's partitioner in the sharded step), so an
# entry may differ in its last bit and round to the neighbouring 16-bit value: one ulp of the cast, times the
# learning rate 0.1 (seen: 3e-6 on 6 of 32,768 entries for bfloat16). Any real error in the shard math is far larger.
LOSSY_CAST_TOL = {"cast_bf16": 1e-5, "cast_f16": 1e-5}

# The fast tier keeps one compressor of each kind of shard math (candidates, tiles, factors, column statistics,
# random draws, a dense piece); the others run in the full tier (--all), as does the sharded battery.
FAST_CASES = {"topk", "chunktopk", "powersgd", "onebit", "qsgd", "identity"}


@pytest.mark.parametrize("name", [n if n in FAST_CASES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CONVERTED)])
def test_a_compressor_on_shards_sends_no_layer_over_the_fast_axis_and_equals_the_replicated_layout(name):
    make, scope = CONVERTED[name]
    tx = optax.chain(make(), optax.sgd(0.1))
    ops, mesh, shard_bytes = _run(tx, tol=LOSSY_CAST_TOL.get(name, 1e-6))
    assert min(shard_bytes) >= 8192  # the leaves are large enough for candidates to be far smaller than a shard
    # Per operand: XLA may combine the compressor's small all-reduces with the model's into one instruction.
    mine = [(op.op, _operand_bytes(dtype, shape), where) for op in ops if cj.accounting.collective_axes(op, mesh) == ("fast",)
            for (dtype, shape), where in zip(op.operands, op.scopes) if f"{scope}/" in where]
    assert mine, "the audit finds the compressor's fast-axis collectives (the host's vote at least)"
    big = [m for m in mine if m[1] * 4 > min(shard_bytes)]
    assert not big, f"{name} moves shards of layers over the fast axis: {big}"


def _operand_bytes(dtype: str, shape: tuple) -> int:
    """Bytes of one HLO operand (``"f32"``, ``"u16"``, ``"s32"``, ``"pred"``...)."""
    bits = 8 if dtype == "pred" else int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
    return int(np.prod(shape, dtype=np.int64)) * bits // 8


@pytest.mark.parametrize("name", ["topk", pytest.param("dgc_exact_dense_vectors", marks=pytest.mark.slow)])
def test_top_k_on_shards_breaks_ties_as_the_whole_layer_does(name):
    """Gradients of a few distinct magnitudes: most of a layer's top-k is decided by the lowest index among
    equal magnitudes, across shards cut along the columns (w1) and along the rows (w2)."""
    rng = np.random.default_rng(2)
    consts = {k: jnp.asarray(rng.integers(-2, 3, size=v.shape), jnp.float32) for k, v in _params().items()}

    def tied(p, batch):
        return sum(jnp.sum(p[k] * c) for k, c in consts.items()) + 0.0 * jnp.sum(batch[0])

    make, _ = CONVERTED[name]
    _run(optax.chain(make(), optax.sgd(0.1)), steps=2, loss_fn=tied)


def test_dense_mean_on_shards_with_capped_buckets_equals_the_replicated_layout(monkeypatch):
    """Buckets of 8 KiB: w2's shard (8 KiB) in an all-reduce of its own, w1's (16 KiB, above the cap) in two slices
    of 8 KiB written back in place, one all-reduce each: the same bytes and numbers."""
    from compjax import collectives

    monkeypatch.setattr(collectives, "BUCKET_CAP_BYTES", 8192)
    ops, mesh, shard_bytes = _run(optax.chain(cj.identity(axis_name="data"), optax.sgd(0.1)))
    assert sorted(shard_bytes) == [8192, 16384]
    per_op = [[_operand_bytes(dtype, shape) for (dtype, shape), where in zip(op.operands, op.scopes)
               if "dense_mean" in where] for op in ops
              if op.op == "all-reduce" and cj.accounting.collective_axes(op, mesh) == ("data",)]
    slow = sorted(b for op in per_op for b in op)
    # w2's shard, w1's shard in two slices, the piece of the whole leaves (b1, b2: 288 floats / 4 devices); no
    # buffer above the cap.
    assert slow == [72 * 4, 8192, 8192, 8192], slow
    # Each in an all-reduce of its own, one after the other: XLA did not combine them into one instruction
    # (whose operands and results would all be alive at once).
    assert sorted(len(op) for op in per_op if op) == [1, 1, 1, 1], per_op


# --- leaves the fast size does not divide, stored padded -------------------------------------------------------------

def _padded_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] + p["s"] - y) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_registry_case_with_padded_leaves_equals_the_replicated_2d_layout(name):
    """A (6, 10) kernel, a (10,) bias and a (10, 3) kernel, no dimension of which 4 divides, stored padded to
    (6, 12), (12,) and (12, 3) and sharded (``fsdp_specs(..., pad_min_size=8)``); b2 (3 entries) and a scalar stay
    whole.  Five steps equal the replicated 2-D layout (1e-6), ``payload_bytes`` included (the compressors count the
    logical entries only), the padding stays zero in the parameters and the state, and the slow link carries the
    host's payload once (the same audit as tests/test_battery_sharded.py)."""
    case = CASES[name]
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rng = np.random.default_rng(0)
    init = {"w1": jnp.asarray(rng.normal(size=(6, 10)) * 0.3, jnp.float32), "b1": jnp.zeros(10),
            "w2": jnp.asarray(rng.normal(size=(10, 3)) * 0.3, jnp.float32), "b2": jnp.zeros(3), "s": jnp.zeros(())}
    batches = [(rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 3)).astype(np.float32))
               for _ in range(5)]
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    assert all(isinstance(specs[k], parallel.Padded) for k in ("w1", "b1", "w2")), specs
    assert [specs[k] for k in ("b2", "s")] == [jax.P(), jax.P()]
    tx = optax.chain(case.make(axis_name="data"), optax.sgd(0.1))

    (rp, rs), (sp, ss), sharded = replicated_and_sharded(_padded_loss, tx, init, specs, batches, mesh)
    assert sp["w1"].shape == (SLOW, 6, 12) and sp["w1"].addressable_shards[0].data.shape == (1, 6, 3)
    got, want = parallel.gather(sp, specs=specs), parallel.gather(rp)
    tol = LOSSY_CAST_TOL.get(name, 1e-6)
    for k in want:
        assert got[k].shape == (SLOW,) + tuple(init[k].shape), k
        np.testing.assert_allclose(got[k], want[k][::FAST], rtol=tol, atol=tol, err_msg=k)
    sent = np.asarray(cj.payload_bytes(ss))
    np.testing.assert_array_equal(sent, np.asarray(cj.payload_bytes(rs)))

    # The padding is zeros, in the parameters and in every padded leaf of the state.
    sspecs = parallel.state_specs(tx, init, specs, mesh)
    stored = jax.tree.leaves((sp, ss))
    entries = jax.tree.leaves((specs, sspecs), is_leaf=lambda x: isinstance(x, (jax.P, parallel.Padded)))
    padded = [(x, e) for x, e in zip(stored, entries) if isinstance(e, parallel.Padded)]
    assert len(padded) >= 3
    for x, e in padded:
        cut = (slice(None),) * (1 + e.dim) + (slice(e.shape[e.dim], None),)
        assert x.shape[1:] == e.padded_shape and not np.any(np.asarray(x)[cut]), e

    ops = cj.audit_collectives(sharded)
    counted = cj.accounting.bytes_by_axes(ops, mesh, "compjax")
    assert set(counted) <= {("data",)}, counted
    if not case.one_path:
        assert counted.get(("data",), 0) * FAST == int(sent[0])
    inside = [op for op in ops if cj.accounting.collective_axes(op, mesh) == ("fast",)]
    assert all(op.issuer in ("compjax", "compjax-uncounted") for op in inside), \
        [(op.op, op.bytes, op.scopes) for op in inside if op.issuer not in ("compjax", "compjax-uncounted")]
