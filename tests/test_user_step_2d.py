"""A user's own train step with sharded parameters: ``parallel.worker_step`` on a ``slow x fast`` mesh.

The step runs manual over the worker axis only; each worker's arrays keep their fast-axis shardings (the
model's annotations), which XLA partitions inside the host. What crosses hosts is compjax's payload alone,
each device of a host sending its own part of it: read from the compiled program's replica groups (and
collective-permutes' pairs) for every kind of exchange. The numbers equal ``data_parallel_step(specs=...)``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS

SLOW, FAST = 2, 4
SPECS = {"w1": P(None, "fast"), "w2": P("fast", None), "b": P()}


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.normal(size=(16, 64)).astype(np.float32) / 4),
            "w2": jnp.asarray(rng.normal(size=(64, 8)).astype(np.float32) / 8),
            "b": jnp.zeros(8, jnp.float32)}


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def user_step(tx):
    """A single-device step as a user writes it: (params, opt_state, batch) -> (params, opt_state, loss)."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def batches(count, rows=32, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 16)).astype(np.float32), rng.normal(size=(rows, 8)).astype(np.float32))
            for _ in range(count)]


# --- the wire, read from the compiled program -------------------------------------------------------------


def cross_host(compiled, mesh):
    """Bytes that one host's devices put into collectives reaching another host, and those collectives.

    Device ids in the program are positions in ``mesh.devices`` (row-major); host ``h`` is row ``h``. A
    collective with replica groups counts its operand bytes once per device of host 0 whose group spans
    hosts; a collective-permute once per pair leaving host 0. A collective whose groups cannot be read
    counts as crossing (so the test fails loudly rather than missing it).
    """
    per_host = mesh.devices.size // mesh.devices.shape[0]
    host = lambda d: d // per_host
    total, crossing = 0, []
    for op in cj.audit_collectives(compiled):
        groups = op.replica_groups  # the audit reads every form: list, iota, mesh[...] {axes}, permute pairs
        groups = groups if groups is not None else (tuple(range(mesh.devices.size)),)
        if op.op == "collective-permute":  # each pair (source, target): the source sends its operand
            sent = sum(op.bytes for s, t in groups if host(s) == 0 and host(t) != 0)
        else:
            sent = sum(op.bytes for g in groups for d in g if host(d) == 0 and len({host(e) for e in g}) > 1)
        if sent:
            total += sent
            crossing.append((op, sent))
    return total, crossing


def sharded_run(tx, steps=1, donate=False):
    """``tx`` in a user step through worker_step on the 2 x 4 mesh, parameters sharded by SPECS."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = init_params()
    p = parallel.replicate(params, mesh, specs=SPECS)
    s = parallel.init_worker_state(tx, params, mesh, specs=SPECS)
    step = parallel.worker_step(user_step(tx), mesh, donate=donate)
    compiled = None
    for b in batches(steps):
        if compiled is None:
            compiled = step.lower(p, s, b).compile()
        p, s, loss = step(p, s, b)
    return mesh, compiled, (p, s, loss), step


WIRE_CASES = {
    "topk": lambda: cj.topk(0.05, axis_name=AXIS),
    "sparseloco": lambda: cj.sparseloco(optax.adamw(1e-2), sync_every=1, k=8, chunk=16, axis_name=AXIS),
    "powersgd": lambda: cj.powersgd(2, axis_name=AXIS),
    "onebit": lambda: cj.onebit(axis_name=AXIS),
    "chunktopk": lambda: cj.chunktopk(8, chunk=16, axis_name=AXIS),
    "diloco_topk": lambda: cj.diloco(optax.sgd(0.1), sync_every=1, compressor=cj.topk(0.1, axis_name=AXIS),
                                     axis_name=AXIS),
    "diloco": lambda: cj.diloco(optax.sgd(0.1), sync_every=1, axis_name=AXIS),  # dense float32 outer gradients
}
FAST_WIRE = ("topk", "sparseloco")


@pytest.mark.parametrize("name", [n if n in FAST_WIRE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in WIRE_CASES])
def test_only_the_payload_crosses_hosts_once_per_host(name):
    """Summed over a host's 4 devices, the collectives reaching the other host carry exactly payload_bytes
    (the compressor's payload and the 4-byte vote of each device), every one of them compjax's: each device
    sends its own quarter, and nothing of XLA's partitioning crosses the slow axis."""
    comp = WIRE_CASES[name]()
    tx = comp if name in ("sparseloco", "diloco_topk", "diloco") else optax.chain(comp, optax.sgd(0.1))
    mesh, compiled, (p, s, _), _ = sharded_run(tx)
    sent, crossing = cross_host(compiled, mesh)
    payload = int(cj.payload_bytes(s)[0])
    assert payload > 4 * FAST, name
    assert all(op.issuer == "compjax" for op, _ in crossing), [(op.op, op.scopes, n) for op, n in crossing]
    assert sent == payload, (name, sent, payload, [(op.op, op.operands, n) for op, n in crossing])
    assert cj.worker_bytes(cj.audit_collectives(compiled), mesh) == payload
    assert p["w1"].sharding.spec == P(AXIS, None, "fast") and p["w2"].sharding.spec == P(AXIS, "fast")



@pytest.mark.slow
def test_the_vmap_way_moves_gradients_across_hosts():
    """What the sharded page says of the MaxText way, jax.jit(jax.vmap(step, axis_name=, spmd_axis_name=)) over
    the same state: XLA's sharding propagation is free to send far more than the payload between hosts (with
    jaxlib 0.10.2, 35,008 bytes per host for top-k's 636), where worker_step sends the payload alone."""
    from jax.sharding import NamedSharding

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    tx = optax.chain(cj.topk(0.05, axis_name=AXIS), optax.sgd(0.1))
    params = init_params()
    p, s = parallel.replicate(params, mesh, specs=SPECS), parallel.init_worker_state(tx, params, mesh, specs=SPECS)
    b = jax.tree.map(lambda x: jax.device_put(x.reshape(SLOW, -1, x.shape[1]), NamedSharding(mesh, P(AXIS, "fast"))),
                     batches(1)[0])
    compiled = jax.jit(jax.vmap(user_step(tx), axis_name=AXIS, spmd_axis_name=AXIS)).lower(p, s, b).compile()
    _, s, _ = compiled(p, s, b)
    sent, _ = cross_host(compiled, mesh)
    assert sent > 10 * int(cj.payload_bytes(s)[0])

# --- the numbers: the same model through data_parallel_step(specs=...) --------------------------------------


class AnnotatedMLP(nnx.Module):
    """An NNX model whose kernels carry sharding annotations over the fast axis, as Flax's examples write them."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, (None, "fast")), rngs=rngs)
        self.l2 = nnx.Linear(64, 8, kernel_init=nnx.with_partitioning(init, ("fast", None)), rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def nnx_train_step(model, optimizer, batch):
    """Flax's single-device NNX step."""
    loss, grads = nnx.value_and_grad(nnx_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


NNX_TX = {
    "topk": lambda: optax.chain(cj.topk(0.05, axis_name=AXIS), optax.sgd(0.1)),
    "sparseloco": lambda: cj.sparseloco(optax.adamw(1e-2), sync_every=2, k=8, chunk=16, axis_name=AXIS),
}


def pytree_reference(make_model, loss_of_model, tx, data, mesh):
    """The same model and steps through data_parallel_step(specs=...): the model's own specs, its parameters
    as a pytree. Returns the gathered parameters after the last batch and the last step's payload bytes."""
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(make_model())
    params = nnx.to_pure_dict(state)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    loss = lambda p, b: loss_of_model(nnx.merge(graphdef, p), b)
    p = parallel.replicate(params, mesh, specs=specs)
    s = parallel.init_worker_state(tx, params, mesh, specs=specs)
    step = parallel.data_parallel_step(loss, tx, mesh, specs=specs)
    for b in data:
        p, s, _ = step(p, s, parallel.shard_batch(b, mesh, fast_axis="fast"))
    return parallel.gather(p), int(cj.payload_bytes(s)[0])


@pytest.mark.parametrize("name", ["topk", pytest.param("sparseloco", marks=pytest.mark.slow)])
def test_an_annotated_nnx_model_trains_as_data_parallel_step_with_specs(name):
    """nnx.with_partitioning annotations, Flax's own nnx.jit step, 5 steps on 2 x 4: the parameters equal the
    pytree step's with the same specs (1e-6), each device keeps its quarter, one compilation."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    data = batches(5)
    with jax.set_mesh(mesh):  # flax places annotated Variables (and the optimizer's copies) when created
        model = AnnotatedMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, NNX_TX[name](), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer, specs=nnx.get_partition_spec(nnx.state(model)))
    step = parallel.worker_step(nnx_train_step, mesh)
    for b in data:
        loss = step(model, optimizer, b)
    assert loss.shape == (SLOW,)
    assert model.l1.kernel.sharding.spec == P(AXIS, None, "fast")
    assert model.l1.kernel.addressable_shards[0].data.shape == (1, 16, 16)
    assert step.jitted._cache_size() == 1
    want, payload = pytree_reference(lambda: AnnotatedMLP(nnx.Rngs(0)), nnx_loss, NNX_TX[name](), data, mesh)
    got = parallel.gather(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert int(cj.payload_bytes(optimizer)[0]) == payload
    if name == "topk":  # synchronous: the workers agree (SparseLoCo's last sync was step 4: step 5 sends nothing)
        assert np.abs(got["l1"]["kernel"][0] - got["l1"]["kernel"][1]).max() == 0 and payload > 0


@pytest.mark.slow  # two Linen programs and the pytree reference; the NNX test above keeps the numbers in the fast tier
def test_an_annotated_linen_train_state_trains_as_data_parallel_step_with_specs():
    """A Linen model with nn.with_partitioning annotations and its TrainState step, laid out by the model's
    own specs (parameters and, through parallel.state_specs, the optimizer's moments and residuals): 5 steps
    of top-k equal data_parallel_step(specs=...) (1e-6); the state comes back laid out as it went in."""
    import flax.linen as nn
    from flax.training import train_state

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            h = nn.relu(nn.Dense(64, kernel_init=nn.with_partitioning(init, (None, "fast")))(x))
            return nn.Dense(8, kernel_init=nn.with_partitioning(init, ("fast", None)))(h)

    @jax.jit
    def train_step(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(
            state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    data = batches(5)
    model = LinenMLP()
    variables = model.init(jax.random.key(0), data[0][0][:1])
    params, specs = nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]
    tx = optax.chain(cj.topk(0.05, axis_name=AXIS), optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state_specs = state.replace(step=P(), params=specs, opt_state=parallel.state_specs(tx, params, specs, mesh))
    state = parallel.replicate(state, mesh, specs=state_specs)
    step = parallel.worker_step(train_step, mesh)
    for b in data:
        state, metrics = step(state, b)
    assert metrics["loss"].shape == (SLOW,) and step.jitted._cache_size() == 1
    assert state.params["Dense_0"]["kernel"].sharding.spec == P(AXIS, None, "fast")
    assert state.opt_state[1][0].mu["Dense_1"]["kernel"].sharding.spec == P(AXIS, "fast")  # adam's moment

    loss = lambda p, b: jnp.mean((model.apply({"params": p}, b[0]) - b[1]) ** 2)
    p = parallel.replicate(params, mesh, specs=specs)
    s = parallel.init_worker_state(tx, params, mesh, specs=specs)
    ref = parallel.data_parallel_step(loss, tx, mesh, specs=specs)
    for b in data:
        p, s, _ = ref(p, s, parallel.shard_batch(b, mesh, fast_axis="fast"))
    got, want = parallel.gather(state.params), parallel.gather(p)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert int(cj.payload_bytes(state.opt_state)[0]) == int(cj.payload_bytes(s)[0]) > 0


# --- what worker_step keeps on a 2-D mesh ------------------------------------------------------------------


def test_a_2d_step_that_crosses_no_worker_axis_warns_unless_independent():
    """No compressor in the chain: each of the 2 workers would train its own model. Warned at the first call
    on the 2-D mesh as on the 1-D one; silent with independent=True."""
    def run(**kw):
        mesh = parallel.make_2d_mesh(SLOW, FAST)
        tx = optax.adam(1e-3)
        params = init_params()
        p, s = parallel.replicate(params, mesh, specs=SPECS), parallel.init_worker_state(tx, params, mesh, specs=SPECS)
        step = parallel.worker_step(user_step(tx), mesh, **kw)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for b in batches(2):
                p, s, _ = step(p, s, b)
        return [str(w.message) for w in seen if "crosses the worker axis" in str(w.message)]

    found = run()
    assert len(found) == 1 and "each of the 2 workers" in found[0] and "independent=True" in found[0], found
    assert run(independent=True) == []


def test_donation_and_a_batch_split_over_the_workers_only():
    """donate=True deletes the state passed in and trains on; a batch whose rows divide by the 2 workers but
    not by the 8 devices is split over the workers only (XLA lays it out inside each)."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    tx = optax.chain(cj.topk(0.05, axis_name=AXIS), optax.sgd(0.1))
    params = init_params()
    p, s = parallel.replicate(params, mesh, specs=SPECS), parallel.init_worker_state(tx, params, mesh, specs=SPECS)
    step = parallel.worker_step(user_step(tx), mesh, donate=True)
    first = p["w1"]
    losses = []
    for b in batches(3, rows=6):
        p, s, loss = step(p, s, b)
        losses.append(np.asarray(loss))
    assert first.is_deleted() and not p["w1"].is_deleted()
    assert p["w1"].sharding.spec == P(AXIS, None, "fast") and losses[-1].shape == (SLOW,)
    assert step.jitted._cache_size() == 1


def test_explicit_fast_axes_are_refused_naming_the_mesh_to_build():
    """Axes of type Explicit are not left to XLA's propagation (each device would send the whole payload, and
    a step's own ops need out_sharding there): refused when built, naming make_2d_mesh."""
    mesh = jax.make_mesh((SLOW, FAST), (AXIS, "fast"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"\['fast'\] are of type Explicit.*make_2d_mesh"):
        parallel.worker_step(user_step(optax.sgd(0.1)), mesh)
