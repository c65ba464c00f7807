"""Random draws on a 2-D (slow x fast) mesh: every device draws its own numbers.

``data_parallel_step(rng=True)`` documents that it passes ``loss_fn`` ``jax.random.fold_in(key, i)`` with ``i`` the
worker index over all worker axes (on a 2-D mesh: both, ``i = host * fast + device``), with parameters replicated or
sharded (``specs=``); ``nnx_data_parallel_step(fast_axis=)`` folds the device's index into the model's RNG streams
(``worker_rngs``): the devices of one host must not share a dropout mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS

SLOW, FAST = 2, 4
D = SLOW * FAST
MASK = 64  # entries per drawn mask: two devices draw the same mask with probability 2**-64


def _params():
    return {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32), "b": jnp.zeros(4)}


def _loss(p, batch, key):
    """A loss that draws: a dropout-like mask on the inputs; the mask and a uniform draw come back as aux."""
    x, y = batch
    mask = jax.random.bernoulli(key, 0.5, (MASK,))
    u = jax.random.uniform(jax.random.fold_in(key, 1))
    keep = mask[: x.shape[1]].astype(x.dtype)
    loss = jnp.mean(((x * keep) @ p["w"] + p["b"] - y) ** 2)
    return loss, (mask, u)


def _expected(key):
    """Per device ``i`` (host-major, the order of the step's per-device outputs): the draws of ``fold_in(key, i)``."""
    keys = [jax.random.fold_in(key, i) for i in range(D)]
    return (np.stack([np.asarray(jax.random.bernoulli(k, 0.5, (MASK,))) for k in keys]),
            np.array([float(jax.random.uniform(jax.random.fold_in(k, 1))) for k in keys]))


@pytest.mark.parametrize("key_kind", ["typed", "raw"])
@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_every_device_of_a_2d_mesh_draws_from_its_own_folded_key(layout, key_kind):
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = _params()
    tx = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    if layout == "sharded":
        specs = parallel.fsdp_specs(params, mesh, min_size=1)
        p = parallel.replicate(params, mesh, specs=specs)
        s = parallel.init_worker_state(tx, params, mesh, specs=specs)
        kw = {"specs": specs}
    else:
        p = parallel.replicate(params, mesh, fast_axis="fast")
        s = parallel.init_worker_state(tx, params, mesh, fast_axis="fast")
        kw = {"fast_axis": "fast"}
    step = parallel.data_parallel_step(_loss, tx, mesh, has_aux=True, rng=True, **kw)
    rng = np.random.default_rng(1)
    row = rng.normal(size=(1, 8)).astype(np.float32)  # the same rows on every device: only the keys tell them apart
    batch = parallel.shard_batch((np.repeat(row, 2 * D, 0), np.zeros((2 * D, 4), np.float32)), mesh, fast_axis="fast")
    key = jax.random.key(7) if key_kind == "typed" else jax.random.PRNGKey(7)
    _, _, loss, (masks, draws) = step(p, s, batch, key)
    want_masks, want_draws = _expected(key)
    np.testing.assert_array_equal(np.asarray(masks).reshape(D, MASK), want_masks)
    np.testing.assert_allclose(np.asarray(draws).reshape(D), want_draws, rtol=0)
    per_host = np.asarray(masks).reshape(SLOW, FAST, MASK)
    for h in range(SLOW):  # the devices of one host draw different masks
        assert len({m.tobytes() for m in per_host[h]}) == FAST
    assert len(set(np.round(np.asarray(loss), 6))) > 1  # and so their losses differ on identical data


class Dropped(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.lin(self.drop(x))


def _nnx_masks(sharded, worker_rngs, steps=2):
    """Each step's dropout masks of ``Dropped`` on a 2 x 4 mesh, identical data on every device: (steps, D, MASK)."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    model = Dropped(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(cj.identity(AXIS), optax.sgd(0.1)), wrt=nnx.Param)
    specs = parallel.fsdp_specs(nnx.state(model), mesh, min_size=1) if sharded else None
    parallel.nnx_replicate(mesh, model, optimizer, specs=specs)

    def loss_fn(m, batch):
        x, y = batch
        mask = m.drop(jnp.ones(MASK)) != 0
        return jnp.mean((m(x) - y) ** 2), mask

    step = parallel.nnx_data_parallel_step(loss_fn, mesh, fast_axis="fast", has_aux=True, worker_rngs=worker_rngs)
    row = np.random.default_rng(2).normal(size=(1, 8)).astype(np.float32)
    batch = (jnp.asarray(np.repeat(row, 2 * D, 0)), jnp.zeros((2 * D, 4)))
    return np.stack([np.asarray(step(model, optimizer, batch)[1]).reshape(D, MASK) for _ in range(steps)])


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_nnx_2d_step_gives_every_device_its_own_dropout_mask(sharded):
    masks = _nnx_masks(sharded, worker_rngs=True)
    for t in range(len(masks)):
        for h in range(SLOW):  # within each host, every fast device its own mask
            assert len({m.tobytes() for m in masks[t].reshape(SLOW, FAST, MASK)[h]}) == FAST, (t, h)
        assert len({m.tobytes() for m in masks[t]}) == D  # and across hosts
        assert 0 < masks[t].mean() < 1
    assert not np.array_equal(masks[0], masks[1])  # the streams advance from step to step
    same = _nnx_masks(sharded, worker_rngs=False, steps=1)[0]  # control: without folding, one mask for all
    assert len({m.tobytes() for m in same}) == 1
