"""payload_bytes equals the bytes of the compiled step's collectives, and the step has O(1) of them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import accounting, parallel
from tests.helpers import AXIS, VOTE


def init_params(key=0):
    k = jax.random.split(jax.random.PRNGKey(key), 8)
    return {
        "conv1": {"kernel": jax.random.normal(k[0], (3, 3, 1, 8)) * 0.3, "bias": jnp.zeros(8)},
        "conv2": {"kernel": jax.random.normal(k[1], (3, 3, 8, 16)) * 0.1, "bias": jnp.zeros(16)},
        "dense1": {"kernel": jax.random.normal(k[2], (64, 32)) * 0.1, "bias": jnp.zeros(32)},
        "dense2": {"kernel": jax.random.normal(k[3], (32, 10)) * 0.1, "bias": jnp.zeros(10)},
    }


def loss_fn(p, batch):
    x, y = batch
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["conv1"]["kernel"], (2, 2), "SAME", dimension_numbers=dn)
                    + p["conv1"]["bias"])
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["conv2"]["kernel"], (2, 2), "SAME", dimension_numbers=dn)
                    + p["conv2"]["bias"])
    h = h.reshape(h.shape[0], -1)  # (B, 2*2*16)
    h = jax.nn.relu(h @ p["dense1"]["kernel"] + p["dense1"]["bias"])
    logits = h @ p["dense2"]["kernel"] + p["dense2"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch_data(mesh, n=64):
    k = jax.random.PRNGKey(1)
    x = jax.random.normal(k, (n, 8, 8, 1))
    y = jax.random.randint(k, (n,), 0, 10)
    return parallel.shard_batch((x, y), mesh)


COMPRESSORS = {
    "identity": lambda: cj.identity(axis_name=AXIS),
    "topk": lambda: cj.topk(0.05, axis_name=AXIS),
    "powersgd": lambda: cj.powersgd(rank=2, axis_name=AXIS),
    "randomk": lambda: cj.randomk(0.05, key=0, axis_name=AXIS),
    "dgc": lambda: cj.dgc(0.05, clip_norm=1.0, axis_name=AXIS),
}


@pytest.mark.parametrize("name", [n if n == "dgc" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in COMPRESSORS])
def test_payload_bytes_equals_audited_bytes(mesh, name):
    params = init_params()
    assert len(jax.tree.leaves(params)) >= 6
    tx = optax.chain(COMPRESSORS[name](), optax.sgd(0.05, momentum=0.9))
    p = parallel.replicate(params, mesh)
    s = parallel.init_worker_state(tx, params, mesh)
    batch = batch_data(mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    ops = cj.audit_collectives(step, p, s, batch)
    p, s, loss = jax.block_until_ready(step(p, s, batch))
    reported = np.asarray(cj.payload_bytes(s))
    assert reported.shape == (mesh.shape[AXIS],) and np.all(reported == reported[0])
    assert int(reported[0]) == sum(op.bytes for op in ops) > 0
    # Only the compressor's collectives (and its non-finite vote), O(1) of them whatever the number of leaves.
    assert 2 <= len(ops) <= 4
    assert sum(op.op == "all-reduce" and op.operands == (("s32", ()),) for op in ops) == 1  # the vote
    assert all(op.by_compjax for op in ops), [op.scopes for op in ops]  # issued in the compjax/... scope
    assert np.all(np.isfinite(np.asarray(loss)))


@pytest.mark.slow  # compiles and audits several steps (about 20 s)
def test_compression_shows_in_audited_bytes(mesh):
    params = init_params()
    batch = batch_data(mesh)
    audited = {}
    for name, make in COMPRESSORS.items():
        tx = optax.chain(make(), optax.sgd(0.05))
        step = parallel.data_parallel_step(loss_fn, tx, mesh)
        ops = cj.audit_collectives(step, parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh),
                                   batch)
        audited[name] = sum(op.bytes for op in ops)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert audited["identity"] == 4 * n_params + VOTE
    assert audited["topk"] < audited["identity"] / 5
    assert audited["randomk"] == audited["topk"] == audited["dgc"]  # same k per layer, 8 bytes per entry
    assert audited["powersgd"] < audited["identity"] / 2


def test_replicated_params_would_add_a_dense_all_reduce(mesh):
    """The trap the parallel helpers avoid: grads of P() params come back all-reduced by JAX."""
    from jax.sharding import PartitionSpec as P

    params = init_params()

    def body(p, batch):
        return jax.grad(loss_fn)(p, batch)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))
    ops = cj.audit_collectives(f, params, batch_data(mesh))
    # XLA may rewrite some of them (e.g. reduce a smaller operand of a dense layer's grad),
    # but the conv kernels' gradients travel whole through a dense all-reduce.
    operands = [o for op in ops if op.op == "all-reduce" for o in op.operands]
    assert ("f32", (3, 3, 8, 16)) in operands and ("f32", (3, 3, 1, 8)) in operands
    # ... and the audit says who inserted them: not compjax.
    assert all(op.issuer is None for op in ops) and accounting.bytes_by_issuer(ops)["compjax"] == 0


def test_payload_bytes_walks_chained_state():
    params = {"w": jnp.zeros((10, 10)), "b": jnp.zeros(10)}
    tx = optax.chain(cj.topk(0.1), optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    assert int(cj.payload_bytes(state)) == 0
    _, state = tx.update({"w": jnp.ones((10, 10)), "b": jnp.ones(10)}, state, params)
    assert int(cj.message_bytes(state)) == (10 + 1) * (4 + 4)  # k = 10 and 1; int32 index + f32 value
    assert int(cj.payload_bytes(state)) == 0  # axis_name=None: one worker, nothing was sent
    with pytest.raises(ValueError, match="no compressor state"):
        cj.payload_bytes(optax.sgd(0.1).init(params))


def test_audit_reads_operand_bytes_of_all_gather(mesh):
    from jax.sharding import PartitionSpec as P

    def body(x):
        return jax.lax.all_gather(x[0].astype(jnp.float16), AXIS)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    x = jax.device_put(jnp.zeros((8, 5, 3)), jax.sharding.NamedSharding(mesh, P(AXIS)))
    ops = cj.audit_collectives(f, x)
    assert [(op.op, op.dtype, op.bytes) for op in ops] == [("all-gather", "f16", 5 * 3 * 2)]


def test_collective_axes_read_permute_pairs_and_the_mesh_form_of_replica_groups():
    """A collective-permute's source_target_pairs are its groups (a shift along the slow axis crosses only it);
    the ``mesh[...] {axes}`` form XLA's partitioner writes reads as the groups along those axes."""
    mesh = parallel.make_2d_mesh(2, 4)
    shift = jax.shard_map(lambda x: jax.lax.ppermute(x, "data", [(0, 1), (1, 0)]), mesh=mesh,
                          in_specs=jax.P("data", "fast"), out_specs=jax.P("data", "fast"))
    ops = cj.audit_collectives(jax.jit(shift), jnp.ones((2, 4)))
    (op,) = [o for o in ops if o.op == "collective-permute"]
    assert sorted(op.replica_groups) == [(0, 4), (1, 5), (2, 6), (3, 7), (4, 0), (5, 1), (6, 2), (7, 3)]
    assert accounting.collective_axes(op, mesh) == ("data",)
    text = "all-gather(f32[4] %p), replica_groups=mesh['a'=2,'b'=1,'c'=4] {'a'}, dimensions={0}"
    (ag,) = accounting._collectives_of_hlo(f"%ag = f32[8]{{0}} {text}\n")
    assert ag.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
