"""The shared battery's sharded case: every registered compressor and algorithm on a 2 x 4 mesh with parameters sharded over the
fast axis (``specs=``) equals the replicated 2-D layout, and its slow-link bytes are the
host's payload once.

Leaves: ``w1`` sharded along its columns, ``b1`` along its one dimension, ``w2`` along its rows, ``b2`` of size 3
(4 does not divide it: kept whole) and a scalar ``s`` (whole).  Five steps of each layout from the same batches;
parameters and ``payload_bytes`` must agree (1e-6).  In the compiled sharded step (the very program that ran:
``audit_collectives`` of the compiled executable), the collectives compjax counts run over the slow axis only and,
summed over one host's four devices, equal ``payload_bytes`` per worker (for transforms whose program has one path:
the others' programs also hold the collectives of the steps they do not take); over the fast axis there are only
the collectives compjax's layout issues (labelled ``compjax-uncounted``: the parameters all-gathered where the loss uses
them and their gradients reduced, which XLA's partitioner inserts) and the compressors' own (candidates, statistics,
the host's non-finite vote).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from registry import CASES

import compjax as cj
from compjax import parallel
from tests.helpers import assert_same_params, battery_problem, replicated_and_sharded

pytestmark = pytest.mark.slow  # the full tier only (--all): every case on a 2 x 4 mesh, sharded

SLOW, FAST = 2, 4


def loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] + p["s"] - y) ** 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_layout_equals_the_replicated_2d_layout_and_sends_the_payload_once_per_host(name):
    case = CASES[name]
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init, batches = battery_problem()
    specs = parallel.fsdp_specs(init, mesh, min_size=1)
    assert [specs[k] for k in ("b2", "s")] == [jax.P(), jax.P()] and all(specs[k] != jax.P() for k in ("w1", "b1", "w2"))
    tx = optax.chain(case.make(axis_name="data"), optax.sgd(0.1))

    (rp, rs), (sp, ss), sharded = replicated_and_sharded(loss, tx, init, specs, batches, mesh)
    assert_same_params(sp, rp, FAST)
    assert sp["w1"].addressable_shards[0].data.shape == (1, 6, 16 // FAST)
    sent = np.asarray(cj.payload_bytes(ss))
    np.testing.assert_array_equal(sent, np.asarray(cj.payload_bytes(rs)))  # one entry per host in both layouts

    ops = cj.audit_collectives(sharded)
    counted = cj.accounting.bytes_by_axes(ops, mesh, "compjax")
    assert set(counted) <= {("data",)}, counted
    if not case.one_path:  # one path: the program's collectives are exactly this step's (else: every branch's)
        assert counted.get(("data",), 0) * FAST == int(sent[0])
    inside = [op for op in ops if cj.accounting.collective_axes(op, mesh) == ("fast",)]
    assert all(op.issuer in ("compjax", "compjax-uncounted") for op in inside), \
        [(op.op, op.bytes, op.scopes) for op in inside if op.issuer not in ("compjax", "compjax-uncounted")]
    assert "all-gather" in {op.op for op in inside}  # the parameters, gathered where the loss uses them
    assert all(cj.accounting.collective_axes(op, mesh) in (("data",), ("fast",)) for op in ops)
