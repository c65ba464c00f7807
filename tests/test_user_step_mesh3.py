"""Meshes as models annotate them: ``(data, fsdp, tensor)``, parameters sharded over two fast axes.

A model whose kernels carry ``P('fsdp', 'tensor')``-style annotations trains through ``parallel.worker_step``
on a 2 x 2 x 2 mesh without remapping its rules: the layout helpers take specs over several axes (the
optimizer's and compressor's state sharded like the parameter it is shaped like), XLA partitions each worker's
step over ``fsdp`` and ``tensor`` together (one host group), and what crosses hosts is compjax's payload alone.
The numbers equal one worker per device of a 1-D mesh of two. The sharded step builders built for one fast
axis (``fast_axis="fsdp"``) refuse such specs and say where to go (tests/test_fast_axes.py trains them over both).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS
from tests.test_user_step_2d import batches, cross_host, init_params, loss_fn, nnx_loss, nnx_train_step, user_step

SPECS = {"w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp"), "b": P()}
#: Both fast axes together on one dimension of each kernel.
MERGED = {"w1": P(("fsdp", "tensor"), None), "w2": P(None, ("fsdp", "tensor")), "b": P()}
TXS = {
    "topk": lambda: optax.chain(cj.topk(0.05, axis_name=AXIS), optax.adam(1e-2)),
    "sparseloco": lambda: cj.sparseloco(optax.adamw(1e-2), sync_every=2, k=8, chunk=16, axis_name=AXIS),
}


def mesh3():
    """2 hosts (``data``) x 2 x 2 devices (``fsdp`` x ``tensor``), devices in id order, row-major."""
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), (AXIS, "fsdp", "tensor"))


def one_device_per_worker(tx, steps):
    """The reference: the same user step on a 1-D mesh of 2 workers, parameters whole on each."""
    mesh = parallel.make_mesh(2)
    params = init_params()
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    step = parallel.worker_step(user_step(tx), mesh)
    for b in batches(steps):
        p, s, _ = step(p, s, b)
    return p, int(cj.payload_bytes(s)[0])


def test_state_specs_shard_the_state_like_the_parameters_over_several_axes():
    """Adam's moments and top-k's residual take each parameter's two-axis spec; counters and the scalar stay
    whole; a tuple entry (two axes on one dimension) carries over too."""
    mesh = mesh3()
    params = init_params()
    tx = TXS["topk"]()
    st = parallel.state_specs(tx, params, SPECS, mesh)
    assert st[0].residual == SPECS and st[0].count == P()
    assert st[1][0].mu == SPECS and st[1][0].nu == SPECS and st[1][0].count == P()
    merged = {"w1": P(("fsdp", "tensor")), "w2": P(None, ("fsdp", "tensor")), "b": P("tensor")}
    st = parallel.state_specs(tx, params, merged, mesh)
    assert st[0].residual == merged and st[1][0].mu == merged


@pytest.mark.slow  # a 2 x 2 x 2 program and its 1-D reference (5-20 s)
@pytest.mark.parametrize("name,layout", [("topk", "two_dims"), ("sparseloco", "two_dims"), ("sparseloco", "one_dim")])
def test_a_model_annotated_over_fsdp_and_tensor_trains_through_worker_step(name, layout):
    """Three steps on 2 x 2 x 2 equal the 1-D reference (1e-6); each device keeps its quarter of w1 and w2 (and
    of their state) in the layout the annotations give; summed over a host's four devices, the collectives
    reaching the other host carry exactly payload_bytes, all of them compjax's, and the audit of the compiled
    program warns of no dense gradients (XLA's all-reduces inside each host are not).  (SparseLoCo with kernels over
    two axes in two dimensions made XLA:CPU's partitioner abort on chunk top-k's per-tile gather until the tiles
    were laid out by rows: collectives.rows_over_worker_devices.)"""
    mesh, tx = mesh3(), TXS[name]()
    specs = SPECS if layout == "two_dims" else MERGED
    params = init_params()
    p = parallel.replicate(params, mesh, specs=specs)
    s = parallel.init_worker_state(tx, params, mesh, specs=specs)
    step = parallel.worker_step(user_step(tx), mesh)
    data = batches(3)
    compiled = step.lower(p, s, data[0]).compile()
    for b in data:
        p, s, loss = step(p, s, b)
    assert loss.shape == (2,)
    spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))  # trailing Nones spelt out
    assert spec(p["w1"]) == (AXIS, *specs["w1"], None)[:3] and spec(p["w2"]) == (AXIS, *specs["w2"])
    assert p["w1"].addressable_shards[0].data.shape == ((1, 8, 32) if layout == "two_dims" else (1, 4, 64))
    moments = s[0].residual if name == "topk" else s.inner.inner_state[0].mu
    assert spec(moments["w1"]) == spec(p["w1"])
    want, payload = one_device_per_worker(TXS[name](), 3)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-6, err_msg=k)
    with warnings.catch_warnings():  # XLA's all-reduces inside each host are not dense gradients between hosts
        warnings.simplefilter("error")
        sent, crossing = cross_host(compiled, mesh)
    assert all(op.issuer == "compjax" for op, _ in crossing), [(op.op, op.scopes) for op, _ in crossing]
    if name == "topk":  # one program path (SparseLoCo's holds the sync and the no-sync step)
        assert sent == int(cj.payload_bytes(s)[0]) > payload > 0, (sent, payload)  # + each device's 4-byte vote


@pytest.mark.slow  # an NNX program and its reference (about 6 s)
def test_an_nnx_model_annotated_over_fsdp_and_tensor_trains_through_worker_step():
    """nnx.with_partitioning over ("fsdp", "tensor"), Flax's own nnx.jit step, 3 steps of top-k on 2 x 2 x 2:
    the parameters equal the 1-D reference's (1e-6) and keep the annotated layout."""

    class Annotated(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.l1 = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")), rngs=rngs)
            self.l2 = nnx.Linear(64, 8, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")), rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    mesh, data = mesh3(), batches(3)
    tx = lambda: optax.chain(cj.topk(0.05, axis_name=AXIS), optax.sgd(0.1))
    with jax.set_mesh(mesh):
        model = Annotated(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer, specs=nnx.get_partition_spec(nnx.state(model)))
    step = parallel.worker_step(nnx_train_step, mesh)
    for b in data:
        step(model, optimizer, b)
    assert model.l1.kernel.sharding.spec == P(AXIS, "fsdp", "tensor")

    ref_mesh = parallel.make_mesh(2)
    with jax.set_mesh(mesh):  # the same initial values, brought to the host for the 1-D reference
        graphdef, state = nnx.split(Annotated(nnx.Rngs(0)))
    p0 = jax.device_get(nnx.to_pure_dict(state))
    loss = lambda p, b: nnx_loss(nnx.merge(graphdef, p), b)
    p, s = parallel.replicate(p0, ref_mesh), parallel.init_worker_state(tx(), p0, ref_mesh)
    ref_step = parallel.data_parallel_step(loss, tx(), ref_mesh)
    for b in data:
        p, s, _ = ref_step(p, s, b)
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_sharded_step_builders_refuse_specs_over_several_axes_and_name_worker_step():
    mesh = mesh3()
    params = init_params()
    tx = TXS["topk"]()
    p = parallel.replicate(params, mesh, specs=SPECS)  # the layout helpers take them
    s = parallel.init_worker_state(tx, params, mesh, specs=SPECS)
    step = parallel.data_parallel_step(loss_fn, tx, mesh, fast_axis="fsdp", specs=SPECS)
    batch = (jnp.ones((8, 16)), jnp.zeros((8, 8)))
    with pytest.raises(ValueError, match=r"several fast axes \('fsdp', 'tensor'\) but fast_axis='fsdp'.*worker_step"):
        step(p, s, batch)

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 64, rngs=rngs)

        def __call__(self, x):
            return self.l1(x)

    model = Plain(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(cj.topk(0.05, axis_name=AXIS), optax.sgd(0.1)), wrt=nnx.Param)
    nnx_specs = jax.tree.map(lambda x: P("fsdp", "tensor") if x.ndim == 2 else P(), nnx.state(model))
    parallel.nnx_replicate(mesh, model, optimizer, specs=nnx_specs)
    assert model.l1.kernel.sharding.spec == P(AXIS, "fsdp", "tensor")
    nnx_step = parallel.nnx_data_parallel_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), mesh, fast_axis="fsdp")
    with pytest.raises(ValueError, match=r"kernel.*over several axes.*worker_step"):
        nnx_step(model, optimizer, (jnp.ones((8, 16)), jnp.zeros((8, 64))))

