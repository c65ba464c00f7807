"""Sharded parameters (FSDP) on a 2 x 4 mesh: the default rule, bad specs, memory per device, the non-finite vote
over both axes, checkpoints across fast sizes.  Every registry case against the replicated 2-D layout is in
tests/test_battery_sharded.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from compjax.checkpoint import Checkpointer

SLOW, FAST = 2, 4


def mlp_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def mlp(rng, d=32, h=64, o=16):
    return {"w1": jnp.asarray(rng.normal(size=(d, h)) * 0.2, jnp.float32), "b1": jnp.zeros(h),
            "w2": jnp.asarray(rng.normal(size=(h, o)) * 0.2, jnp.float32), "b2": jnp.zeros(o)}


def test_fsdp_specs_shard_the_largest_divisible_dimension_and_keep_small_or_indivisible_leaves_whole():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = {"emb": jnp.zeros((6, 2048)), "w": jnp.zeros((1024, 512)), "odd": jnp.zeros((1023, 3)),
              "b": jnp.zeros(512), "s": jnp.zeros(()), "tie": jnp.zeros((64, 64))}
    specs = parallel.fsdp_specs(params, mesh)
    assert specs == {"emb": P(None, "fast"), "w": P("fast", None), "odd": P(), "b": P(), "s": P(),
                     "tie": P("fast", None)}
    assert parallel.fsdp_specs(params, mesh, min_size=1)["b"] == P("fast")
    with pytest.raises(ValueError, match="min_size"):
        parallel.fsdp_specs(params, mesh, min_size=0)
    with pytest.raises(ValueError, match="slow"):
        parallel.fsdp_specs(params, mesh, fast_axis="slow")


@pytest.mark.parametrize("spec, match", [
    (P("model"), r"specs\['w'\].*'model', which is not an axis of the mesh"),
    (P("fast", "fast"), r"specs\['w'\].*over axis 'fast' twice"),
    (P(("fast", "fast")), r"specs\['w'\].*over axis 'fast' twice"),
    (P("data"), r"specs\['w'\].*the worker axis"),
    (P(None, None, "fast"), r"specs\['w'\].*3 entries for a leaf of shape \(8, 6\)"),
    (P(None, "fast"), r"specs\['w'\].*dimension 1 of shape \(8, 6\) over 'fast' of size 4"),
])
def test_bad_specs_name_the_leaf_and_the_axis(spec, match):
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = {"w": jnp.zeros((8, 6)), "b": jnp.zeros(6)}
    with pytest.raises(ValueError, match=match):
        parallel.replicate(params, mesh, specs={"w": spec, "b": P()})


def test_specs_of_another_structure_are_refused():
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    with pytest.raises(ValueError, match="structure"):
        parallel.replicate({"w": jnp.zeros((8, 6))}, mesh, specs={"v": P("fast")})


def _device_bytes(tree, device) -> int:
    """Bytes of ``tree``'s arrays held by ``device``."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("name", [pytest.param("dgc", marks=pytest.mark.slow),
                                  pytest.param("streaming_diloco", marks=pytest.mark.slow),
                                  pytest.param("delayed_averaging_topk", marks=pytest.mark.slow)])
def test_each_device_holds_a_quarter_of_parameters_and_state(name):
    """Per-device bytes of parameters + optimizer + compressor state: the replicated 2-D layout's / 4, up to the
    leaves every device holds whole (counters, keys, byte counts: < 2%), read from the arrays' shards and from the
    compiled step's argument sizes."""
    from registry import CASES

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = mlp(np.random.default_rng(0))
    tx = optax.chain(CASES[name].make(axis_name="data"), optax.adam(1e-3))
    specs = parallel.fsdp_specs(params, mesh, min_size=1)
    rep = (parallel.replicate(params, mesh, fast_axis="fast"), parallel.init_worker_state(tx, params, mesh,
                                                                                          fast_axis="fast"))
    sh = (parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs))
    dev = mesh.devices.flat[0]
    rep_bytes, sh_bytes = _device_bytes(rep, dev), _device_bytes(sh, dev)
    assert rep_bytes / FAST <= sh_bytes <= rep_bytes / FAST * 1.02, (rep_bytes, sh_bytes)

    x = np.zeros((8 * SLOW * FAST, 32), np.float32)
    batch = parallel.shard_batch((x, np.zeros((len(x), 16), np.float32)), mesh, fast_axis="fast")
    args = {}
    for layout, (p, s), kw in (("rep", rep, {"fast_axis": "fast"}), ("sh", sh, {"specs": specs})):
        step = parallel.data_parallel_step(mlp_loss, tx, mesh, **kw)
        args[layout] = step.lower(p, s, batch).compile().memory_analysis().argument_size_in_bytes
    batch_bytes = _device_bytes(batch, dev)
    assert (args["sh"] - batch_bytes) <= (args["rep"] - batch_bytes) / FAST * 1.02, args


def test_merged_spec_folds_the_worker_axis_into_the_first_dimensions_axes():
    from compjax.parallel.core import merged_spec

    assert merged_spec(P("data", "fast", None)) == P(("data", "fast"), None)
    assert merged_spec(P("data", None, "fast")) == P("data", "fast")
    assert merged_spec(P("data", ("fast", "tensor"))) == P(("data", "fast", "tensor"))
    assert merged_spec(P("data")) == P("data")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["identity", "powersgd"])
def test_a_donated_sharded_step_updates_its_state_in_place_and_equals_the_undonated_step(name):
    """With ``donate=True`` the sharded step carries each stacked leaf merged into its first dimension: the compiled
    program copies no donated parameter or AdamW moment (it updates them in place), and after 3 steps every leaf
    equals the undonated step's, laid out as it came in, with one compilation."""
    import re

    from registry import CASES

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = mlp(np.random.default_rng(0), d=64, h=256, o=32)
    tx = optax.chain(CASES[name].make(axis_name="data"), optax.adamw(1e-2, weight_decay=0.1))
    specs = parallel.fsdp_specs(params, mesh, min_size=1024)
    rng = np.random.default_rng(1)
    batches = [parallel.shard_batch((rng.normal(size=(4 * SLOW * FAST, 64)).astype(np.float32),
                                     rng.normal(size=(4 * SLOW * FAST, 32)).astype(np.float32)), mesh,
                                    fast_axis="fast") for _ in range(3)]
    out = {}
    for donate in (False, True):
        p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
        step = parallel.data_parallel_step(mlp_loss, tx, mesh, specs=specs, donate=donate)
        if donate:
            text = step.lower(p, s, batches[0]).compile().as_text()
            copied = [m for m in re.findall(r"= f32\[([\d,]+)\][^ ]* copy\(%param", text)
                      if np.prod([int(d) for d in m.split(",")]) >= 1024]
            assert not copied, f"donated leaves copied instead of updated in place: {copied}"
        for b in batches:
            p, s, loss = step(p, s, b)
        assert step._cache_size() == 1
        out[donate] = (p, s, loss)
    for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
        assert a.shape == b.shape and a.sharding.spec == b.sharding.spec, (a.shape, b.shape, a.sharding, b.sharding)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 1])
def test_a_donated_sharded_diloco_step_updates_the_inner_adamw_moments_in_place(overlap):
    """DiLoCo skipping non-finite inner steps (the default), sharded and donated: the compiled program copies no
    inner AdamW moment (the skip is a loop of 0 or 1 trip that writes the new moments over the old ones, which the
    updates then read; a selection after the step had XLA copy every moment), and a step equals the undonated one."""
    import re

    mesh = parallel.make_2d_mesh(SLOW, FAST)
    params = mlp(np.random.default_rng(0), d=64, h=256, o=32)
    tx = cj.diloco(optax.adamw(1e-2, weight_decay=0.1), sync_every=4, fragments=2, overlap=overlap, axis_name="data")
    specs = parallel.fsdp_specs(params, mesh, min_size=1024)
    rng = np.random.default_rng(1)
    batch = parallel.shard_batch((rng.normal(size=(4 * SLOW * FAST, 64)).astype(np.float32),
                                  rng.normal(size=(4 * SLOW * FAST, 32)).astype(np.float32)), mesh, fast_axis="fast")
    out = {}
    for donate in (False, True):
        p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
        step = parallel.data_parallel_step(mlp_loss, tx, mesh, specs=specs, donate=donate)
        if donate:
            text = step.lower(p, s, batch).compile().as_text()
            moments = {m.group(1) for m in re.finditer(r"%(param[.\d]*) = [^\n]*op_name=\"[^\"\n]*\.(?:mu|nu)\[", text)}
            assert len(moments) >= 8, sorted(moments)  # w1, b1, w2, b2: mu and nu
            copied = sorted(set(re.findall(r"copy\(%(param[.\d]*)\)", text)) & moments)
            assert not copied, f"inner AdamW moments copied instead of updated in place: {copied}"
        p, s, loss = step(p, s, batch)
        out[donate] = (p, s, loss)
    for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _nan_batch(rng, host, device, column):
    """A batch whose rows on (host, device) hold a NaN in one input ``column``: with :func:`lin_loss` the gradient
    of ``w``'s row ``column`` (in one fast shard) is NaN on that host only, every other entry finite."""
    x = rng.normal(size=(4 * SLOW * FAST, 8)).astype(np.float32)
    if column is not None:
        rows = slice((host * FAST + device) * 4, (host * FAST + device + 1) * 4)
        x[rows, column] = np.nan
    return x, rng.normal(size=(len(x), 2)).astype(np.float32)


def lin_loss(p, batch):
    """``mean((x @ w) * y)``: the gradient of ``w[j, k]`` is ``mean(x[:, j] * y[:, k])``, row ``j`` alone."""
    x, y = batch
    return jnp.mean((x @ p["w"]) * y)


def test_a_nan_in_one_devices_shard_skips_the_step_on_all_eight_devices_state_bitwise_unchanged():
    """A NaN that reaches only the third fast shard of host 0's gradient: with top-k every device of both hosts
    skips (the vote spans both axes), parameters and state bitwise unchanged; a vote that missed the shard on
    some devices would leave the model half-updated."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)}
    specs = {"w": P("fast", None)}
    tx = optax.chain(cj.topk(0.5, axis_name="data"), optax.sgd(0.1))  # a zero update leaves SGD's params as they are
    step = parallel.data_parallel_step(lin_loss, tx, mesh, specs=specs)
    p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
    p, s, _ = step(p, s, parallel.shard_batch(_nan_batch(rng, 0, 0, None), mesh, fast_axis="fast"))
    before = jax.tree.map(np.asarray, (p, s))
    p2, s2, _ = step(p, s, parallel.shard_batch(_nan_batch(rng, 0, 1, 5), mesh, fast_axis="fast"))
    after = jax.tree.map(np.asarray, (p2, s2))
    assert np.asarray(s2[0].skipped).tolist() == [1, 1]
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        if a.dtype.kind == "f":  # parameters and residual: bitwise unchanged
            np.testing.assert_array_equal(a, b)
    assert np.asarray(s2[0].count).tolist() == np.asarray(s[0].count).tolist()


def test_diloco_skips_an_inner_step_on_every_device_of_the_host_that_saw_the_nan():
    """DiLoCo's inner steps are local to a worker (a host): a NaN in one shard of host 0's gradient makes all four
    devices of host 0 skip their inner step (the worker's model stays whole), host 1 steps on."""
    mesh = parallel.make_2d_mesh(SLOW, FAST)
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)}
    specs = {"w": P("fast", None)}
    tx = cj.diloco(optax.sgd(0.1), sync_every=4, axis_name="data")
    step = parallel.data_parallel_step(lin_loss, tx, mesh, specs=specs)
    p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh, specs=specs)
    w0 = np.asarray(p["w"])
    p, s, _ = step(p, s, parallel.shard_batch(_nan_batch(rng, 0, 2, 5), mesh, fast_axis="fast"))
    assert np.asarray(s.skipped).tolist() == [1, 0]
    w = np.asarray(p["w"])
    np.testing.assert_array_equal(w[0], w0[0])  # host 0: every shard unchanged
    assert np.all(w[1] != w0[1])  # host 1: every shard moved


def _train(mesh_fast, params, specs_fn, tx, batches, p=None, s=None):
    mesh = parallel.make_2d_mesh(SLOW, mesh_fast)
    specs = specs_fn(mesh)
    if p is None:
        p, s = parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh,
                                                                                          specs=specs)
    step = parallel.data_parallel_step(mlp_loss, tx, mesh, specs=specs)
    for b in batches:
        p, s, _ = step(p, s, parallel.shard_batch(b, mesh, fast_axis="fast"))
    return mesh, specs, p, s


@pytest.mark.slow  # two sharded layouts saved and restored (about 9 s)
def test_a_sharded_checkpoint_saved_at_fast_4_restores_at_fast_4_and_at_fast_2(tmp_path):
    """The checkpoint holds the logical arrays: restored onto 2 x 4 they are bit-identical; onto 2 x 2 too, and
    training on from there matches training on at fast = 4 to 1e-6."""
    rng = np.random.default_rng(3)
    params = mlp(rng, d=8, h=16, o=4)
    batches = [(rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32))
               for _ in range(4)]
    tx = optax.chain(cj.topk(0.25, axis_name="data"), optax.adam(1e-2))

    def specs_fn(mesh):
        return parallel.fsdp_specs(params, mesh, min_size=1)

    mesh4, specs4, p, s = _train(4, params, specs_fn, tx, batches[:2])
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, (p, s))
    ckpt.wait_until_finished() if hasattr(ckpt, "wait_until_finished") else None
    saved = jax.tree.map(np.asarray, (p, s))
    _, _, p4, s4 = _train(4, params, specs_fn, tx, batches[2:], p, s)

    for fast in (4, 2):
        mesh = parallel.make_2d_mesh(SLOW, fast)
        specs = specs_fn(mesh)
        like = (parallel.replicate(params, mesh, specs=specs), parallel.init_worker_state(tx, params, mesh,
                                                                                          specs=specs))
        (rp, rs), _ = ckpt.restore(like, step=2)
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.tree.map(np.asarray, (rp, rs)))):
            np.testing.assert_array_equal(a, b)
        assert rp["w1"].sharding.spec == P("data", None, "fast")
        assert rp["w1"].addressable_shards[0].data.shape == (1, 8, 16 // fast)
        _, _, pf, _ = _train(fast, params, specs_fn, tx, batches[2:], rp, rs)
        for k in params:
            np.testing.assert_allclose(np.asarray(pf[k]), np.asarray(p4[k]), rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_main_job_with_fsdp_trains_as_without_it(tmp_path):
    """``--mesh 2x4 --fsdp`` against ``--mesh 2x4``: the same epoch losses and test accuracy (top-k, 2 steps), the
    record says the layout; ``--fsdp`` without a mesh exits with one line."""
    from experiments import train

    argv = ["--compressor", "topk", "--ratio", "0.1", "--epochs", "1", "--train-limit", "128", "--batch-size", "64",
            "--no-progress", "--mesh", "2x4"]
    plain = train.main(argv + ["--out", str(tmp_path / "a.jsonl")])
    sharded = train.main(argv + ["--fsdp", "--out", str(tmp_path / "b.jsonl")])
    assert sharded["config"]["fsdp"] is True and plain["config"]["fsdp"] is False
    assert sharded["steps"] == plain["steps"] == 2
    np.testing.assert_allclose(sharded["train_loss"], plain["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(sharded["test_accuracy"], plain["test_accuracy"], atol=1e-6)
    assert sharded["payload_bytes_per_step"] == plain["payload_bytes_per_step"]
    with pytest.raises(SystemExit, match="--fsdp shards over the fast axis of a 2-D mesh: give --mesh"):
        train.main(["--no-progress", "--fsdp"])


@pytest.mark.slow
def test_lm_testbed_on_a_2x2_mesh_with_fsdp_trains_as_without_it():
    """The LM testbed's transformer, top-k + AdamW on ``mesh="2x2"``: sharded and replicated layouts give the same
    losses and bytes (3 steps), each compiled once."""
    from experiments.lm.train import train
    from tiny_shakespeare import EXCERPT

    text = EXCERPT.read_text()

    def make(ax):
        return optax.chain(cj.topk(0.1, axis_name=ax), optax.adamw(3e-3))

    kw = dict(model_config="tiny", steps=3, batch_per_worker=2, seq_len=16, eval_every=3, eval_batches=1,
              text=text, mesh="2x2")
    plain, sharded = train(make, **kw), train(make, fsdp=True, **kw)
    assert sharded["config"]["fsdp"] and not plain["config"]["fsdp"]
    np.testing.assert_allclose(sharded["train_loss"], plain["train_loss"], rtol=1e-5)
    np.testing.assert_allclose(sharded["val_loss_worker0"], plain["val_loss_worker0"], rtol=1e-5)
    assert sharded["payload_bytes"] == plain["payload_bytes"] and sum(plain["payload_bytes"]) > 0
    assert sharded["compilations"] == plain["compilations"] == 1
    with pytest.raises(ValueError, match="fsdp=True shards over the fast axis"):
        train(make, fsdp=True, steps=1, text=text)
