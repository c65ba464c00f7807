"""Quantizing compressors on 8 workers: means vs NumPy, backends agree, bytes vs the compiled step.

Every worker's packed words (and scales) are all-gathered and every worker
decodes all of them, so each worker must end with the mean of the decoded
payloads.  ``payload_bytes`` must equal the operand bytes of the collectives
``audit_collectives`` finds in the jitted data-parallel step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS, VOTE, init_stacked, run_workers
from tests.test_quantizers import np_clip, np_onebit, np_qsgd, np_sign, np_terngrad, np_twobit
from tests.test_random import np_uniform

N = 8
RNG = np.random.default_rng(1)
SHAPES = {"b": (5,), "w": (3, 4, 5)}  # leaf order of jax.tree.flatten: "b" (0), then "w" (1)


def local_grads():
    return {k: RNG.normal(scale=0.6, size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}


def uniforms(key, worker, size, step=0):
    """Worker ``worker``'s draws for all layers (leaf order): elements 0..size-1 of stream(key, step, worker),
    replayed in NumPy from compjax.codecs.random's definition."""
    return np_uniform(np.asarray(jax.random.PRNGKey(key)), step, worker, size)


def split(u, g):
    """Per-leaf slices of one worker's draws, in leaf order."""
    out, off = {}, 0
    for k in sorted(g):
        n = g[k][0].size
        out[k], off = u[off:off + n], off + n
    return out


def reference(name, g):
    """Per-worker decoded payloads (NumPy, from the papers' rules), shape (N, *leaf)."""
    total = sum(g[k][0].size for k in g)
    u = [split(uniforms(7, w, total), g) for w in range(N)]
    out = {}
    if name == "terngrad":
        clipped = {k: np.stack([np_clip(g[k][w], 2.5) for w in range(N)]) for k in g}
        for k in g:
            s = np.abs(clipped[k]).max()  # the scaler shared by all workers: max over workers
            out[k] = np.stack([np_terngrad(clipped[k][w].ravel(), s, u[w][k]).reshape(g[k][w].shape)
                               for w in range(N)])
        return out
    for k in g:
        dec = []
        for w in range(N):
            x = g[k][w]
            if name == "onebit":
                dec.append(np_onebit(x))
            elif name == "twobit":
                dec.append(np_twobit(x, 0.5))
            elif name == "signsgd":
                dec.append(np_sign(x))
            elif name == "qsgd":
                dec.append(np_qsgd(x.ravel(), 16, u[w][k]).reshape(x.shape))
        out[k] = np.stack(dec)
    return out


MAKERS = {
    "onebit": lambda: cj.onebit(axis_name=AXIS),
    "twobit": lambda: cj.twobit(0.5, axis_name=AXIS),
    "terngrad": lambda: cj.terngrad(key=7, axis_name=AXIS),
    "qsgd": lambda: cj.qsgd(16, key=7, axis_name=AXIS),
    "signsgd": lambda: cj.signsgd(axis_name=AXIS),
}


@pytest.mark.parametrize(
    "name,backend",
    [(name, "shard_map") for name in MAKERS] + [pytest.param("terngrad", b, marks=pytest.mark.slow) for b in ("pmap", "vmap")]
)
def test_mean_over_workers_matches_numpy(mesh, name, backend):
    """Every worker ends with the mean of all workers' decoded payloads; shard_map, pmap and vmap agree."""
    tx = MAKERS[name]()
    g = local_grads()
    s0 = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, N)
    out, state = run_workers(tx, g, s0, backend, mesh)
    dec = reference(name, g)
    for k in g:
        for w in range(N):  # the same mean on every worker
            np.testing.assert_allclose(out[k][w], dec[k].mean(0), rtol=1e-5, atol=1e-6)
        if name in ("onebit", "twobit", "signsgd"):  # each worker keeps its own remainder
            np.testing.assert_allclose(state.residual[k], g[k] - dec[k], rtol=1e-5, atol=1e-6)
    nbytes = cj.payload_bytes(state)
    assert np.all(nbytes == nbytes[0]) and nbytes[0] > VOTE


def test_fp16_cast_does_not_overflow_in_the_sum(mesh):
    g = {"w": np.full((N, 4), 60000.0, np.float32)}  # 8 x 60000 overflows float16 (max 65504)
    tx = cj.cast(jnp.float16, axis_name=AXIS)
    out, st = run_workers(tx, g, init_stacked(tx, {"w": jnp.zeros(4)}, N), "shard_map", mesh)
    np.testing.assert_allclose(out["w"], 60000.0, rtol=1e-3)
    assert int(cj.payload_bytes(st)[0]) == 4 * 2 + VOTE


# --- bytes: payload_bytes equals the compiled step's collectives ------------------------------

#: a CNN-like tree (flax layout) of 8 leaves, each a multiple of 16 parameters (5,088 in all)
AUDIT_SHAPES = {
    "conv1": {"kernel": (3, 3, 1, 16), "bias": (16,)},
    "conv2": {"kernel": (3, 3, 16, 16), "bias": (16,)},
    "dense1": {"kernel": (64, 32), "bias": (32,)},
    "dense2": {"kernel": (32, 16), "bias": (16,)},
}


def audit_params():
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (0.1 * rng.normal(size=s)).astype(np.float32), AUDIT_SHAPES,
                        is_leaf=lambda s: isinstance(s, tuple))


def audit_loss(p, batch):
    """Cheap to compile: the kernels used as matrices (conv taps flattened), a 4-layer MLP on 9 features."""
    x, y = batch
    h = jax.nn.relu(x @ p["conv1"]["kernel"].reshape(9, 16) + p["conv1"]["bias"])
    h = jax.nn.relu(jnp.tile(h, (1, 9)) @ p["conv2"]["kernel"].reshape(144, 16) + p["conv2"]["bias"])
    h = jax.nn.relu(jnp.tile(h, (1, 4)) @ p["dense1"]["kernel"] + p["dense1"]["bias"])
    logits = h @ p["dense2"]["kernel"] + p["dense2"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# name -> (factory, expected collectives as (op, dtype))
AUDITED = {
    "onebit": (lambda: cj.onebit(axis_name=AXIS), [("all-gather", "f32"), ("all-gather", "u32")]),
    "twobit": (lambda: cj.twobit(0.01, axis_name=AXIS), [("all-gather", "u32")]),
    "terngrad": (lambda: cj.terngrad(key=0, axis_name=AXIS), [("all-gather", "u32"), ("all-reduce", "f32")]),
    "qsgd": (lambda: cj.qsgd(256, key=0, axis_name=AXIS), [("all-gather", "f32"), ("all-gather", "u32")]),
    "signsgd": (lambda: cj.signsgd(axis_name=AXIS), [("all-gather", "f32"), ("all-gather", "u32")]),
    "cast_f16": (lambda: cj.cast(jnp.float16, axis_name=AXIS), [("all-reduce", "f16")]),
    "cast_bf16": (lambda: cj.cast(jnp.bfloat16, axis_name=AXIS), [("all-gather", "u16")]),
}


@pytest.mark.parametrize("name", [n if n in ("twobit", "cast_bf16")
                                  else pytest.param(n, marks=pytest.mark.slow)
                                  for n in AUDITED])
def test_payload_bytes_equals_audited_bytes(mesh, name):
    params = audit_params()
    assert len(jax.tree.leaves(params)) >= 6
    make, expected = AUDITED[name]
    tx = optax.chain(make(), optax.sgd(0.05, momentum=0.9))
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    rng = np.random.default_rng(1)
    batch = parallel.shard_batch((rng.normal(size=(64, 9)).astype(np.float32), rng.integers(0, 16, 64)), mesh)
    step = parallel.data_parallel_step(audit_loss, tx, mesh)
    ops = cj.audit_collectives(step, p, s, batch)
    p, s, loss = jax.block_until_ready(step(p, s, batch))
    assert np.all(np.isfinite(np.asarray(loss)))
    # O(1) collectives whatever the number of leaves: exactly the bucketed payload buffers and the vote.
    assert sorted((o.op, o.dtype) for o in ops) == sorted(expected + [("all-reduce", "s32")])
    audited = sum(o.bytes for o in ops)
    assert np.all(np.asarray(cj.payload_bytes(s)) == audited)
    if name == "twobit":  # every layer a multiple of 16 parameters: exactly 16x fewer bytes than identity
        assert 16 * (audited - VOTE) == 4 * sum(x.size for x in jax.tree.leaves(params))  # (identity: 4 bytes each)


def payload_of(tx, params):
    """The message size of one update on one worker (nothing is sent: message_bytes)."""
    return int(cj.message_bytes(jax.jit(tx.update)(params, tx.init(params))[1]))


@pytest.mark.slow
def test_ratios_on_the_main_job_cnn():
    """twobit exactly 16x on sizes divisible by 16; onebit and signsgd >= 28x on the main job's CNN."""
    sizes16 = {"a": jnp.zeros((16, 16)), "b": jnp.zeros((3, 3, 16, 32)), "c": jnp.zeros(48)}
    assert 4 * sum(x.size for x in jax.tree.leaves(sizes16)) == 16 * payload_of(cj.twobit(), sizes16)
    from experiments import models

    shapes = jax.eval_shape(lambda: models.build(0)[0])  # the main job's CNN, 206,922 parameters
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    leaves = jax.tree.leaves(params)
    dense = 4 * sum(x.size for x in leaves)
    words = sum(-(-x.size // 32) for x in leaves)  # each layer's signs start at a word boundary
    cols = sum(x.shape[-1] if x.ndim >= 2 else 1 for x in leaves)
    for tx, scales in ((cj.onebit(), 2 * cols), (cj.signsgd(), len(leaves))):
        nbytes = payload_of(tx, params)
        assert nbytes == 4 * (words + scales)  # packed signs + float32 scales
        assert dense / nbytes >= 28
