"""Bring your own step: parallel.worker_step, has_aux / rng in the step builders, and loud axis mistakes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS

N = 8


def sgd_step(tx):
    """A single-device step as a user writes it: (params, opt_state, batch) -> (params, opt_state, metrics)."""

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def numpy_sgd_reference(w, xs, ys, lr, steps):
    """Synchronous SGD with the mean of the workers' gradients (identity compressor), in NumPy."""
    w = np.array(w, np.float64)
    for _ in range(steps):
        grads = [2 * x.T @ (x @ w - y) / y.size for x, y in zip(xs, ys)]
        w = w - lr * np.mean(grads, axis=0)
    return w


def test_worker_step_runs_a_user_step_as_synchronous_sgd(mesh):
    """8 workers, each its own rows of the batch, identity compressor: plain SGD on the mean gradient."""
    tx = optax.chain(cj.identity(AXIS), optax.sgd(0.1))
    w0 = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N * 2, 4)).astype(np.float32), rng.normal(size=(N * 2, 3)).astype(np.float32)
    step = parallel.worker_step(sgd_step(tx), mesh)
    params, opt_state = parallel.replicate(jnp.asarray(w0), mesh), parallel.init_worker_state(tx, jnp.asarray(w0), mesh)
    for _ in range(3):
        params, opt_state, metrics = jax.block_until_ready(step(params, opt_state, (x, y)))
    want = numpy_sgd_reference(w0, np.split(x, N), np.split(y, N), 0.1, 3)
    got = np.asarray(params)
    assert got.shape == (N, 4, 3)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-5, atol=1e-6)
    # metrics come back per worker: each worker's local loss at the last step's parameters
    assert metrics["loss"].shape == (N,) and len(set(np.asarray(metrics["loss"]).tolist())) > 1
    assert int(cj.payload_bytes(opt_state)[0]) == 12 * 4 + 4
    assert step.jitted._cache_size() == 1  # the outputs' shardings are the inputs': one compilation


def test_rng_argnums_give_each_worker_fold_in_of_the_key(mesh):
    draw = parallel.worker_step(lambda key, batch: jax.random.uniform(key, (3,)), mesh, rng_argnums=0,
                                independent=True)  # a draw per worker: nothing to average
    key = jax.random.key(7)
    got = np.asarray(draw(key, jnp.zeros((N, 1))))
    want = np.stack([np.asarray(jax.random.uniform(jax.random.fold_in(key, i), (3,))) for i in range(N)])
    np.testing.assert_array_equal(got, want)
    raw = np.asarray(draw(jax.random.PRNGKey(7), jnp.zeros((N, 1))))  # a raw key works the same way
    assert raw.shape == (N, 3) and len({tuple(r) for r in raw.tolist()}) == N


def test_average_names_mean_over_workers_and_keep_the_rest(mesh):
    """average="stats": the leaves under that key are the workers' mean; others stay per worker."""

    def fn(state, batch):
        return {"stats": state["stats"] + batch.sum(), "own": state["own"] + batch.sum()}

    state = parallel.replicate({"stats": jnp.zeros(2), "own": jnp.zeros(2)}, mesh)
    batch = jnp.arange(N * 2, dtype=jnp.float32)
    out = parallel.worker_step(fn, mesh, average="stats")(state, batch)
    sums = np.arange(N * 2, dtype=np.float32).reshape(N, 2).sum(1)
    np.testing.assert_allclose(np.asarray(out["stats"]), np.full((N, 2), sums.mean()))
    np.testing.assert_allclose(np.asarray(out["own"]), np.repeat(sums[:, None], 2, 1))


class DropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 1, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.linear(self.dropout(x))


def dropout_run(mesh, worker_rngs, seed=0):
    model = DropoutNet(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1)), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer)
    step = parallel.nnx_data_parallel_step(lambda m, b: (jnp.mean(m(b) ** 2), m(b)), mesh, has_aux=True,
                                           worker_rngs=worker_rngs)
    batch = jnp.tile(jnp.linspace(0.5, 2.0, 16)[None], (N * 2, 1))  # every worker gets the same rows
    out = [jax.block_until_ready(step(model, optimizer, batch)) for _ in range(2)]
    return out, model


@pytest.mark.slow
def test_nnx_workers_draw_their_own_dropout_masks_and_repeat_from_the_seed(mesh):
    (first, second), model = dropout_run(mesh, worker_rngs=True)
    loss, aux = first
    assert loss.shape == (N,) and aux.shape == (N, 2, 1)  # has_aux: each worker's model output
    # Same rows on every worker: only the dropout masks can tell the workers' losses apart.
    assert len(set(np.asarray(loss).tolist())) == N
    assert not np.array_equal(np.asarray(first[0]), np.asarray(second[0]))  # the counter advanced
    keys = jax.random.key_data(nnx.state(model, nnx.RngKey)["dropout"]["rngs"]["key"][...])
    assert len({tuple(k) for k in np.asarray(keys).tolist()}) == 1  # the stored key stays shared
    (again, _), _ = dropout_run(mesh, worker_rngs=True)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(loss))  # same seed, same run
    (same, _), _ = dropout_run(mesh, worker_rngs=False)
    assert len(set(np.asarray(same[0]).tolist())) == 1  # without: every worker draws the same mask


def test_data_parallel_step_has_aux_and_worker_keys(mesh):
    tx = optax.chain(cj.identity(AXIS), optax.sgd(0.1))

    def loss_fn(p, batch, key):
        noise = jax.random.normal(key, ())
        return jnp.mean((batch @ p) ** 2) + 0.0 * noise, noise

    step = parallel.data_parallel_step(loss_fn, tx, mesh, has_aux=True, rng=True)
    p0 = jnp.ones(3)
    params, opt_state = parallel.replicate(p0, mesh), parallel.init_worker_state(tx, p0, mesh)
    key = jax.random.key(3)
    params, opt_state, loss, noise = step(params, opt_state, jnp.ones((N, 3)), key)
    want = [float(jax.random.normal(jax.random.fold_in(key, i), ())) for i in range(N)]
    np.testing.assert_allclose(np.asarray(noise), want, rtol=1e-6)
    assert loss.shape == (N,)
    with pytest.raises(ValueError, match="key must be a PRNG key"):
        step(params, opt_state, jnp.ones((N, 3)), 3)


def closed_over_rngs_step(mesh):
    rngs = nnx.Rngs(0)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.chain(cj.identity(AXIS), optax.sgd(0.1)), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer)
    step = parallel.nnx_data_parallel_step(lambda m, b: jnp.mean(nnx.Dropout(0.5)(m(b), rngs=rngs)), mesh)
    return step, model, optimizer


def test_closed_over_rngs_raise_with_the_fix(mesh):
    step, model, optimizer = closed_over_rngs_step(mesh)
    with pytest.raises(ValueError, match="pass it as an argument"):
        step(model, optimizer, jnp.ones((N, 2)))


def linear_step(compressor, mesh):
    tx = optax.chain(compressor, optax.sgd(0.1))
    p0 = jnp.ones((4, 2))
    step = parallel.data_parallel_step(lambda p, x: jnp.mean((x @ p) ** 2), tx, mesh)
    return step, parallel.replicate(p0, mesh), parallel.init_worker_state(tx, p0, mesh)


@pytest.mark.parametrize("compressor, message", [
    (lambda: cj.topk(0.5), r"cj.topk has axis_name=None, but its gradients vary over the mesh axes \('data',\)"),
    (lambda: cj.topk(0.5, axis_name="batch"),
     r"cj.topk has axis_name='batch', which is not an axis of this step: the axes bound here are \('data',\)"),
    (lambda: cj.powersgd(1, axis_name="batch"), r"cj.powersgd has axis_name='batch'.*build it with axis_name='data'"),
    (lambda: cj.delayed_averaging(2, axis_name=None), r"cj.delayed_averaging has axis_name=None.*axis_name='data'"),
    (lambda: cj.apply_if_finite(cj.identity("data"), axis_name="batch"), r"cj.apply_if_finite has axis_name='batch'"),
])
def test_axis_mistakes_raise_before_any_step_runs(mesh, compressor, message):
    step, params, opt_state = linear_step(compressor(), mesh)
    before = np.asarray(params)
    with pytest.raises(ValueError, match=message):
        step(params, opt_state, jnp.ones((N, 4)))
    np.testing.assert_array_equal(np.asarray(params), before)


def test_axis_name_outside_any_step_names_the_fix():
    tx = cj.topk(0.5, axis_name="data")
    g = {"w": jnp.ones(4)}
    with pytest.raises(ValueError, match="no worker axis is bound here"):
        tx.update(g, tx.init(g))


def test_worker_step_bad_input(mesh):
    f = lambda s, b: s
    for kwargs, name in [({"axis_name": "batch"}, "axis_name='batch' is not an axis of the mesh"),
                         ({"batch_argnums": "1"}, "batch_argnums must be an int"),
                         ({"rng_argnums": (0.5,)}, "rng_argnums must be an int"),
                         ({"average": 3}, "average entries must be"),
                         ({"average": (nnx.Linear,)}, "average entries must be")]:
        with pytest.raises(ValueError, match=name):
            parallel.worker_step(f, mesh, **kwargs)
    state = parallel.replicate(jnp.zeros(2), mesh)
    with pytest.raises(ValueError, match="listed twice"):
        parallel.worker_step(f, mesh, rng_argnums=1)(state, jnp.zeros((N,)))
    with pytest.raises(ValueError, match="out of range"):
        parallel.worker_step(f, mesh, batch_argnums=5)(state, jnp.zeros((N,)))
    with pytest.raises(ValueError, match="is not a PRNG key"):
        parallel.worker_step(lambda s, k, b: s, mesh, rng_argnums=1)(state, 3.0, jnp.zeros((N,)))
    with pytest.raises(ValueError, match=r"argument 0 has shape \(2,\), not the worker-stacked layout"):
        parallel.worker_step(f, mesh)(jnp.zeros(2), jnp.zeros((N,)))
    with pytest.raises(ValueError, match=r"is an NNX object, but batch_argnums lists it.*batch_argnums=0"):
        parallel.worker_step(f, mesh, batch_argnums=-1)(state, nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="worker_rngs must be True or False"):
        parallel.worker_step(f, mesh, worker_rngs="yes")
    with pytest.raises(ValueError, match="has_aux must be True or False"):
        parallel.nnx_data_parallel_step(f, mesh, has_aux=1)
    with pytest.raises(ValueError, match="rng must be True or False"):
        parallel.data_parallel_step(f, optax.sgd(0.1), mesh, rng=None)
    with pytest.raises(ValueError, match="fast_axis='fast' is not an axis|axis_name='fast' is not an axis"):
        parallel.data_parallel_step(lambda p, b: 0.0, optax.sgd(0.1), mesh, fast_axis="fast")


def test_audit_tells_payload_from_averaged_model_state(mesh):
    """worker_step(average=): the state's all-reduce is compjax's but uncounted; payload_bytes = the counted bytes."""
    tx = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))

    @jax.jit
    def step(state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p) ** 2))(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
                "stats": state["stats"] + jnp.mean(x, 0)}, loss

    p0 = jnp.ones(4)
    state = parallel.replicate({"params": p0, "opt": tx.init(p0), "stats": jnp.zeros(4)}, mesh)
    wstep = parallel.worker_step(step, mesh, average="stats")
    ops = cj.audit_collectives(wstep, state, jnp.ones((N, 4)))
    split = cj.accounting.bytes_by_issuer(ops)
    state, _ = wstep(state, jnp.ones((N, 4)))
    assert split == {"compjax": int(cj.payload_bytes(state["opt"])[0]), "compjax-uncounted": 16, "other": 0}
    assert "compjax, not in payload_bytes: 16 B" in cj.accounting.format_collectives(ops)


class MLP(nnx.Module):
    """A few layers, as a ported NNX program has them (dropout drawn from the model's own or a passed Rngs)."""

    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def nnx_train_step(model, optimizer, batch):
    """The usual NNX step: value_and_grad, optimizer.update."""
    x, y = batch
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def regression_batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 16)).astype(np.float32), rng.normal(size=(rows, 4)).astype(np.float32)


def test_worker_step_refuses_layouts_of_another_step_naming_the_path():
    """A state laid out for a 2-D mesh (fast_axis=, specs=, nnx_replicate(specs=)) given to a step built on the
    1-D mesh, or one worker per device (fast_axis=) given to a step on the 2-D mesh, would run another layout
    (or drop the sharding after one step): refused, naming the leaf and the builders that take it. A 2-D mesh
    itself is taken (tests/test_user_step_2d.py)."""
    mesh2, mesh1 = parallel.make_2d_mesh(2, 4), parallel.make_mesh()
    tx = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    w = jnp.ones((4, 3))
    batch = (jnp.ones((16, 4)), jnp.ones((16, 3)))
    step = parallel.worker_step(sgd_step(tx), mesh1)
    stacked = parallel.replicate(w, mesh2, fast_axis="fast")  # 8 workers over both axes
    with pytest.raises(ValueError, match=r"argument 0 is laid out .*'data', 'fast'.*worker axis 'data' alone.*"
                                         r"data_parallel_step\(loss_fn, tx, mesh, fast_axis=\.\.\., specs=\.\.\.\)"):
        step(stacked, parallel.init_worker_state(tx, w, mesh1), batch)
    with pytest.raises(ValueError, match=r"argument 0 is laid out .*several mesh axes.*\('fast',\).*specs=.*"
                                         r"data_parallel_step\(loss_fn, tx, mesh, fast_axis=\.\.\.\)"):
        parallel.worker_step(sgd_step(tx), mesh2)(stacked, parallel.init_worker_state(tx, w, mesh2), batch)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1)), wrt=nnx.Param)
    parallel.nnx_replicate(mesh2, model, optimizer, specs=parallel.fsdp_specs(nnx.state(model), mesh2, min_size=256))
    with pytest.raises(ValueError, match=r"argument 0\['l1'\]\['kernel'\].* laid out .*'fast'.*worker axis 'data' "
                                         r"alone.*Build worker_step on the 2-D mesh.*"
                                         r"nnx_data_parallel_step\(loss_fn, mesh, fast_axis=\.\.\.\)"):
        parallel.worker_step(nnx_train_step, mesh1)(model, optimizer, regression_batch())


def test_a_step_that_crosses_no_worker_axis_warns_unless_independent():
    """No compressor in the chain: every worker would train its own model. Warned at the first call with the fix,
    once; silent with independent=True, with a compressor, or with a collective of the step's own."""
    def run(tx, **kw):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        mesh = parallel.make_mesh()
        parallel.nnx_replicate(mesh, model, optimizer)
        step = parallel.worker_step(kw.pop("fn", nnx_train_step), mesh, **kw)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # every warning, even one with the text of an earlier run's
            for seed in range(3):
                step(model, optimizer, regression_batch(seed=seed))
        return [str(w.message) for w in seen if "crosses the worker axis" in str(w.message)]

    found = run(optax.adam(1e-3))
    assert len(found) == 1, found
    assert "'data'" in found[0] and "8 workers" in found[0] and "cj.identity(axis_name='data')" in found[0] \
        and "independent=True" in found[0]
    assert run(optax.adam(1e-3), independent=True) == []
    assert run(optax.chain(cj.identity(axis_name=AXIS), optax.adam(1e-3))) == []

    def own_mean(model, optimizer, batch):  # a pmap program's own lax.pmean of the gradients crosses the axis
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, jax.lax.pmean(grads, AXIS))
        return loss

    assert run(optax.adam(1e-3), fn=own_mean) == []
    with pytest.raises(ValueError, match="independent must be True or False"):
        parallel.worker_step(nnx_train_step, parallel.make_mesh(), independent="yes")


def test_default_batch_skips_a_trailing_rngs_and_names_the_argument_otherwise():
    """Flax's tutorial signature train_step(model, optimizer, metrics, batch, rngs): the default batch is the last
    argument that is no NNX object (batch, not rngs); naming an NNX object as the batch says which to name."""
    def train_step(model, optimizer, metrics, batch, rngs):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m, r: jnp.mean((m(x, rngs=r) - y) ** 2))(model, rngs)
        optimizer.update(model, grads)
        metrics.update(loss=loss)

    mesh = parallel.make_mesh()
    model, rngs = MLP(nnx.Rngs(0)), nnx.Rngs(dropout=1)
    optimizer = nnx.Optimizer(model, optax.chain(cj.identity(axis_name=AXIS), optax.sgd(0.05)), wrt=nnx.Param)
    metrics = nnx.metrics.Average("loss")
    parallel.nnx_replicate(mesh, model, optimizer, metrics, rngs)
    step = parallel.worker_step(train_step, mesh)
    losses = []
    for _ in range(4):
        metrics.reset()
        step(model, optimizer, metrics, regression_batch(), rngs)
        losses.append(float(np.mean(np.asarray(metrics.compute()))))
    assert losses[-1] < losses[0] and int(optimizer.step[0]) == 4

    with pytest.raises(ValueError, match=r"argument 4 \(Rngs\) is an NNX object, but batch_argnums lists it.*"
                                         r"batch_argnums=3"):
        parallel.worker_step(train_step, mesh, batch_argnums=-1)(model, optimizer, metrics, regression_batch(), rngs)
    with pytest.raises(ValueError, match=r"batch_argnums: every one of the step's 2 arguments is an NNX object"):
        parallel.worker_step(lambda m, o: None, mesh)(model, optimizer)


def test_a_worker_stacked_nnx_model_evaluates_through_nnx_unreplicate():
    """The user's own eval on the replicated model fails on the extra worker axis; nnx_unreplicate gives the
    one-worker model, sharded parameters gathered whole, with the single model's outputs."""
    x = jnp.asarray(regression_batch()[0])
    for mesh, specs in ((parallel.make_mesh(), None), (parallel.make_2d_mesh(2, 4), True)):
        model = MLP(nnx.Rngs(0))
        model.eval()
        want = np.asarray(model(x))
        kw = {"specs": parallel.fsdp_specs(nnx.state(model), mesh, min_size=256)} if specs else {}
        parallel.nnx_replicate(mesh, model, **kw)
        with pytest.raises(TypeError):
            model(x)  # the extra leading axis (what nnx_replicate's docstring says to do instead)
        one = parallel.nnx_unreplicate(model)
        assert one.l1.kernel.shape == (16, 64) and one.l2.kernel.shape == (64, 4)
        np.testing.assert_array_equal(np.asarray(one(x)), want)


def test_worker_step_refuses_a_dimension_of_its_own_sharded_over_the_worker_axis():
    """On a 2-D mesh a stacked leaf whose own dimension 0 (after the worker axis) is sharded over the worker
    axis would hand each worker another worker's rows: refused, naming the leaf and the reason."""
    mesh2 = parallel.make_2d_mesh(2, 4)
    tx = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1))
    w = jnp.ones((4, 3))
    own = jax.device_put(jnp.ones((2, 4, 3)), jax.sharding.NamedSharding(mesh2, jax.sharding.PartitionSpec(None, AXIS)))
    with pytest.raises(ValueError, match=r"argument 0 is laid out .*a dimension of its own is sharded over the "
                                         r"worker axis 'data'"):
        parallel.worker_step(sgd_step(tx), mesh2)(own, parallel.init_worker_state(tx, w, mesh2),
                                                  (jnp.ones((16, 4)), jnp.ones((16, 3))))
