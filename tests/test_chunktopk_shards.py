"""Chunk top-k on the shards of stacked 3-D leaves: the tiles lie inside the shards, no layer is gathered.

The leaves are shaped like a language model's blocks stacked over its layers (``(layers, rows, cols)``, as the
memory benchmark's model holds them) and sharded over the fast axis of a 2 x 4 mesh along their largest dimension
(``parallel.fsdp_specs``): ``up`` ``(2, 64, 256)`` along its columns, ``down`` ``(2, 256, 64)`` and ``mix``
``(2, 64, 64)`` (a tie: the first of the largest) along their middle dimension, so each shard holds, for each layer,
a block of whole tile rows that is not contiguous in the layer.  With 16 x 16 tiles every shard holds whole tiles,
so the exchange runs on the shards: the compiled sharded step has no all-gather over the fast axis, inside the
compressor, of a shard's size or more (gathering a layer moves four shards; the host's packed payload is a few
percent of a shard), and it equals the replicated 2-D layout (1e-6, equal ``payload_bytes``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import collectives, layout, parallel
from compjax.codecs import chunked as ck
from tests.helpers import assert_same_params, replicated_and_sharded

SLOW, FAST = 2, 4

SHAPES = {"up": (2, 64, 256), "down": (2, 256, 64), "mix": (2, 64, 64)}


def loss(p, batch):
    x, y = batch
    for layer in range(2):
        h = jnp.tanh(x @ p["up"][layer])
        x = x + jnp.tanh(h @ p["down"][layer]) @ p["mix"][layer]
    return jnp.mean((x - y) ** 2)


def _run(tx, scope):
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rng = np.random.default_rng(0)
    init = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for k, s in SHAPES.items()}
    specs = parallel.fsdp_specs(init, mesh)
    assert specs == {"up": jax.P(None, None, "fast"), "down": jax.P(None, "fast", None),
                     "mix": jax.P(None, "fast", None)}
    batches = [(rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(16, 64)).astype(np.float32))
               for _ in range(3)]
    (rp, rs), (sp, ss), sharded = replicated_and_sharded(loss, tx, init, specs, batches, mesh)
    assert_same_params(sp, rp, FAST)
    np.testing.assert_array_equal(np.asarray(cj.payload_bytes(ss)), np.asarray(cj.payload_bytes(rs)))
    smallest = min(int(np.prod(s)) * 4 // FAST for s in SHAPES.values())
    ops = cj.audit_collectives(sharded)
    mine = [op for op in ops if cj.accounting.collective_axes(op, mesh) == ("fast",)
            and any(f"{scope}/" in s for s in op.scopes)]
    assert mine, "the audit finds the compressor's fast-axis collectives (its tiles' payload inside the host)"
    gathers = [(op.op, op.bytes, op.scopes) for op in mine if op.op == "all-gather" and op.bytes >= smallest]
    assert not gathers, f"a layer gathered over the fast axis: {gathers}"


def test_chunktopk_tiles_stacked_leaves_inside_their_shards():
    """SparseLoCo's chunk top-k: 2-bit statistical values, decayed error feedback, averaged over the senders."""
    tx = optax.chain(cj.chunktopk(8, chunk=16, decay=0.9, aggregate="senders", axis_name="data"),
                     optax.sgd(0.1))
    _run(tx, "cj.chunktopk")


def test_the_hosts_payload_lists_the_tiles_in_the_layers_order():
    """Each device sends its shard's tiles; joined over the fast axis they are the whole layer's payload (what one
    worker's replicated layout sends: the same packed indices and codes, bit for bit, and the quantizer's
    parameters to float rounding), so a sharded host and a replicated one read each other's messages."""
    rng = np.random.default_rng(3)
    whole = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in SHAPES.values()]
    dims = [2, 1, 1]
    tx = cj.chunktopk(8, chunk=16, decay=0.9, skip_nonfinite=False)

    def payload(gs):
        with collectives.capture() as cap:
            tx.update(gs, tx.init(gs))
        return cap.arrays

    want = jax.jit(payload)(whole)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:FAST]), ("fast",))

    def on_shards(*gs):
        with layout.fast_layout("fast", list(gs), dims):
            return tuple(payload(list(gs)))

    specs = tuple(jax.P(*([None] * d + ["fast"])) for d in dims)
    got = jax.jit(jax.shard_map(on_shards, mesh=mesh, in_specs=specs, out_specs=jax.P(),
                                  check_vma=False))(*whole)
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # the uint32 words
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("workers", [1, 3, 8, 3000])
def test_packed_sender_counts_read_back_exactly_after_the_mean(workers):
    """Each worker's packed indicator (base workers + 1 digits), summed in float32 one worker at a time and divided by
    the number of workers (as gathered_mean does), reads back as the exact per-entry count of senders."""
    lay = ck.chunk_layout((2, 12, 40), 8)  # 8 x 8 tiles; 40 columns are not a multiple of every packing width
    digits = ck.count_digits(workers)
    assert digits.base ** digits.per <= 2**22 < digits.base ** (digits.per + 1)
    rng = np.random.default_rng(workers)
    drawn = min(workers, 6)  # the others send nothing: their indicators are zeros
    total = jnp.zeros((lay.rows, -(-lay.cols // digits.per)), jnp.float32)
    want = np.zeros((lay.rows, lay.cols), np.int64)
    for _ in range(drawn):
        idx = np.stack([rng.choice(lay.length, 20, replace=False) for _ in range(lay.tiles)]).astype(np.int32)
        total = total + ck.sent_digits(jnp.asarray(idx), lay, digits)
        want += np.asarray(ck.untile(ck.scatter_rows(jnp.asarray(idx), jnp.ones(idx.shape), lay.length), lay)
                           ).reshape(lay.rows, lay.cols).astype(np.int64)
    got = ck.count_senders(total / workers, lay, digits)
    assert got.shape == lay.shape and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got).reshape(lay.rows, lay.cols), want)


def test_scatter_layer_equals_the_tiled_scatter_untiled_and_subtracts_in_place():
    lay = ck.chunk_layout((3, 8, 12), 4)
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.stack([rng.choice(lay.length, 5, replace=False) for _ in range(lay.tiles)]), jnp.int32)
    val = jnp.asarray(rng.normal(size=idx.shape), jnp.float32)
    dense = ck.untile(ck.scatter_rows(idx, val, lay.length), lay)
    np.testing.assert_array_equal(np.asarray(ck.scatter_layer(idx, val, lay)), np.asarray(dense))
    e = jnp.asarray(rng.normal(size=lay.shape), jnp.float32)
    np.testing.assert_array_equal(np.asarray(ck.scatter_layer(idx, val, lay, into=e, sign=-1.0)),
                                  np.asarray(e - dense))
