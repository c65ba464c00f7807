"""Sharded parameters with Flax NNX on a 2 x 4 mesh: ``nnx_replicate(specs=)`` and
``nnx_data_parallel_step(fast_axis=)`` against the pytree step's replicated 2-D layout, ``nnx.with_partitioning``
annotations with BatchNorm and dropout, and the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel

SLOW, FAST = 2, 4


class MLP(nnx.Module):
    def __init__(self, rngs, norm=False, kernel_init=None):
        self.l1 = nnx.Linear(12, 32, kernel_init=kernel_init or nnx.initializers.lecun_normal(), rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(0.3, rngs=rngs) if norm else None
        self.l2 = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.drop(self.bn(h))
        return self.l2(jax.nn.relu(h))


def loss_fn(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def batches(n=5, rows=32):
    rng = np.random.default_rng(0)
    return [(jnp.asarray(rng.normal(size=(rows, 12)), jnp.float32), jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32))
            for _ in range(n)]


@pytest.mark.parametrize("donate", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_nnx_sharded_steps_equal_the_pytree_steps_replicated_2d_layout_with_a_quarter_per_device(donate):
    mesh = parallel.make_2d_mesh(SLOW, FAST)

    def tx():
        return optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.05, momentum=0.9))  # scale-sensitive

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
    params0 = nnx.as_pure(params0)
    parallel.nnx_replicate(mesh, model, optimizer, specs=parallel.fsdp_specs(nnx.state(model), mesh, min_size=1))
    # Each device holds a quarter of every parameter and of the moments and residuals shaped like them.
    for x in jax.tree.leaves(nnx.state((model, optimizer))):
        if x.ndim >= 2 and x.size >= 12 * 32 * SLOW:
            assert x.addressable_shards[0].data.size * SLOW * FAST == x.size, x.sharding.spec
    step = parallel.nnx_data_parallel_step(loss_fn, mesh, fast_axis="fast", donate=donate)

    ref_tx = tx()
    params = parallel.replicate(params0, mesh, fast_axis="fast")
    state = parallel.init_worker_state(ref_tx, params0, mesh, fast_axis="fast")
    ref = parallel.data_parallel_step(lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b), ref_tx, mesh,
                                      fast_axis="fast")
    for batch in batches():
        loss = step(model, optimizer, batch)
        params, state, ref_loss = ref(params, state, parallel.shard_batch(batch, mesh, fast_axis="fast"))
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-6)
    got = nnx.as_pure(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a)[0], np.asarray(b)[0], atol=1e-6)
    assert int(cj.payload_bytes(optimizer)[0]) == int(cj.payload_bytes(state)[0]) > 0
    assert int(optimizer.step[0]) == 5 and step._cache_size() == 1


@pytest.mark.slow  # builds and trains two NNX layouts (about 9 s)
def test_with_partitioning_annotations_batchnorm_and_dropout_train_as_the_whole_layout():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    annotated = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "fast"))
    out = []
    for sharded in (False, True):
        with jax.set_mesh(mesh):  # flax places annotated Variables (and the optimizer's copies) when created
            model = MLP(nnx.Rngs(0), norm=True, kernel_init=annotated)
            optimizer = nnx.Optimizer(model, optax.chain(cj.powersgd(2, axis_name="data"), optax.sgd(0.1)),
                                      wrt=nnx.Param)
        specs = nnx.get_partition_spec(nnx.state(model)) if sharded else None
        parallel.nnx_replicate(mesh, model, optimizer, specs=specs)
        step = parallel.nnx_data_parallel_step(loss_fn, mesh, fast_axis="fast")
        losses = [np.asarray(step(model, optimizer, b)) for b in batches(3)]
        out.append((losses, nnx.as_pure(nnx.state(model, nnx.Not(nnx.RngKey)))))
    assert model.l1.kernel.sharding.spec == P("data", None, "fast")
    assert model.l2.kernel.sharding.spec == P("data")  # not annotated: whole
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-6)
    assert len(set(np.round(out[1][0][-1], 6))) == SLOW * FAST  # dropout masks and batches differ per device
    for a, b in zip(jax.tree.leaves(out[1][1]), jax.tree.leaves(out[0][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert np.abs(np.asarray(model.bn.mean[...])).max() > 0  # batch statistics moved (averaged over the host)


def test_bad_layouts_are_refused_with_the_leaf_named():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    model = MLP(nnx.Rngs(0), norm=True)
    optimizer = nnx.Optimizer(model, optax.chain(cj.identity("data"), optax.sgd(0.1)), wrt=nnx.Param)
    bad = jax.tree_util.tree_map_with_path(
        lambda path, s: P(None, "model") if jax.tree_util.keystr(path).startswith("['l1']['kernel']") else s,
        parallel.fsdp_specs(nnx.state(model), mesh, min_size=10**9))
    with pytest.raises(ValueError, match=r"\['l1'\]\['kernel'\].*'model'.*not an axis"):
        parallel.nnx_replicate(mesh, model, optimizer, specs=bad)
    step = parallel.nnx_data_parallel_step(loss_fn, mesh, fast_axis="fast")
    with pytest.raises(ValueError, match="not in the worker-stacked layout"):
        step(model, optimizer, batches(1)[0])
    specs = parallel.fsdp_specs(nnx.state(model), mesh, min_size=1)  # shards the batch statistics too
    parallel.nnx_replicate(mesh, model, optimizer, specs=specs)
    with pytest.raises(ValueError, match=r"bn.*sharded but not optimized"):
        step(model, optimizer, batches(1)[0])
    with pytest.raises(ValueError, match="fast_axis and axis_name must differ"):
        parallel.nnx_data_parallel_step(loss_fn, mesh, fast_axis="data")


def test_without_fast_axis_a_2d_mesh_takes_the_user_step_path_with_the_same_parameters():
    """``nnx_data_parallel_step`` on a slow x fast mesh without ``fast_axis``: worker_step's host path (the loss on
    each worker's logical arrays, sharded over the fast axis) gives the parameters of ``fast_axis="fast"``."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)

    def build(**kw):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.05)), wrt=nnx.Param)
        parallel.nnx_replicate(mesh, model, optimizer, specs=parallel.fsdp_specs(nnx.state(model), mesh, min_size=1))
        return model, optimizer, parallel.nnx_data_parallel_step(loss_fn, mesh, **kw)

    (m1, o1, s1), (m2, o2, s2) = build(), build(fast_axis="fast")
    for batch in batches(3):
        loss = s1(m1, o1, batch)
        s2(m2, o2, batch)
    assert np.asarray(loss).shape == (SLOW,)  # one loss per worker (host)
    for a, b in zip(jax.tree.leaves(nnx.state(m1, nnx.Param)), jax.tree.leaves(nnx.state(m2, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert int(cj.payload_bytes(o1)[0]) == int(cj.payload_bytes(o2)[0]) > 0
