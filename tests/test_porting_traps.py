"""Traps a ported Flax program meets, each said where the user meets it.

An evaluation step under ``worker_step`` is no model trained apart; a norm-based transform before the compressor
is named under ``worker_step`` and in the sharded builders; a compressor without a worker axis inside a plain
``jax.jit`` over sharded arguments says that nothing is exchanged; Flax's ``DynamicScale(axis_name=...)``, which
averages the gradients itself, is named with the fix; the worker-stacked state goes through
``flax.training.checkpoints`` and back.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS

PARAMS = {"w": jnp.full((8, 4), 0.1), "b": jnp.zeros(4)}


def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(n, 8)), jnp.float32), jnp.asarray(rng.normal(size=(n, 4)), jnp.float32))


# --- an evaluation step is no model trained apart --------------------------------------------------------------


def test_an_evaluation_step_does_not_warn_that_workers_train_apart(mesh):
    x, y = data()
    params = parallel.replicate(PARAMS, mesh)
    eval_step = parallel.worker_step(lambda p, x, y: {"loss": loss_fn(p, x, y)}, mesh, batch_argnums=(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics = eval_step(params, x, y)
    assert metrics["loss"].shape == (8,)
    # the same program's training step with optax alone (no compressor) still warns: it trains one model per worker
    tx = optax.sgd(0.1)

    def train_step(p, s, x, y):
        u, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    step = parallel.worker_step(train_step, mesh, batch_argnums=(2, 3))
    with pytest.warns(UserWarning, match=r"each of the 8 workers trains its own model"):
        step(params, parallel.replicate(tx.init(PARAMS), mesh), x, y)


@pytest.mark.slow  # compiles an NNX step
def test_an_nnx_evaluation_step_with_metrics_does_not_warn(mesh):
    from flax import nnx

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    parallel.nnx_replicate(mesh, model, metrics)

    def eval_step(model, metrics, batch):
        x, y = batch
        metrics.update(loss=jnp.mean((model(x) - y) ** 2))

    step = parallel.worker_step(eval_step, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, metrics, data())


# --- a norm-based transform before the compressor --------------------------------------------------------------


def test_worker_step_names_a_clip_before_the_compressor(mesh):
    x, y = data()
    before = optax.chain(optax.clip_by_global_norm(1.0), cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))

    def train_step(p, s, x, y):  # the optimizer closed over, as a ported program has it
        u, s = before.update(jax.grad(loss_fn)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    state = parallel.replicate(PARAMS, mesh), parallel.replicate(before.init(PARAMS), mesh)
    step = parallel.worker_step(train_step, mesh, batch_argnums=(2, 3))
    with pytest.warns(UserWarning, match=r"optax\.clip_by_global_norm before its compjax compressor.*local gradient"):
        jax.block_until_ready(step(*state, x, y))


def test_worker_step_reads_the_optimizer_of_a_linen_train_state(mesh):
    from flax.training import train_state

    tx = optax.chain(cj.clip_by_global_norm(1.0), cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    ts = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)

    def train_step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    step = parallel.worker_step(train_step, mesh, batch_argnums=(1, 2))
    with pytest.warns(UserWarning, match=r"cj\.clip_by_global_norm before its compjax compressor"):
        jax.block_until_ready(step(parallel.replicate(ts, mesh), *data()))


def test_the_sharded_builders_name_cj_clip_before_the_compressor():
    mesh = parallel.make_2d_mesh(2, 4)
    specs = parallel.fsdp_specs(PARAMS, mesh, min_size=1)
    first = optax.chain(cj.clip_by_global_norm(1.0), cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"cj\.clip_by_global_norm before its compjax compressor"):
        parallel.data_parallel_step(lambda p, b: loss_fn(p, *b), first, mesh, specs=specs)
    after = optax.chain(cj.topk(0.5, axis_name=AXIS), cj.clip_by_global_norm(1.0), optax.sgd(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel.data_parallel_step(lambda p, b: loss_fn(p, *b), after, mesh, specs=specs)


@pytest.mark.slow  # compiles the NNX sharded step
def test_the_nnx_sharded_step_names_cj_clip_before_the_compressor():
    from flax import nnx

    mesh = parallel.make_2d_mesh(2, 4)
    first = optax.chain(cj.clip_by_global_norm(1.0), cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, first, wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer, specs=parallel.fsdp_specs(nnx.state(model), mesh, min_size=1))
    step = parallel.nnx_data_parallel_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), mesh, fast_axis="fast")
    with pytest.warns(UserWarning, match=r"cj\.clip_by_global_norm before its compjax compressor"):
        jax.block_until_ready(step(model, optimizer, data()))


# --- a compressor without a worker axis inside a jit over sharded arguments -------------------------------------


def test_a_jit_step_over_sharded_arguments_warns_that_nothing_is_exchanged(mesh):
    tx = optax.chain(cj.topk(0.01), optax.sgd(0.1))

    @jax.jit
    def train_step(p, s, x, y):
        u, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    x, y = data()
    with warnings.catch_warnings():  # the ordinary one-device use: no warning
        warnings.simplefilter("error")
        train_step(PARAMS, tx.init(PARAMS), x, y)
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    args = jax.device_put((PARAMS, tx.init(PARAMS)), rep) + jax.device_put((x, y), rows)
    with pytest.warns(UserWarning, match=r"cj\.topk has axis_name=None, but its gradients are traced over a mesh "
                                         r"of 8 devices.*nothing is exchanged.*axis_name='data'"):
        train_step(*args)


# --- Flax's DynamicScale ---------------------------------------------------------------------------------------


def dynamic_scale_case(mesh):
    """Flax's mixed-precision recipe on the worker-stacked layout: ``(state, step_over(axis))``."""
    from flax.training import dynamic_scale, train_state

    class State(train_state.TrainState):
        dynamic_scale: dynamic_scale.DynamicScale

    tx = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    ts = parallel.replicate(State.create(apply_fn=None, params=PARAMS, tx=tx,
                                         dynamic_scale=dynamic_scale.DynamicScale()), mesh)

    def train_step_over(axis):
        def train_step(state, x, y):
            grad_fn = state.dynamic_scale.value_and_grad(lambda p: loss_fn(p, x, y), axis_name=axis)
            ds, is_fin, _, grads = grad_fn(state.params)
            new = state.apply_gradients(grads=grads).replace(dynamic_scale=ds)
            return jax.tree.map(lambda a, b: jnp.where(is_fin, a, b), new, state)

        return parallel.worker_step(train_step, mesh, batch_argnums=(1, 2))

    return ts, train_step_over


def test_dynamic_scale_with_an_axis_is_named_with_the_fix(mesh):
    """``value_and_grad(..., axis_name=...)`` of Flax's DynamicScale pmeans the gradients itself."""
    ts, train_step_over = dynamic_scale_case(mesh)
    x, y = data()

    # the ImageNet example's axis, which worker_step does not bind: JAX's bare AssertionError before
    with pytest.raises(ValueError, match=r"DynamicScale\.value_and_grad with axis_name='batch'.*averages the "
                                         r"gradients.*worker axis here is 'data'.*Call it without axis_name"):
        train_step_over("batch")(ts, x, y)
    # the worker axis itself: the gradients reach the compressor already averaged
    with pytest.raises(ValueError, match=r"already invariant.*Flax's DynamicScale\(axis_name=\.\.\.\) pmeans the "
                                         r"gradients itself: build it without axis_name"):
        train_step_over(AXIS)(ts, x, y)


@pytest.mark.slow  # compiles the step
def test_dynamic_scale_without_an_axis_trains_with_the_compressor_sending(mesh):
    ts, train_step_over = dynamic_scale_case(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = train_step_over(None)(ts, *data())
    assert np.all(cj.payload_bytes(new.opt_state) > 0)
    assert np.all(np.asarray(new.step) == 1)


def test_a_pmap_programs_collective_over_another_axis_is_named(mesh):
    step = parallel.worker_step(lambda p, x: jax.lax.pmean(p * x.sum(), "batch"), mesh)
    with pytest.raises(ValueError, match=r"collective in the step names the axis 'batch' that is not bound here.*"
                                         r"binds the worker axis 'data' alone"):
        step(parallel.replicate(jnp.ones(3), mesh), jnp.ones((16, 3)))


# --- flax.training.checkpoints on the worker-stacked state -----------------------------------------------------


@pytest.mark.slow  # orbax writes and reads a checkpoint
def test_flax_checkpoints_round_trip_the_worker_stacked_state(mesh, tmp_path):
    """The documented form: ``step=int(state.step[0])`` (``int(state.step)`` of the stacked step is numpy's
    TypeError), and a restore that first checks a checkpoint is there (flax hands back the target otherwise)."""
    from flax.training import checkpoints, train_state

    tx = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.adam(0.01))

    def fresh():
        return parallel.replicate(train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx), mesh)

    def train_step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    step = parallel.worker_step(train_step, mesh, batch_argnums=(1, 2))
    state = fresh()
    for seed in range(2):
        state = jax.block_until_ready(step(state, *data(seed=seed)))
    with pytest.raises(TypeError):
        int(state.step)  # the one-device habit: the step counter has a worker axis now
    assert checkpoints.latest_checkpoint(str(tmp_path)) is None  # nothing there: restore would return the target
    checkpoints.save_checkpoint(str(tmp_path), state, step=int(state.step[0]))
    assert checkpoints.latest_checkpoint(str(tmp_path)).endswith("checkpoint_2")
    restored = checkpoints.restore_checkpoint(str(tmp_path), target=fresh())
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(cj.payload_bytes(restored.opt_state)[0]) > 0  # the compressor's state came back, every worker's
    a, b = step(restored, *data(seed=5)), step(state, *data(seed=5))
    for got, want in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- the docs' account of worker_step's meshes -----------------------------------------------------------------


def test_the_layout_page_says_worker_step_runs_on_two_level_and_three_axis_meshes():
    """layout.md once said worker_step took 1-D meshes only; it runs on ``slow x fast`` meshes and on a
    ``(data, fsdp, tensor)`` mesh with the model's own annotations (tests/test_user_step_2d.py, _mesh3.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "concepts" / "layout.md").read_text()
    section = page.split("## A user's own step", 1)[1].split("\n## ", 1)[0]
    assert "2-D meshes and sharded parameters take" not in section
    assert "`slow x fast` mesh" in section and "`(data, fsdp, tensor)` mesh" in section
    assert "nnx.with_partitioning" in section and "evaluation step" in section
    for test in ("test_user_step_2d.py", "test_user_step_mesh3.py"):
        assert (root / "tests" / test).exists()
