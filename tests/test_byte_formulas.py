"""Byte formulas against what is measured: ``chunktopk_bytes`` against ``payload_bytes`` and the audited compiled
program for every value format, and the audit's ``compjax_bytes`` against ``payload_bytes`` where compjax also issues
collectives that no compressor counts (fast-axis means, model state averaged over workers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import accounting, collectives, parallel
from compjax.compressors.chunktopk import VALUE_FORMATS
from tests.helpers import AXIS, VOTE

#: Layers whose tiles differ (full 4 x 4 tiles, a ragged vector, a layer of one tile), float32 and bfloat16 leaves.
SHAPES = {"w": ((8, 12), jnp.float32), "b": ((7,), jnp.float32), "h": ((4, 4), jnp.bfloat16)}
K, CHUNK = 3, 4


def _two_workers():
    return Mesh(np.array(jax.devices()[:2]), (AXIS,))


@pytest.mark.parametrize("values, dct", [(v, False) for v in VALUE_FORMATS] + [("sign", True), ("float16", True)])
def test_chunktopk_bytes_equal_payload_bytes_and_the_audited_program(values, dct):
    """For every value format (quantized, sign, raw float32 / bfloat16 / float16), the documented byte formula is
    what the state counts and what the compiled program's compjax collectives carry, less the 4-byte vote."""
    mesh = _two_workers()
    n = mesh.shape[AXIS]
    tx = cj.chunktopk(K, chunk=CHUNK, dct=dct, values=values, axis_name=AXIS)
    params = {k: jnp.zeros(s, d) for k, (s, d) in SHAPES.items()}

    def body(g, s):
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s))
        return jax.tree.map(lambda x: x[None], (out, s))

    spec = P(AXIS)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))
    rng = np.random.default_rng(0)
    g = put({k: rng.normal(size=(n, *s)).astype(d) for k, (s, d) in SHAPES.items()})
    s = put(jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init(params)))
    ops = cj.audit_collectives(f, g, s)
    _, state = jax.block_until_ready(f(g, s))
    formula = cj.chunktopk_bytes([s for s, _ in SHAPES.values()], K, chunk=CHUNK, dct=dct, values=values)
    audited = accounting.bytes_by_issuer(ops)
    assert audited["other"] == 0 and audited["compjax-uncounted"] == 0
    assert list(cj.payload_bytes(state)) == [formula + VOTE] * n
    assert audited["compjax"] == formula + VOTE, accounting.format_collectives(ops)


@pytest.mark.parametrize("values", VALUE_FORMATS)
def test_chunktopk_bytes_equal_one_workers_message_bytes(values):
    """One worker (no collective, no vote): ``message_bytes`` after a step is the formula, for each value format
    (``payload_bytes`` is 0: nothing crossed a wire)."""
    tx = cj.chunktopk(K, chunk=CHUNK, values=values)
    rng = np.random.default_rng(1)
    g = {k: jnp.asarray(rng.normal(size=s), d) for k, (s, d) in SHAPES.items()}
    _, state = jax.jit(tx.update)(g, tx.init(g))
    assert int(cj.payload_bytes(state)) == 0
    assert int(cj.message_bytes(state)) == cj.chunktopk_bytes([s for s, _ in SHAPES.values()], K, chunk=CHUNK,
                                                             values=values)


def test_raw_values_cost_their_itemsize():
    """Raw kept values: the formula grows by exactly the values' bytes (4 for float32, 2 for the 16-bit floats)
    over the indices alone: the difference between two raw formats is ``n * (4 - 2)`` for ``n`` kept entries."""
    shapes = [s for s, _ in SHAPES.values()]
    f32, bf16, f16 = (cj.chunktopk_bytes(shapes, K, chunk=CHUNK, values=v) for v in ("float32", "bfloat16", "float16"))
    tx = cj.chunktopk(K, chunk=CHUNK, values="float32")
    g = {k: jnp.asarray(np.random.default_rng(2).normal(size=s), jnp.float32) for k, (s, _) in SHAPES.items()}
    out, _ = jax.jit(tx.update)(g, tx.init(g))
    kept = sum(int(np.count_nonzero(np.asarray(x))) for x in jax.tree.leaves(out))  # normal draws: no zero kept
    assert bf16 == f16 and f32 - bf16 == 2 * kept > 0


# --- compjax's uncounted collectives stay out of compjax_bytes ------------------------------------------


def test_compjax_bytes_leave_out_what_compjax_issues_uncounted(mesh):
    """worker_step(average=): the averaged model state is compjax's collective but no compressor's payload; XLA may
    combine it with the compressor's mean and the model's own pmean into one all-reduce.  Per operand, the audit's
    ``compjax_bytes`` are the compressor's alone: equal to ``payload_bytes`` and to ``bytes_by_issuer``'s count."""
    tx = optax.chain(cj.identity(AXIS, skip_nonfinite=False), optax.sgd(0.1))

    @jax.jit
    def step(state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p) ** 2))(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt,
               "stats": state["stats"] + jnp.sum(x)}
        return new, jax.lax.pmean(loss, AXIS)  # a model's own collective

    p0 = jnp.ones(2)
    state = parallel.replicate({"params": p0, "opt": tx.init(p0), "stats": jnp.zeros(3)}, mesh)
    x = jnp.ones((mesh.shape[AXIS], 2))
    wstep = parallel.worker_step(step, mesh, average="stats")
    ops = cj.audit_collectives(wstep, state, x)
    state, _ = wstep(state, x)
    split = accounting.bytes_by_issuer(ops)
    assert split["compjax-uncounted"] == 3 * 4 and split["other"] > 0  # the stats, the loss: both present
    paid = int(cj.payload_bytes(state["opt"])[0])
    assert paid == 2 * 4  # the 2 float32 gradient entries
    assert sum(op.compjax_bytes for op in ops) == split["compjax"] == paid, accounting.format_collectives(ops)


def test_compjax_bytes_of_a_mixed_collective_count_the_compressors_operands_only():
    """A combined all-reduce of a compressor's mean, compjax's uncounted fast-axis mean and a model's psum."""
    scopes = ("jit(step)/shard_map/cj.identity/compjax/dense_mean/psum",
              "jit(step)/shard_map/compjax_uncounted/compjax/dense_mean/psum",
              "jit(step)/shard_map/psum")
    operands = (("f32", (2,)), ("f32", (3,)), ("f32", (1,)))
    op = accounting.Collective("all-reduce", operands, 24, "ar", None, scopes)
    assert op.issuers == ("compjax", "compjax-uncounted", None) and op.issuer == "mixed"
    assert op.compjax_bytes == 2 * 4 == accounting.bytes_by_issuer([op])["compjax"]
    uncounted = accounting.Collective("all-reduce", operands[1:2], 12, "ar2", None, scopes[1:2])
    assert uncounted.issuer == "compjax-uncounted" and uncounted.compjax_bytes == 0 and not uncounted.by_compjax
    assert collectives.UNCOUNTED_SCOPE in scopes[1]
