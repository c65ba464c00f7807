"""Who issued each audited collective, and ``payload_bytes`` equal to the audited compjax bytes for 16-bit leaves.

compjax issues its collectives inside the named scope ``compjax/...``
(``compjax/collectives.py``); the compiled program keeps the scope in its op
metadata and ``audit_collectives`` reads it per operand, also where XLA combines
collectives into one instruction.  A model's own collectives and the gradient
all-reduce XLA's SPMD partitioner inserts into an auto-sharded ``jax.jit`` step
read as not issued by compjax.  Narrow floats travel through all-gathers bitcast
to unsigned integers, so no backend widens them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import accounting, collectives, parallel
from tests.helpers import AXIS
from tests.registry import CASES

N = 8
SHAPES = {"a": (6, 5), "b": (40,)}
#: One compressor instance per dtype in the same program, each in a named scope of its own (float32: the battery).
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
COMPRESSORS = ["identity", "cast_bf16", "topk", "randomk", "dgc", "powersgd", "onebit", "twobit", "qsgd",
               "terngrad", "signsgd", "e3m0"]


def per_worker(fn, mesh):
    """``jit(shard_map(fn))``: ``fn`` sees one worker's slices, every input and output is worker-stacked."""

    def body(*args):
        return jax.tree.map(lambda x: x[None], fn(*jax.tree.map(lambda x: x[0], args)))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def put(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P(AXIS)))


def scoped_bytes(ops, tag):
    """Audited compjax bytes of the operands traced inside ``jax.named_scope(tag)``."""
    return sum(accounting._array_bytes(d, s) for op in ops for (d, s), scope, who in
               zip(op.operands, op.scopes, op.issuers) if who == "compjax" and f"/{tag}/" in scope)


#: The fast tier: one compressor per wire path of collectives.py (dense mean, sparse mean, gathered payload,
#: PowerSGD's factors); the others, each compiled for two dtypes (~5 s each on 2 loaded cores), in the full tier.
FAST_16_BIT = ("cast_bf16", "topk", "onebit", "powersgd")


@pytest.mark.parametrize("name", [n if n in FAST_16_BIT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in [*COMPRESSORS, "cast_f16"]])
def test_payload_bytes_equal_audited_compjax_bytes_for_16_bit_leaves(mesh, name):
    case = CASES[name]
    txs = {tag: case.make(AXIS, **case.one_path) for tag in DTYPES}
    params = {tag: {k: jnp.zeros(s, d) for k, s in SHAPES.items()} for tag, d in DTYPES.items()}
    rng = np.random.default_rng(0)
    grads = {tag: {k: rng.normal(size=(N, *s)).astype(d) for k, s in SHAPES.items()} for tag, d in DTYPES.items()}
    states = {tag: jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), txs[tag].init(params[tag])) for tag in DTYPES}

    def step(grads, states):
        out = {}
        for tag in DTYPES:
            with jax.named_scope(tag):
                out[tag] = txs[tag].update(grads[tag], states[tag], params[tag])
        return out

    f = per_worker(step, mesh)
    args = (put(grads, mesh), put(states, mesh))
    ops = cj.audit_collectives(f, *args)
    out = jax.block_until_ready(f(*args))
    assert ops and all(op.by_compjax for op in ops), accounting.format_collectives(ops)
    for tag, dtype in DTYPES.items():
        updates, state = out[tag]
        assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
        reported = np.asarray(cj.payload_bytes(state))
        assert np.all(reported == reported[0]) and reported[0] > 0
        assert int(reported[0]) == scoped_bytes(ops, tag), (tag, accounting.format_collectives(ops))
    want = {"compjax": sum(scoped_bytes(ops, t) for t in DTYPES), "compjax-uncounted": 0, "other": 0}
    assert accounting.bytes_by_issuer(ops) == want


NARROW = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_every_collective_path_counts_the_bytes_it_sends(mesh, dtype):
    """dense mean, max, sparse mean and gathered mean of narrow floats: counted bytes == audited bytes, exact results."""
    rng = np.random.default_rng(1)
    # Every partial sum of 8 values in {-4, 0, 4} is a multiple of 4 up to 32: exact even in float8_e5m2.
    x = rng.choice([-4.0, 0.0, 4.0], size=(N, 5)).astype(dtype)
    idx = np.stack([np.array([w, N + w], np.int32) for w in range(N)])  # distinct indices: no duplicate adds

    def step(x, idx):
        dense, b1 = collectives.dense_mean(x, AXIS)
        top, b2 = collectives.max_over_workers(x, AXIS)
        sparse, b3 = collectives.sparse_mean(idx, x[:2], 2 * N, AXIS)
        (gathered,), b4 = collectives.gathered_mean((x,), lambda p: [p], AXIS)
        return dense, top, sparse, gathered, jnp.asarray([b1, b2, b3, b4])

    f = per_worker(step, mesh)
    args = (put(x, mesh), put(idx, mesh))
    ops = cj.audit_collectives(f, *args)
    dense, top, sparse, gathered, counted = jax.block_until_ready(f(*args))
    assert int(counted[0].sum()) == sum(op.compjax_bytes for op in ops) == sum(op.bytes for op in ops)
    bits = jnp.finfo(dtype).bits
    wire = {16: "u16", 8: "u8"}[bits]
    assert sorted(op.dtype for op in ops if op.op == "all-gather") == sorted([wire, wire, "s32"])
    assert {op.scopes[0].split("compjax/")[1].split("/")[0] for op in ops} == {
        "dense_mean", "max", "sparse_mean", "gathered_mean"}
    xf = x.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(dense[0], np.float32), xf.mean(0))
    np.testing.assert_array_equal(np.asarray(top[0], np.float32), xf.max(0))
    want = np.zeros(2 * N, np.float32)
    want[idx.ravel()] = xf[:, :2].ravel() / N
    np.testing.assert_array_equal(np.asarray(sparse[0], np.float32), want)
    np.testing.assert_array_equal(np.asarray(gathered[0]), xf.mean(0))


# --- who issued it ------------------------------------------------------------------------------------


def test_a_model_pmean_is_listed_as_not_compjax_and_not_counted(mesh):
    """A synchronized BatchNorm (pmean of batch statistics over the worker axis) inside the loss."""
    params = {"w": jnp.zeros((6, 12)), "scale": jnp.ones(12)}

    def loss(p, x):
        h = x @ p["w"]
        mu = jax.lax.pmean(h.mean(0), AXIS)  # the model's own collective (and its transpose in the backward pass)
        return jnp.mean(((h - mu) * p["scale"] - 1.0) ** 2)

    tx = optax.chain(cj.topk(0.25, axis_name=AXIS), optax.sgd(0.1))
    step = parallel.data_parallel_step(loss, tx, mesh)
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    x = parallel.shard_batch(jnp.asarray(np.random.default_rng(2).normal(size=(4 * N, 6)), jnp.float32), mesh)
    ops = cj.audit_collectives(step, p, s, x)
    p, s, _ = jax.block_until_ready(step(p, s, x))
    split = accounting.bytes_by_issuer(ops)
    assert int(cj.payload_bytes(s)[0]) == split["compjax"] > 0
    model = [(d, sh) for op in ops for (d, sh), who in zip(op.operands, op.issuers) if who is None]
    assert ("f32", (12,)) in model  # the batch mean's all-reduce
    assert split["other"] == sum(accounting._array_bytes(d, sh) for d, sh in model) >= 12 * 4
    assert split["compjax"] + split["other"] == sum(op.bytes for op in ops)
    lines = accounting.format_collectives(ops).splitlines()
    assert any(" not compjax " in ln or " mixed " in ln for ln in lines[:-1])
    assert lines[-1].startswith(f"compjax: {split['compjax']:,} B in ")


def test_auto_sharded_jit_step_shows_a_dense_all_reduce_not_issued_by_compjax(mesh):
    """jax.jit over replicated params and a batch sharded over the workers: XLA all-reduces the gradients itself."""
    params = {"w": jnp.zeros((6, 12)), "b": jnp.zeros(12)}
    tx = optax.chain(cj.topk(0.25), optax.sgd(0.1))  # axis_name=None: compresses nothing that is sent

    @jax.jit
    def step(p, s, x):
        g = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - 1.0) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    replicated = NamedSharding(mesh, P())
    p, s = jax.device_put(params, replicated), jax.device_put(tx.init(params), replicated)
    x = jax.device_put(jnp.ones((4 * N, 6)), NamedSharding(mesh, P(AXIS)))
    # Two warnings: the trace's (the compressor has no worker axis) and the audit's (a dense all-reduce)
    with pytest.warns(UserWarning, match=r"cj.topk has axis_name=None.*nothing is exchanged"), \
            pytest.warns(UserWarning, match=r"crossed the wire densely.*XLA all-reduces the gradients and the "
                                            r"compressor \(axis_name=None\) sends nothing"):
        ops = cj.audit_collectives(step, p, s, x)
    _, s = jax.block_until_ready(step(p, s, x))
    assert int(cj.message_bytes(s)) > 0  # the message top-k would send ...
    assert int(cj.payload_bytes(s)) == 0  # ... is not presented as sent:
    assert accounting.bytes_by_issuer(ops)["compjax"] == 0  # compjax sends nothing
    dense = [(d, sh) for op in ops if op.op == "all-reduce" for (d, sh), who in zip(op.operands, op.issuers)
             if who is None and d == "f32"]
    assert sum(int(np.prod(sh)) for _, sh in dense) >= 6 * 12 + 12  # every gradient entry, densely
    last = accounting.format_collectives(ops).splitlines()[-1]
    assert re.fullmatch(r"compjax: 0 B in 0 collectives; not issued by compjax: [\d,]+ B in \d+ collectives?"
                        r" \(all-reduce\)", last), last


# --- combined collectives: each operand keeps its issuer ------------------------------------------------


@pytest.fixture(scope="module")
def combined_hlo(mesh):
    """Compiled HLO where XLA combined two compjax dense means and a model psum into one all-reduce."""

    def body(x, y, z):
        a, _ = collectives.dense_mean(x[0], AXIS)
        b, _ = collectives.dense_mean(y[0], AXIS)
        c = jax.lax.psum(z[0], AXIS)
        return (a.sum() + b.sum() + c.sum())[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    args = [put(jnp.ones((N, k)), mesh) for k in (10, 7, 3)]
    return f.lower(*args).compile().as_text()


def _expect_mixed(ops):
    assert len(ops) == 1, [op.name for op in ops]
    (op,) = ops
    assert op.issuer == "mixed" and not op.by_compjax
    assert sorted(zip(op.operands, op.issuers), key=str) == sorted(
        [(("f32", (10,)), "compjax"), (("f32", (7,)), "compjax"), (("f32", (3,)), None)], key=str)
    assert op.compjax_bytes == 17 * 4 and accounting.bytes_by_issuer(ops) == {"compjax": 68, "compjax-uncounted": 0, "other": 12}
    assert accounting.format_collectives(ops).splitlines()[-1] == (
        "compjax: 68 B in 1 collective; not issued by compjax: 12 B in 1 collective (all-reduce)")


def _combined_line(text):
    (line,) = [ln for ln in text.splitlines() if re.search(r"= \(.*\) all-reduce\(", ln)]
    return line


def test_combined_all_reduce_is_split_by_operand(combined_hlo):
    line = _combined_line(combined_hlo)
    assert re.search(r'op_name="[^"]*\(.*:.*\)"', line), line  # XLA:CPU names it "prefix/(a:b:c)"
    _expect_mixed(accounting._collectives_of_hlo(combined_hlo))


def test_combined_all_reduce_without_get_tuple_element_metadata(combined_hlo):
    """Only the combined instruction's ``prefix/(a:b:c)`` op name tells the operands apart."""
    lines = [re.sub(r"metadata=\{[^}]*\}", "", ln) if "get-tuple-element(" in ln else ln
             for ln in combined_hlo.splitlines()]
    _expect_mixed(accounting._collectives_of_hlo("\n".join(lines)))


def test_combined_all_reduce_whose_op_name_was_dropped(combined_hlo):
    """XLA versions whose combiners drop the op name: the get-tuple-elements that replaced the originals keep it."""
    line = _combined_line(combined_hlo)
    text = combined_hlo.replace(line, re.sub(r"metadata=\{[^}]*\}", "", line))
    _expect_mixed(accounting._collectives_of_hlo(text))


def test_async_combined_all_reduce_reads_the_done_s_get_tuple_elements(combined_hlo):
    """The async form (``all-reduce-start`` / ``-done``, as on GPU), op name dropped from the start."""
    line = _combined_line(combined_hlo)
    name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line).group(1)
    type_text = re.search(r"= (\(.*?\)) all-reduce\(", line).group(1)
    start = re.sub(r"metadata=\{[^}]*\}", "", line).replace(" all-reduce(", " all-reduce-start(")
    done = f"  %{name}-done = {type_text} all-reduce-done(%{name})"
    text = combined_hlo.replace(line, start + "\n" + done).replace(
        f"get-tuple-element(%{name})", f"get-tuple-element(%{name}-done)")
    ops = accounting._collectives_of_hlo(text)
    assert [op.op for op in ops] == ["all-reduce"]
    _expect_mixed(ops)
