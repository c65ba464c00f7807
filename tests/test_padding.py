"""Leaves no dimension of which the fast axis size divides, stored padded (``parallel.Padded``) and sharded.

``fsdp_specs`` pads a large such leaf along its largest dimension to the next multiple of the fast size; the
placement helpers store it padded with zeros and read it back logical (``parallel.logical``, ``unreplicate`` and
``gather`` with ``specs=``); ``state_specs`` pads the state leaves shaped like it; the sharded step's loss and
optimizer see the logical leaf; checkpoints hold the logical arrays.  Every registry case on padded leaves against
the replicated 2-D layout is tests/test_shard_collectives.py's (full tier).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from compjax.checkpoint import Checkpointer, signature
from compjax.parallel.placement import checked_leaf_specs, is_padded_array

SLOW, FAST = 2, 4


def _params():
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.normal(size=(6, 10)) * 0.3, jnp.float32), "b1": jnp.asarray(rng.normal(size=10)),
            "w2": jnp.asarray(rng.normal(size=(10, 3)) * 0.3, jnp.float32), "b2": jnp.zeros(3)}


def _loss(p, batch):
    x, y = batch
    assert p["w1"].shape == (6, 10) and p["w2"].shape == (10, 3), "the loss sees the logical leaves"
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def test_fsdp_specs_pads_large_leaves_that_the_fast_size_does_not_divide():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = {"odd": jnp.zeros((30, 10)), "even": jnp.zeros((30, 8)), "bias": jnp.zeros(10), "tie": jnp.zeros((5, 5))}
    specs = parallel.fsdp_specs(params, mesh, min_size=1, pad_min_size=25)
    assert specs["even"] == jax.P(None, "fast")  # a dimension 4 divides: sharded as it is
    # The largest dimension (the first on a tie), padded to the next multiple of 4.
    assert specs["odd"] == parallel.Padded(jax.P("fast", None), (30, 10), (32, 10))
    assert specs["tie"] == parallel.Padded(jax.P("fast", None), (5, 5), (8, 5))
    assert specs["bias"] == jax.P()  # below pad_min_size: whole
    assert parallel.fsdp_specs(params, mesh, min_size=1, pad_min_size=None)["odd"] == jax.P()
    assert parallel.fsdp_specs(params, mesh, min_size=1)["odd"] == jax.P()  # 300 < the default 65536
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="pad_min_size must be None or an int >= 1"):
            parallel.fsdp_specs(params, mesh, pad_min_size=bad)


def test_replicate_stores_zeros_in_the_padding_and_every_reader_gives_the_logical_leaf():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    sp = parallel.replicate(init, mesh, specs=specs)
    assert sp["w1"].shape == (SLOW, 6, 12) and sp["w2"].shape == (SLOW, 12, 3) and sp["b1"].shape == (SLOW, 12)
    assert sp["w1"].addressable_shards[0].data.shape == (1, 6, 3)
    assert not np.any(np.asarray(sp["w1"])[:, :, 10:]) and not np.any(np.asarray(sp["w2"])[:, 10:])
    np.testing.assert_array_equal(np.asarray(sp["w1"])[:, :, :10], np.broadcast_to(init["w1"], (SLOW, 6, 10)))
    one, every = parallel.unreplicate(sp, specs=specs), parallel.gather(sp, specs=specs)
    for k, v in init.items():
        np.testing.assert_array_equal(one[k], v)
        np.testing.assert_array_equal(every[k], np.broadcast_to(v, (SLOW, *v.shape)))
    on_device = parallel.logical(sp["w1"], specs["w1"])  # cut on the devices, placed over the worker axis only
    assert on_device.sharding.spec == jax.P("data")
    np.testing.assert_array_equal(np.asarray(on_device), np.broadcast_to(init["w1"], (SLOW, 6, 10)))
    assert parallel.unreplicate(sp)["w1"].shape == (6, 12)  # without specs: the stored (padded) leaf


def test_padded_specs_are_checked_and_refused_where_a_step_does_not_take_them():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    with pytest.raises(ValueError, match=r"specs\['b1'\] = Padded.*pads its leaf.*pad_min_size=None"):
        checked_leaf_specs(init, specs, mesh, "data")  # the NNX and user-step builders' check
    assert checked_leaf_specs(init, specs, mesh, "data", padded=True)[2] == specs["w1"]
    wrong = {**specs, "w1": parallel.Padded(jax.P(None, "fast"), (6, 10), (6, 16))}
    with pytest.raises(ValueError, match=r"pads dimension 1 to 16: the next multiple of the fast size 4 is 12"):
        parallel.replicate(init, mesh, specs=wrong)
    other = {**specs, "w1": parallel.Padded(jax.P(None, "fast"), (6, 9), (6, 12))}
    with pytest.raises(ValueError, match=r"is for a leaf of shape \(6, 9\).*got \(6, 10\)"):
        parallel.replicate(init, mesh, specs=other)
    with pytest.raises(ValueError, match="shard exactly one dimension"):
        parallel.Padded(jax.P(), (6, 10), (6, 12))
    with pytest.raises(ValueError, match="must equal shape"):
        parallel.Padded(jax.P(None, "fast"), (6, 10), (7, 12))
    with pytest.raises(ValueError, match="must equal shape"):
        parallel.Padded(jax.P(None, "fast"), (6, 10), (6, 8))


def test_state_specs_pads_the_state_leaves_shaped_like_a_padded_parameter():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.adam(0.1))
    sspecs = parallel.state_specs(tx, init, specs, mesh)
    topk, adam = sspecs[0], sspecs[1][0]
    assert topk.residual == specs and adam.mu == specs and adam.nu == specs
    assert topk.count == jax.P() and adam.count == jax.P()
    ss = parallel.init_worker_state(tx, init, mesh, specs=specs)
    assert ss[0].residual["w1"].shape == (SLOW, 6, 12) and ss[1][0].mu["w2"].shape == (SLOW, 12, 3)
    assert ss[0].residual["w1"].addressable_shards[0].data.shape == (1, 6, 3)


@pytest.mark.slow  # compiles a sharded step (4-16 s)
def test_a_sharded_step_on_padded_leaves_equals_the_replicated_layout():
    """Three steps of top-k with error feedback and SGD: the loss sees (6, 10) and (10, 3), the padding stays zero,
    the parameters and payload_bytes equal the replicated 2-D layout's (top-k's k is taken of the logical entries)."""
    from tests.helpers import replicated_and_sharded

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32))
               for _ in range(3)]
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.1))
    (rp, rs), (sp, ss), _ = replicated_and_sharded(_loss, tx, init, specs, batches, mesh)
    got, want = parallel.gather(sp, specs=specs), parallel.gather(rp)
    for k in want:
        np.testing.assert_allclose(got[k], want[k][::FAST], rtol=1e-6, atol=1e-6, err_msg=k)
    np.testing.assert_array_equal(np.asarray(cj.payload_bytes(ss)), np.asarray(cj.payload_bytes(rs)))
    assert not np.any(np.asarray(sp["w1"])[:, :, 10:]) and not np.any(np.asarray(ss[0].residual["w2"])[:, 10:])
    residual = parallel.gather(ss[0].residual, specs=specs)
    np.testing.assert_allclose(residual["w1"], np.asarray(rs[0].residual["w1"])[::FAST], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # compiles a sharded step (4-16 s)
def test_a_checkpoint_holds_the_logical_arrays_and_restores_them_padded(tmp_path):
    """Saved with specs=: the signature's shapes are logical (a padded target without specs is refused by name),
    the restore with specs= gives the saved state back bit for bit, padding included, and a run on a fast axis of
    2 (which divides 10: nothing padded) restores the same logical arrays."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.1))
    params = parallel.replicate(init, mesh, specs=specs)
    opt_state = parallel.init_worker_state(tx, init, mesh, specs=specs)
    batch = parallel.shard_batch((np.ones((16, 6), np.float32), np.zeros((16, 3), np.float32)), mesh, fast_axis="fast")
    params, opt_state, _ = parallel.data_parallel_step(_loss, tx, mesh, specs=specs)(params, opt_state, batch)
    assert is_padded_array(params["w1"]) and not is_padded_array(params["b2"])  # the step's outputs stay known
    state = {"params": params, "opt_state": opt_state}
    both = {"params": specs, "opt_state": parallel.state_specs(tx, init, specs, mesh)}
    assert np.any(np.asarray(opt_state[0].residual["w1"]))  # a residual worth restoring

    def fresh(m, sp):
        return {"params": parallel.replicate(init, m, specs=sp), "opt_state": parallel.init_worker_state(tx, init, m, specs=sp)}

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, specs=both)
        with pytest.raises(ValueError, match=r"residual\['b1'\] is \[\[2, 10\], 'float32'\] .* but \[\[2, 12\], 'float32'\]"):
            ckpt.restore(fresh(mesh, specs))
        restored, _ = ckpt.restore(fresh(mesh, specs), specs=both)
        assert is_padded_array(restored["params"]["w1"]) and is_padded_array(restored["opt_state"][0].residual["b1"])
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(restored)):
            assert a.shape == b.shape and a.sharding == b.sharding, path
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
        small = parallel.make_2d_mesh(SLOW, 2)
        even = parallel.fsdp_specs(init, small, min_size=1, pad_min_size=8)
        assert not any(isinstance(e, parallel.Padded) for e in jax.tree.leaves(even))
        other, _ = ckpt.restore(fresh(small, even))
    want = parallel.gather(state, specs=both)
    got = parallel.gather(other)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(b, a)
    assert signature(parallel.logical(state, both))["leaves"]["['params']['w1']"] == [[2, 6, 10], "float32"]


def test_a_sharded_step_refuses_padded_specs_over_parameters_not_stored_padded():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    specs = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    tx = optax.chain(cj.topk(0.1, axis_name="data"), optax.sgd(0.1))

    def stacked(x):  # the logical shape with a worker axis, as replicate() without specs= would give
        return jax.ShapeDtypeStruct((SLOW, *np.shape(x)), jnp.result_type(x))

    params, opt_state = jax.tree.map(stacked, init), jax.tree.map(stacked, tx.init(init))
    batch = (jax.ShapeDtypeStruct((16, 6), jnp.float32), jax.ShapeDtypeStruct((16, 3), jnp.float32))
    step = parallel.data_parallel_step(_loss, tx, mesh, specs=specs)
    with pytest.raises(ValueError, match=r"params\['b1'\] has shape \(10,\) per worker, but its spec Padded.*"
                                         r"parallel.replicate\(..., specs=specs\)"):
        step.lower(params, opt_state, batch)


def test_worker_step_refuses_arrays_stored_padded():
    """``worker_step`` hands its arguments to the user's step as they are: a leaf ``replicate`` stored padded would
    reach the user's model as (6, 12) and train the padding, so the step refuses it by name, before compiling; the
    same tree laid out without padding (``pad_min_size=None``) is taken."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    init = _params()
    tx = optax.chain(cj.identity(axis_name="data"), optax.sgd(0.1))

    def train_step(params, opt_state, batch):
        grads = jax.grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = parallel.worker_step(train_step, mesh)
    batch = (np.ones((16, 6), np.float32), np.zeros((16, 3), np.float32))
    padded = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=8)
    params = parallel.replicate(init, mesh, specs=padded)
    state = parallel.init_worker_state(tx, init, mesh, specs=padded)
    with pytest.raises(ValueError, match=r"argument 0\['b1'\] is stored padded .*pad_min_size=None"):
        step(params, state, batch)
    whole = parallel.fsdp_specs(init, mesh, min_size=1, pad_min_size=None)
    assert not any(isinstance(e, parallel.Padded) for e in jax.tree.leaves(whole))
    params = parallel.replicate(init, mesh, specs=whole)  # taken: tests/test_user_step_2d.py trains such a layout
    assert not any(is_padded_array(x) for x in jax.tree.leaves(params))
