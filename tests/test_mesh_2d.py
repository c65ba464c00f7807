"""The 2-D mesh (slow x fast) against the 1-D run over the slow axis, with a scalar parameter among the leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax as cj
from compjax import parallel

SLOW, FAST = 2, 4


def loss(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] + p["s"] - y) ** 2)


def test_scalar_parameter_is_averaged_over_the_fast_axis_like_every_leaf():
    """2 x 4 mesh, top-k over the slow axis, a shape-() float parameter ``s`` beside ``w`` and ``b``: after 3 steps
    every worker of a fast row holds the same values (bitwise), equal to the 2-worker 1-D run whose workers each
    take their row's whole batch.  A fast-axis mean that passed a size-1 leaf by would leave each worker its own
    gradient of ``s``."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    tx = optax.chain(cj.topk(0.5, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    init = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3), "s": jnp.zeros(())}
    rng = np.random.default_rng(0)
    # Targets shifted per worker (4 rows each): every worker's gradient of s differs from its row's mean.
    shift = np.repeat(np.arange(SLOW * FAST, dtype=np.float32), 4)[:, None]
    batches = [(rng.normal(size=(32, 6)).astype(np.float32), (rng.normal(size=(32, 3)) + shift).astype(np.float32))
               for _ in range(3)]

    p = parallel.replicate(init, mesh, fast_axis="fast")
    s = parallel.init_worker_state(tx, init, mesh, fast_axis="fast")
    step = parallel.data_parallel_step(loss, tx, mesh, fast_axis="fast")
    for batch in batches:
        p, s, _ = jax.block_until_ready(step(p, s, parallel.shard_batch(batch, mesh, fast_axis="fast")))

    mesh1 = parallel.make_mesh(SLOW)
    p1, s1 = parallel.replicate(init, mesh1), parallel.init_worker_state(tx, init, mesh1)
    step1 = parallel.data_parallel_step(loss, tx, mesh1)
    for batch in batches:
        p1, s1, _ = jax.block_until_ready(step1(p1, s1, parallel.shard_batch(batch, mesh1)))

    got, want = parallel.gather(p), parallel.gather(p1)
    assert got["s"].shape == (SLOW * FAST,) and abs(float(want["s"][0])) > 0.1  # the scalar moved
    for k in init:
        for w in range(SLOW * FAST):  # worker w sits in row w // FAST
            np.testing.assert_array_equal(got[k][w], got[k][w // FAST * FAST], err_msg=f"{k}, worker {w}")
            np.testing.assert_allclose(got[k][w], want[k][w // FAST], rtol=1e-5, atol=1e-6, err_msg=f"{k}, worker {w}")
    # The audit tells the fast-axis mean (compjax's, no compressor's payload) from top-k's exchange, which
    # crosses the slow link once per host: each of a row's 4 devices sends a quarter of it.
    ops = cj.audit_collectives(step, p, s, parallel.shard_batch(batches[0], mesh, fast_axis="fast"))
    assert cj.accounting.bytes_by_issuer(ops)["other"] == 0
    payload = cj.accounting.bytes_by_axes(ops, mesh, "compjax")
    inside = cj.accounting.bytes_by_axes(ops, mesh, "compjax-uncounted")
    assert set(payload) == {("data",)} and payload[("data",)] * FAST == int(cj.payload_bytes(s)[0])
    assert set(inside) == {("fast",)} and inside[("fast",)] >= 4 * (6 * 3 + 3 + 1)  # the dense mean among them
