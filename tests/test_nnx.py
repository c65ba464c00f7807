"""Data-parallel training of Flax NNX objects: nnx_replicate, nnx_data_parallel_step, nnx_unreplicate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)  # PowerSGD compresses this one at rank 2
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


COMPRESSORS = {
    "topk": lambda: cj.topk(0.25, axis_name=AXIS),  # error feedback on by default
    "powersgd": lambda: cj.powersgd(rank=2, axis_name=AXIS),
}


def make_tx(name):
    return optax.chain(COMPRESSORS[name](), optax.sgd(0.05, momentum=0.9))


def make_batch(mesh, n=64):
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (n, 16))
    y = jnp.tanh(x @ jax.random.normal(kw, (16, 4)))
    return parallel.shard_batch((x, y), mesh)


def replicated(mesh, name="topk"):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(name), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer)
    return model, optimizer


def leaves(node):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(node))]


def test_nnx_step_trains_and_keeps_workers_equal(mesh):
    model, optimizer = replicated(mesh)
    step = parallel.nnx_data_parallel_step(loss_fn, mesh)
    batch = make_batch(mesh)
    losses = [np.asarray(jax.block_until_ready(step(model, optimizer, batch))) for _ in range(10)]
    assert losses[0].shape == (mesh.shape[AXIS],) and losses[0].dtype == np.float32
    assert losses[-1].mean() < 0.7 * losses[0].mean()
    for x in leaves(model):  # every worker applied the same averaged update (residuals differ)
        assert x.shape[0] == mesh.shape[AXIS]
        np.testing.assert_array_equal(x, np.broadcast_to(x[:1], x.shape))
    assert int(np.asarray(optimizer.step[...])[0]) == 10


@pytest.mark.parametrize("name", ["topk", pytest.param("powersgd", marks=pytest.mark.slow)])
def test_nnx_payload_bytes_equal_audited_bytes(mesh, name):
    model, optimizer = replicated(mesh, name)
    step = parallel.nnx_data_parallel_step(loss_fn, mesh)
    batch = make_batch(mesh)
    ops = cj.audit_collectives(step, model, optimizer, batch)
    jax.block_until_ready(step(model, optimizer, batch))
    audited = sum(op.bytes for op in ops)
    for reported in (cj.payload_bytes(nnx.state(optimizer)), cj.payload_bytes(optimizer)):
        assert reported.shape == (mesh.shape[AXIS],) and reported.dtype == np.int64
        assert set(reported.tolist()) == {audited}
    assert audited > 0 and 2 <= len(ops) <= 4  # only the compressor's collectives and its vote


@pytest.mark.parametrize("name", ["topk", pytest.param("powersgd", marks=pytest.mark.slow)])
def test_nnx_step_matches_pure_data_parallel_step(mesh, name):
    model, optimizer = replicated(mesh, name)
    nnx_step = parallel.nnx_data_parallel_step(loss_fn, mesh)
    # The same model and compressor as pure pytrees, through data_parallel_step.
    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    init = nnx.to_pure_dict(state)
    tx = make_tx(name)
    params, opt_state = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    pure_step = parallel.data_parallel_step(lambda p, b: loss_fn(nnx.merge(graphdef, p), b), tx, mesh)
    batch = make_batch(mesh)
    for _ in range(3):
        nnx_loss = jax.block_until_ready(nnx_step(model, optimizer, batch))
        params, opt_state, pure_loss = jax.block_until_ready(pure_step(params, opt_state, batch))
        np.testing.assert_allclose(nnx_loss, pure_loss, rtol=1e-6, atol=1e-6)
    got = nnx.to_pure_dict(nnx.state(model))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, params)
    np.testing.assert_array_equal(cj.payload_bytes(optimizer), cj.payload_bytes(opt_state))


@pytest.mark.parametrize("donate", [False, True])
def test_nnx_step_compiles_once(mesh, donate):
    traces = []

    def counting_loss(model, batch):
        traces.append(1)
        return loss_fn(model, batch)

    model, optimizer = replicated(mesh)
    step = parallel.nnx_data_parallel_step(counting_loss, mesh, donate=donate)
    batch = make_batch(mesh)
    kernel = model.l1.kernel[...]
    for _ in range(3):
        jax.block_until_ready(step(model, optimizer, batch))
    assert len(traces) == 1 and step.jitted._cache_size() == 1
    assert kernel.is_deleted() == donate  # donated buffers are gone; the objects hold the new ones
    assert np.all(np.isfinite(np.asarray(model.l1.kernel[...])))


def test_nnx_step_refuses_undonatable_state(mesh):
    """Arrays already donated, or one array in two Variables, are refused before XLA sees them (it crashes)."""
    model, optimizer = replicated(mesh)
    step = parallel.nnx_data_parallel_step(loss_fn, mesh, donate=True)
    batch = make_batch(mesh)
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))  # the arrays, in Variables of its own
    jax.block_until_ready(step(model, optimizer, batch))
    after = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
    nnx.update((model, optimizer), before)
    with pytest.raises(ValueError, match="already donated"):
        step(model, optimizer, batch)
    bias = after[0]["l1"]["bias"][...]  # the state of (model, optimizer) is keyed 0 and 1
    shared = jax.tree.map(lambda x: bias if x.shape == bias.shape else x, after)  # l1.bias, its residual, trace
    nnx.update((model, optimizer), shared)
    with pytest.raises(ValueError, match="same array"):
        step(model, optimizer, batch)


def test_pure_step_compiles_once(mesh):
    """replicate's sharding is the one the step returns, so the second call hits the cache too."""
    tx = make_tx("topk")
    init = {"w": jnp.ones((16, 4)) * 0.1}
    params, opt_state = parallel.replicate(init, mesh), parallel.init_worker_state(tx, init, mesh)
    step = parallel.data_parallel_step(lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2), tx, mesh)
    batch = make_batch(mesh)
    for _ in range(2):
        params, opt_state, _ = jax.block_until_ready(step(params, opt_state, batch))
    assert step._cache_size() == 1


def test_nnx_replicate_stacks_in_place_with_own_buffers(mesh):
    n = mesh.shape[AXIS]
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx("topk"), wrt=nnx.Param)
    before = leaves(model) + leaves(optimizer)
    parallel.nnx_replicate(mesh, model, optimizer)
    after = jax.tree.leaves(nnx.state((model, optimizer)))
    assert len(after) == len(before)
    for b, a in zip(before, after, strict=True):
        assert a.shape == (n, *b.shape) and a.dtype == b.dtype
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, P(AXIS)), a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(b, a.shape))
    pointers = [s.data.unsafe_buffer_pointer() for a in after for s in a.addressable_shards]
    assert len(set(pointers)) == len(pointers) == n * len(after)  # safe to donate
    with pytest.raises(ValueError, match="already sharded"):
        parallel.nnx_replicate(mesh, model)
    assert model.l1.kernel[...].shape == (n, 16, 32)  # unchanged by the refused call


def test_nnx_unreplicate_copies_worker_0(mesh):
    model, optimizer = replicated(mesh)
    step = parallel.nnx_data_parallel_step(loss_fn, mesh)
    batch = make_batch(mesh)
    for _ in range(2):
        jax.block_until_ready(step(model, optimizer, batch))
    eval_model, eval_opt = parallel.nnx_unreplicate(model), parallel.nnx_unreplicate(optimizer)
    assert type(eval_model) is MLP and type(eval_opt) is nnx.Optimizer
    for stacked, one in zip(leaves(model) + leaves(optimizer), leaves(eval_model) + leaves(eval_opt), strict=True):
        np.testing.assert_array_equal(one, stacked[0])
    assert eval_model(jnp.ones((5, 16))).shape == (5, 4)
    assert cj.payload_bytes(eval_opt).shape == () and cj.payload_bytes(eval_opt) == cj.payload_bytes(optimizer)[0]
    assert model.l1.kernel[...].shape[0] == mesh.shape[AXIS]  # the replicated objects are left as they were


def test_payload_bytes_raises_without_compressor(mesh):
    model = MLP(nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for tree in (nnx.state(model), model, nnx.state(plain), plain):
        with pytest.raises(ValueError, match="no compressor state"):
            cj.payload_bytes(tree)
