"""The sharded layout gathers parameters layer by layer: a model whose blocks run under ``jax.lax.scan`` over stacked
per-layer parameters, sharded over the fast axis of a 2 x 4 mesh (``specs=``), is never gathered whole.

The audit reads the compiled step (``cj.audit_collectives``): no all-gather over the fast axis has a result larger
than one layer of the largest stacked leaf (its operand, one device's piece, times the fast size), so nothing
gathers a whole stacked leaf before the loss; the collectives compjax counts still carry, summed over a host's
devices, ``payload_bytes`` per worker; and the step equals the replicated 2-D layout (1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from tests.helpers import assert_same_params, replicated_and_sharded

SLOW, FAST = 2, 4
LAYERS, D, IN, OUT = 4, 64, 8, 4


def _params():
    rng = np.random.default_rng(0)
    return {"w_in": jnp.asarray(rng.normal(size=(IN, D)) * 0.3, jnp.float32),
            "w": jnp.asarray(rng.normal(size=(LAYERS, D, D)) / np.sqrt(D), jnp.float32),
            "b": jnp.zeros((LAYERS, D)),
            "w_out": jnp.asarray(rng.normal(size=(D, OUT)) * 0.3, jnp.float32)}


def _loss(remat):
    def block(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    def loss(p, batch):
        x, y = batch
        h, _ = jax.lax.scan(jax.checkpoint(block) if remat else block, x @ p["w_in"], {"w": p["w"], "b": p["b"]})
        return jnp.mean((h @ p["w_out"] - y) ** 2)

    return loss


@pytest.mark.parametrize("remat", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["remat", "saved"])
def test_a_scanned_model_is_gathered_one_layer_at_a_time_and_sends_its_payload(remat):
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1024)
    assert specs["w"] == jax.P(None, "fast", None)  # the stacked leaf is sharded inside each layer
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(32, IN)).astype(np.float32), rng.normal(size=(32, OUT)).astype(np.float32))
               for _ in range(1)]
    tx = optax.chain(cj.topk(0.05, axis_name="data"), optax.sgd(0.1))
    (rp, rs), (sp, ss), sharded = replicated_and_sharded(_loss(remat), tx, init, specs, batches, mesh)
    assert_same_params(sp, rp, FAST)
    np.testing.assert_array_equal(np.asarray(cj.payload_bytes(ss)), np.asarray(cj.payload_bytes(rs)))

    ops = cj.audit_collectives(sharded)
    layer = D * D * 4  # bytes of one layer of the largest stacked leaf
    gathers = [op for op in ops if op.op == "all-gather" and cj.accounting.collective_axes(op, mesh) == ("fast",)]
    assert gathers, cj.format_collectives(ops)
    too_big = [(op.name, op.bytes * FAST) for op in gathers if op.bytes * FAST > layer]
    assert not too_big, f"all-gathers over the fast axis larger than one layer ({layer} B): {too_big}"
    sent = int(cj.payload_bytes(ss)[0])
    assert sent > 0 and cj.worker_bytes(ops, mesh) == sent


def test_a_batch_the_fast_axis_does_not_divide_per_worker_is_refused_by_name():
    """Each fast device's chunk of a worker's rows must be whole: 12 rows over 2 workers leave 6, not a multiple of 4."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = {"w": jnp.ones((IN, OUT))}
    specs = parallel.fsdp_specs(init, mesh, min_size=1)
    tx = optax.chain(cj.topk(0.25, axis_name="data"), optax.sgd(0.1))
    p, s = parallel.replicate(init, mesh, specs=specs), parallel.init_worker_state(tx, init, mesh, specs=specs)
    step = parallel.data_parallel_step(lambda q, b: jnp.mean(b @ q["w"]), tx, mesh, specs=specs)
    with pytest.raises(ValueError, match=r"6 rows per worker, not divisible by the 4 devices.*fast_axis='fast'"):
        step(p, s, parallel.shard_batch(np.ones((12, IN), np.float32), mesh))
