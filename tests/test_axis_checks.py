"""Axis and layout mistakes a compressor refuses at trace time with a named ValueError: a tuple ``axis_name`` with a
name no enclosing ``shard_map``/``vmap`` binds, and a compressor that sees part of the gradient tree (inside
``optax.masked``) while the parameters are sharded (``specs=``)."""

from __future__ import annotations

import re

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

SLOW, FAST = 2, 4


def _per_worker(tx, mesh, axes):
    """``jit(shard_map(update))`` with every input and output stacked over ``axes`` (one worker per device)."""

    def body(g, s):
        out, s = tx.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s))
        return jax.tree.map(lambda x: x[None], (out, s))

    spec = P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))), spec


@pytest.mark.parametrize("names", [(AXIS, "model"), ("model", AXIS), ("model", "batch")], ids="+".join)
@pytest.mark.parametrize("make", [lambda a: cj.topk(0.5, axis_name=a), lambda a: cj.identity(a)],
                         ids=["topk", "identity"])
def test_a_tuple_axis_name_with_an_unbound_name_is_refused_by_name(mesh, names, make):
    """Every name of a tuple is checked, wherever the unbound one stands: the ValueError names the compressor, the
    tuple and the axes bound here, under shard_map and under vmap."""
    tx = make(names)
    n = mesh.shape[AXIS]
    g = {"w": np.ones((n, 6), np.float32)}
    s = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init({"w": jnp.ones(6)}))
    f, spec = _per_worker(tx, mesh, AXIS)
    want = r"cj\.(topk|identity) has " + re.escape(
        f"axis_name={names!r}, which is not an axis of this step: the axes bound here are ({AXIS!r},)")
    with pytest.raises(ValueError, match=want):
        f(jax.device_put(g, NamedSharding(mesh, spec)), jax.device_put(s, NamedSharding(mesh, spec)))
    with pytest.raises(ValueError, match="which is not an axis of this step"):
        jax.vmap(tx.update, axis_name=AXIS)(g, s)


def test_a_tuple_axis_name_of_bound_names_averages_over_both():
    """The positive case: on a 2 x 4 mesh, ``axis_name=("data", "fast")`` averages over all 8 devices."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    tx = cj.identity((AXIS, "fast"))
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=(SLOW * FAST, 5)).astype(np.float32)}
    s = jax.tree.map(lambda x: np.stack([np.asarray(x)] * SLOW * FAST), tx.init({"w": jnp.ones(5)}))
    f, spec = _per_worker(tx, mesh, (AXIS, "fast"))
    out, _ = f(jax.device_put(g, NamedSharding(mesh, spec)), jax.device_put(s, NamedSharding(mesh, spec)))
    np.testing.assert_allclose(np.asarray(out["w"]), np.broadcast_to(g["w"].mean(0), g["w"].shape), rtol=1e-6)


def _sharded_setup(tx):
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "b": jnp.zeros(4)}
    specs = parallel.fsdp_specs(params, mesh, min_size=1)
    assert specs == {"w": P("fast", None), "b": P("fast")}  # both leaves sharded
    p = parallel.replicate(params, mesh, specs=specs)
    s = parallel.init_worker_state(tx, params, mesh, specs=specs)
    x = rng.normal(size=(4 * SLOW * FAST, 8)).astype(np.float32)
    batch = parallel.shard_batch((x, x @ rng.normal(size=(8, 4)).astype(np.float32)), mesh, fast_axis="fast")
    step = parallel.data_parallel_step(lambda p, b: jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2), tx, mesh,
                                       specs=specs)
    return step, p, s, batch


@pytest.mark.parametrize("wrap", ["masked", "multi_transform"])
def test_a_compressor_that_sees_part_of_a_sharded_tree_is_refused(wrap):
    """Under specs=, a compressor inside optax.masked / multi_transform sees another tree than the step's gradients:
    its shards' dimensions cannot be matched to its leaves, so the step refuses it, naming the compressor and the
    fix (put it first in the chain)."""
    comp = cj.topk(0.5, axis_name=AXIS)
    if wrap == "masked":
        inner = optax.masked(comp, {"w": True, "b": False})
    else:
        inner = optax.multi_transform({"c": comp, "id": optax.identity()}, {"w": "c", "b": "id"})
    step, p, s, batch = _sharded_setup(optax.chain(inner, optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"cj\.topk runs on sharded parameters .*must see the whole gradient tree"):
        step(p, s, batch)


def test_the_same_compressor_first_in_the_chain_runs_on_sharded_parameters():
    """The positive case of the refusal above: the compressor first, on the whole tree, trains."""
    step, p, s, batch = _sharded_setup(optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1)))
    p2, s2, loss = step(p, s, batch)
    assert np.isfinite(np.asarray(loss)).all() and int(cj.payload_bytes(s2)[0]) > 0
    assert not np.allclose(np.asarray(p2["w"]), np.asarray(p["w"]))
