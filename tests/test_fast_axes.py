"""Parameters sharded over several fast axes: ``data_parallel_step(specs=)`` on a ``data=2 x fsdp=2 x tensor=2`` mesh.

Each host is the four devices of ``(fsdp, tensor)``.  The parameters and the optimizer state keep the layout their
specs give them (``P('fsdp', 'tensor')``: two dimensions over two axes, ``P(('fsdp', 'tensor'))``: one dimension over
both, ``P('tensor', None)``: some of the fast axes only); the optimizer and its compressors see every sharded leaf
cut along one dimension over all four devices (``parallel.placement.shard_view``), or, where every compressor works
on shards cut any way (dense, casts, sign, 2-bit, E3M0, DiLoCo around them), the leaves sharded over both axes as
their specs lay them out (a ``layout.Cut``).  Five steps of each registry case
equal the replicated 2-D layout on a ``2 x 4`` mesh of the same devices (1e-6, ``payload_bytes`` equal), and the
compiled program carries across the worker axis exactly the host's payload once (each of its four devices a
quarter), no other collective touching the worker axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from registry import CASES

import compjax as cj
from compjax import parallel
from tests.helpers import battery_problem

P = jax.P
SLOW, FAST = 2, 4

#: Two dimensions over two axes (w1), one dimension over both (b1), one axis of the two (w2), whole (b2, s).
TWO_DIMS = {"w1": P("fsdp", "tensor"), "b1": P(("fsdp", "tensor")), "w2": P("tensor", None), "b2": P(), "s": P()}
#: Every sharded leaf along one dimension over both axes together.
ONE_DIM = {"w1": P(None, ("fsdp", "tensor")), "b1": P(("fsdp", "tensor")), "w2": P(("fsdp", "tensor"), None),
           "b2": P(), "s": P()}
LAYOUTS = {"two_dims": TWO_DIMS, "one_dim": ONE_DIM}


def mesh3():
    return jax.make_mesh((SLOW, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] + p["s"] - y) ** 2)


@functools.cache
def replicated_reference(name, steps=5):
    """``steps`` steps of registry case ``name`` (before SGD) in the replicated 2-D layout (2 x 4): the gathered
    parameters, ``payload_bytes`` and the last losses (NumPy).  The same for both layouts of the sharded run, so
    each worker process trains it once per case."""
    tx = optax.chain(CASES[name].make(axis_name="data"), optax.sgd(0.1))
    init, batches = battery_problem()
    mesh2 = parallel.make_2d_mesh(SLOW, FAST)
    rp, rs = parallel.replicate(init, mesh2, fast_axis="fast"), parallel.init_worker_state(tx, init, mesh2,
                                                                                            fast_axis="fast")
    replicated = parallel.data_parallel_step(loss, tx, mesh2, fast_axis="fast")
    for b in batches[:steps]:
        rp, rs, rl = replicated(rp, rs, parallel.shard_batch(b, mesh2, fast_axis="fast"))
    return jax.tree.map(np.asarray, parallel.gather(rp)), np.asarray(cj.payload_bytes(rs)), np.asarray(rl)


def run_sharded(tx, specs, steps=5):
    """``steps`` steps of the sharded layout on data x fsdp x tensor: parameters and state, the last losses, the
    compiled step (the very program that ran) and the mesh."""
    init, batches = battery_problem()
    mesh = mesh3()
    sp, ss = parallel.replicate(init, mesh, specs=specs), parallel.init_worker_state(tx, init, mesh, specs=specs)
    step = parallel.data_parallel_step(loss, tx, mesh, specs=specs)
    rows = jax.NamedSharding(mesh, P(("data", "fsdp", "tensor")))
    compiled = step.lower(sp, ss, jax.device_put(batches[0], rows)).compile()
    for b in batches[:steps]:
        sp, ss, sl = compiled(sp, ss, jax.device_put(b, rows))
    return (sp, ss), np.asarray(sl), compiled, mesh


def check_case(name, specs):
    case = CASES[name]
    tx = optax.chain(case.make(axis_name="data"), optax.sgd(0.1))
    (sp, ss), sl, compiled, mesh = run_sharded(tx, specs)
    want, want_sent, rl = replicated_reference(name)
    np.testing.assert_allclose(sl, rl, rtol=1e-6, atol=1e-6)
    got = parallel.gather(sp)
    for k in want:
        np.testing.assert_allclose(got[k], want[k][::FAST], rtol=1e-6, atol=1e-6, err_msg=k)
    # The stored layout is the specs' (w1 a (3, 8) block under P('fsdp', 'tensor'), (6, 4) under the other).
    assert sp["w1"].addressable_shards[0].data.shape == ((1, 3, 8) if specs is TWO_DIMS else (1, 6, 4))
    sent = np.asarray(cj.payload_bytes(ss))
    np.testing.assert_array_equal(sent, want_sent)
    ops = cj.audit_collectives(compiled)
    counted = cj.accounting.bytes_by_axes(ops, mesh, "compjax")
    assert set(counted) <= {("data",)}, counted
    if not case.one_path:  # one path in the program: its collectives are exactly this step's
        assert counted.get(("data",), 0) * FAST == int(sent[0]), (counted, sent)
    crossing = [op for op in ops if "data" in cj.accounting.collective_axes(op, mesh)]
    assert crossing and all(op.issuer == "compjax" for op in crossing), \
        [(op.op, op.bytes, op.issuer, op.scopes) for op in crossing if op.issuer != "compjax"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_registry_case_over_two_fast_axes_equals_the_replicated_2d_layout(name, layout):
    check_case(name, LAYOUTS[layout])


# --- Flax NNX: nnx.with_partitioning over (fsdp, tensor) ------------------------------------------------------------

class AnnotatedMLP(nnx.Module):
    """l1's kernel annotated ``('fsdp', 'tensor')`` (two dimensions), l2's ``(('fsdp', 'tensor'), None)`` (one)."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(12, 32, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")), rngs=rngs)
        self.l2 = nnx.Linear(32, 4, kernel_init=nnx.with_partitioning(init, (("fsdp", "tensor"), None)), rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def nnx_loss(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def check_nnx(name):
    case = CASES[name]
    mesh, mesh2 = mesh3(), parallel.make_2d_mesh(SLOW, FAST)
    with jax.set_mesh(mesh):  # flax places annotated Variables (and the optimizer's copies) when created
        model = AnnotatedMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.chain(case.make(axis_name="data"), optax.sgd(0.1)), wrt=nnx.Param)
    graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
    params0 = jax.tree.map(np.asarray, nnx.as_pure(params0))
    specs = nnx.get_partition_spec(nnx.state(model))
    parallel.nnx_replicate(mesh, model, optimizer, specs=specs)
    assert model.l1.kernel.sharding.spec == P("data", "fsdp", "tensor")
    assert model.l1.kernel.addressable_shards[0].data.shape == (1, 6, 16)
    step = parallel.nnx_data_parallel_step(nnx_loss, mesh, fast_axis=("fsdp", "tensor"))

    ref_tx = optax.chain(case.make(axis_name="data"), optax.sgd(0.1))
    params = parallel.replicate(params0, mesh2, fast_axis="fast")
    state = parallel.init_worker_state(ref_tx, params0, mesh2, fast_axis="fast")
    ref = parallel.data_parallel_step(lambda p, b: nnx_loss(nnx.merge(graphdef, p, rest), b), ref_tx, mesh2,
                                      fast_axis="fast")
    rng = np.random.default_rng(3)
    for _ in range(4):
        batch = (rng.normal(size=(32, 12)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32))
        loss = step(model, optimizer, batch)
        params, state, ref_loss = ref(params, state, parallel.shard_batch(batch, mesh2, fast_axis="fast"))
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-6, atol=1e-6)
    got = nnx.as_pure(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b)[::FAST], atol=1e-6)
    assert int(cj.payload_bytes(optimizer)[0]) == int(cj.payload_bytes(state)[0]) > 0
    assert model.l1.kernel.sharding.spec == P("data", "fsdp", "tensor")  # the layout the model was annotated with
    return step, model, optimizer, batch, mesh, case


@pytest.mark.slow
@pytest.mark.parametrize("name", ["topk", "diloco"])
def test_nnx_model_annotated_over_fsdp_and_tensor_equals_the_replicated_2d_layout(name):
    step, model, optimizer, batch, mesh, case = check_nnx(name)
    ops = cj.audit_collectives(step, model, optimizer, parallel.shard_batch(batch, mesh,
                                                                            fast_axis=("fsdp", "tensor")))
    crossing = [op for op in ops if "data" in cj.accounting.collective_axes(op, mesh)]
    assert crossing and all(op.issuer == "compjax" for op in crossing)
    if not case.one_path:
        counted = cj.accounting.bytes_by_axes(ops, mesh, "compjax")
        assert counted.get(("data",), 0) * FAST == int(cj.payload_bytes(optimizer)[0]), counted


# --- what the path cannot take: a ValueError naming the leaf or the axis, when built or at the first call -------------

def test_layouts_over_several_fast_axes_the_step_cannot_take_are_refused_by_name():
    init, batches = battery_problem()
    mesh = mesh3()
    tx = optax.chain(cj.topk(0.05, axis_name="data"), optax.sgd(0.1))
    # A padded leaf names one axis; beside a leaf over the other, the step would have to pad over both.
    padded = dict(TWO_DIMS, b2=parallel.Padded(P("fsdp"), (3,), (4,)))
    params = parallel.replicate(init, mesh, specs=padded)
    state = parallel.init_worker_state(tx, init, mesh, specs=TWO_DIMS)
    step = parallel.data_parallel_step(loss, tx, mesh, specs=padded)
    with pytest.raises(ValueError, match=r"specs\['b2'\].*pads its leaf over.*several fast axes \('fsdp', 'tensor'\)"):
        step(params, state, batches[0])
    # JAX's default mesh axes (Explicit) cannot be left to XLA's propagation inside the step.
    explicit = jax.make_mesh((SLOW, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    params = parallel.replicate(init, explicit, specs=TWO_DIMS)
    state = parallel.init_worker_state(tx, init, explicit, specs=TWO_DIMS)
    with pytest.raises(ValueError, match=r"fast axes \['fsdp', 'tensor'\].*Explicit"):
        parallel.data_parallel_step(loss, tx, explicit, specs=TWO_DIMS)(params, state, batches[0])
    # nnx_data_parallel_step's fast axes: axes of the mesh, not the worker axis.
    with pytest.raises(ValueError, match=r"names 'model', not an axis of the mesh"):
        parallel.nnx_data_parallel_step(nnx_loss, mesh, fast_axis=("fsdp", "model"))
    with pytest.raises(ValueError, match="fast_axis and axis_name must differ"):
        parallel.nnx_data_parallel_step(nnx_loss, mesh, fast_axis=("fsdp", "data"))


@pytest.mark.slow
def test_keys_donation_and_adam_moments_over_two_fast_axes_equal_the_replicated_2d_layout():
    """The step's key folded per device (dropout masks differ on each of a host's four devices), the buffers
    donated (the step carries its leaves merged), Adam's moments laid out like the parameters: three steps equal
    the replicated 2-D layout (1e-6), losses included."""
    init, batches = battery_problem()
    mesh, mesh2 = mesh3(), parallel.make_2d_mesh(SLOW, FAST)

    def dropped(p, batch, key):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"]) * jax.random.bernoulli(key, 0.7, (x.shape[0], 16))
        return jnp.mean((h @ p["w2"] + p["b2"] + p["s"] - y) ** 2)

    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.adam(0.01))
    rp, rs = parallel.replicate(init, mesh2, fast_axis="fast"), parallel.init_worker_state(tx, init, mesh2,
                                                                                            fast_axis="fast")
    sp, ss = parallel.replicate(init, mesh, specs=TWO_DIMS), parallel.init_worker_state(tx, init, mesh,
                                                                                         specs=TWO_DIMS)
    replicated = parallel.data_parallel_step(dropped, tx, mesh2, fast_axis="fast", rng=True)
    step = parallel.data_parallel_step(dropped, tx, mesh, specs=TWO_DIMS, rng=True, donate=True)
    rows = jax.NamedSharding(mesh, P(("data", "fsdp", "tensor")))
    for i, b in enumerate(batches[:3]):
        rp, rs, rl = replicated(rp, rs, parallel.shard_batch(b, mesh2, fast_axis="fast"), jax.random.key(i))
        sp, ss, sl = step(sp, ss, jax.device_put(b, rows), jax.random.key(i))
    assert len(set(np.round(np.asarray(sl), 6))) == SLOW * FAST  # every device its own mask and rows
    np.testing.assert_allclose(np.asarray(sl), np.asarray(rl), rtol=1e-6, atol=1e-6)
    got, want = parallel.gather(sp), parallel.gather(rp)
    for k in want:
        np.testing.assert_allclose(got[k], want[k][::FAST], rtol=1e-6, atol=1e-6, err_msg=k)
    assert sp["w1"].sharding.spec == P("data", "fsdp", "tensor")  # given back in the layout the specs give


@pytest.mark.slow
@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_a_leaf_the_hosts_device_count_divides_in_no_dimension_is_seen_whole(name):
    """``w2`` (6, 16) sharded ``P('fsdp', 'tensor')``: 4 divides its columns, so the optimizer sees it cut along them;
    ``w1`` (6, 6) sharded ``P('fsdp', 'tensor')``: 4 divides neither dimension, so the optimizer sees it whole
    (every device of the host holds it) and the compressor's payload is still split over the host.  Five steps
    equal the replicated 2-D layout (1e-6), ``payload_bytes`` and the slow-link bytes included."""
    init, batches = battery_problem()
    rng = np.random.default_rng(5)
    init = dict(init, w1=jnp.asarray(rng.normal(size=(6, 6)) * 0.3, jnp.float32), b1=jnp.zeros(6),
                w2=jnp.asarray(rng.normal(size=(6, 16)) * 0.3, jnp.float32))

    def shaped(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean(((h @ p["w2"])[:, 5:8] + p["b2"] + p["s"] - y) ** 2)

    specs = {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("fsdp", "tensor"), "b2": P(), "s": P()}
    dims, view = parallel.placement.shard_view([init[k] for k in sorted(init)], [specs[k] for k in sorted(init)],
                                               ("fsdp", "tensor"), mesh3())
    assert dict(zip(sorted(init), dims)) == {"b1": None, "b2": None, "s": None, "w1": None, "w2": 1}, dims
    assert view[sorted(init).index("w2")] == P(None, ("fsdp", "tensor")) and view[sorted(init).index("w1")] == P()
    tx = optax.chain(CASES[name].make(axis_name="data"), optax.sgd(0.1))
    mesh, mesh2 = mesh3(), parallel.make_2d_mesh(SLOW, FAST)
    rp, rs = parallel.replicate(init, mesh2, fast_axis="fast"), parallel.init_worker_state(tx, init, mesh2,
                                                                                            fast_axis="fast")
    sp, ss = parallel.replicate(init, mesh, specs=specs), parallel.init_worker_state(tx, init, mesh, specs=specs)
    replicated = parallel.data_parallel_step(shaped, tx, mesh2, fast_axis="fast")
    step = parallel.data_parallel_step(shaped, tx, mesh, specs=specs)
    rows = jax.NamedSharding(mesh, P(("data", "fsdp", "tensor")))
    for b in batches:
        rp, rs, _ = replicated(rp, rs, parallel.shard_batch(b, mesh2, fast_axis="fast"))
        sp, ss, _ = step(sp, ss, jax.device_put(b, rows))
    got, want = parallel.gather(sp), parallel.gather(rp)
    for k in want:
        np.testing.assert_allclose(got[k], want[k][::FAST], rtol=1e-6, atol=1e-6, err_msg=k)
    sent = np.asarray(cj.payload_bytes(ss))
    np.testing.assert_array_equal(sent, np.asarray(cj.payload_bytes(rs)))
    counted = cj.accounting.bytes_by_axes(cj.audit_collectives(step, sp, ss, jax.device_put(batches[0], rows)), mesh)
    assert counted.get(("data",), 0) * FAST == int(sent[0]), (counted, sent)


@pytest.mark.slow
def test_a_state_laid_out_as_the_optimizer_sees_it_is_kept_so():
    """An optimizer state laid out as the optimizer sees the parameters (``init_worker_state(specs=)`` with
    ``shard_view``'s specs: one dimension over both fast axes) is kept so by the step: three donated steps give
    it back in that layout after one compile, with the numbers of the state laid out by the parameters' specs
    (1e-6), and the program re-lays out only the parameters and gradients inside the host, not the state."""
    init, batches = battery_problem()
    mesh, names = mesh3(), sorted(init)
    _, view = parallel.placement.shard_view([init[k] for k in names], [TWO_DIMS[k] for k in names],
                                            ("fsdp", "tensor"), mesh)
    view = dict(zip(names, view))
    assert view["w1"] == P(None, ("fsdp", "tensor")) and TWO_DIMS["w1"] == P("fsdp", "tensor")
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.adam(0.01))
    rows = jax.NamedSharding(mesh, P(("data", "fsdp", "tensor")))
    out = {}
    for name, state_specs in (("params", TWO_DIMS), ("view", view)):
        p = parallel.replicate(init, mesh, specs=TWO_DIMS)
        s = parallel.init_worker_state(tx, init, mesh, specs=state_specs)
        given = [x.sharding for x in jax.tree.leaves(s)]
        step = parallel.data_parallel_step(loss, tx, mesh, specs=TWO_DIMS, donate=True)
        hlo = step.lower(p, s, jax.device_put(batches[0], rows)).compile().as_text()
        for b in batches[:3]:
            p, s, losses = step(p, s, jax.device_put(b, rows))
        assert step._cache_size() == 1, name
        assert all(x.sharding.is_equivalent_to(g, x.ndim) for x, g in zip(jax.tree.leaves(s), given)), name
        moved = sum(hlo.count(f" {op}(") for op in ("all-to-all", "collective-permute", "all-gather"))
        out[name] = (parallel.gather(p), np.asarray(losses), moved)
    for k in init:
        np.testing.assert_allclose(out["view"][0][k], out["params"][0][k], rtol=1e-6, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(out["view"][1], out["params"][1], rtol=1e-6, atol=1e-6)
    assert out["view"][2] < out["params"][2], (out["view"][2], out["params"][2])


# --- the optimizer on the specs' own layout: compressors that work on shards cut any way ------------------------------

def test_any_cut_compressors_see_leaves_in_the_specs_layout_and_a_cut_maps_its_pieces():
    """With an optimizer whose compressors work on shards cut any way (``chains.works_on_any_cut``: dense, casts,
    sign, 2-bit, E3M0, and DiLoCo around them), ``shard_view(own=True)`` keeps a leaf sharded over both fast axes as
    its specs lay it out (``w1``: ``P('fsdp', 'tensor')``, a ``layout.Cut``), and still cuts a leaf over one of the
    two along one dimension over both (``w2``); top-k, PowerSGD and SparseLoCo's chunk top-k need one-dimensional
    shards.  Inside the host a ``Cut`` maps its pieces: every device's piece of a (4, 6) array is the block its
    (fsdp, tensor) index names, ``whole_shape`` is the array's, ``gather_inside_host`` gives the array back whole and
    ``own`` of it the piece again."""
    from compjax import collectives, layout
    from compjax.compressors.chains import works_on_any_cut

    sgd = optax.sgd(0.1)
    assert all(works_on_any_cut(optax.chain(CASES[n].make(axis_name="data"), sgd))
               for n in ("identity", "cast_bf16", "cast_f16", "signsgd", "twobit", "e3m0", "diloco", "streaming_diloco"))
    assert not any(works_on_any_cut(optax.chain(CASES[n].make(axis_name="data"), sgd))
                   for n in ("topk", "randomk", "dgc", "powersgd", "onebit", "qsgd", "terngrad", "chunktopk",
                             "sparseloco", "demo", "delayed_averaging"))
    init, _ = battery_problem()
    names, mesh = sorted(init), mesh3()
    leaves, specs = [init[k] for k in names], [TWO_DIMS[k] for k in names]
    dims, view = (dict(zip(names, x)) for x in parallel.placement.shard_view(leaves, specs, ("fsdp", "tensor"), mesh,
                                                                              own=True))
    assert dims["w1"] == layout.Cut(("fsdp", "tensor")) and view["w1"] == P("fsdp", "tensor")
    assert dims["b1"] == 0 and view["b1"] == P(("fsdp", "tensor"))  # already one dimension over both
    assert dims["w2"] == 0 and view["w2"] == P(("fsdp", "tensor"))  # over tensor only: cut over both
    assert dims["b2"] is None and view["b2"] == P()
    assert parallel.placement.shard_view(leaves, specs, ("fsdp", "tensor"), mesh)[0][names.index("w1")] == 1

    x = jnp.arange(24.0).reshape(4, 6)
    cut = layout.Cut(("fsdp", "tensor"))

    def per_device(piece, whole):
        sh = layout.Shards(("fsdp", "tensor"), (cut,))
        assert sh.whole_shape(piece, 0) == (4, 6)
        gathered = collectives.gather_inside_host(piece, ("fsdp", "tensor"), cut)
        return gathered[None], sh.own(whole, 0)

    host = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    fn = jax.jit(jax.shard_map(per_device, mesh=host, in_specs=(P("fsdp", "tensor"), P()),
                               out_specs=(P(("fsdp", "tensor")), P("fsdp", "tensor"))))
    gathered, own = fn(x, x)
    np.testing.assert_array_equal(np.asarray(gathered), np.broadcast_to(np.asarray(x), (4, 4, 6)))
    np.testing.assert_array_equal(np.asarray(own), np.asarray(x))
    with pytest.raises(TypeError, match="several dimensions"):
        layout.Shards(("fsdp", "tensor"), (cut,)).to_whole(jnp.arange(6), (2, 3), 0)
