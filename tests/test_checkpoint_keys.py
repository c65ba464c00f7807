"""Checkpoints round-trip typed PRNG keys: NNX RNG streams (dropout), keys in NamedTuples, any implementation."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from compjax.checkpoint import Checkpointer, signature
from tests.helpers import AXIS


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)  # holds an RNG stream: an RngKey (typed key) and an RngCount
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


TX = optax.chain(cj.topk(0.5, axis_name=AXIS), optax.sgd(0.1, momentum=0.9))


def build(mesh, seed, tx=TX):
    """Model and optimizer on 8 workers; the same ``tx`` object keeps the step's static graph equal (one compile)."""
    model = Net(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer)
    return model, optimizer


def host(tree):
    """``{path: host array}``: typed keys as their key data, with their dtype beside it."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            out[name + " dtype"] = str(x.dtype)
            x = jax.random.key_data(x)
        out[name] = np.asarray(x)
    return out


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, str):
            assert x == y, name
        else:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


def test_nnx_model_with_dropout_resumes_bit_exact(mesh, tmp_path):
    """Train 3 steps, save, 2 more == restore into a model built from another seed, 2 steps: params, opt, RNG state."""
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((16, 4), dtype=np.float32), rng.standard_normal((16, 2), dtype=np.float32))
               for _ in range(5)]
    step = parallel.nnx_data_parallel_step(loss_fn, mesh)

    model, optimizer = build(mesh, seed=0)
    keys = jax.tree.leaves(nnx.state(model, nnx.RngKey))
    assert len(keys) == 1 and str(keys[0].dtype) == "key<fry>" and keys[0].shape == (8,)  # worker-stacked key
    assert keys[0].sharding.spec[0] == AXIS
    for batch in batches[:3]:
        jax.block_until_ready(step(model, optimizer, batch))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, nnx.state((model, optimizer)))
        saved = host(nnx.state((model, optimizer)))
        for batch in batches[3:]:  # the uninterrupted run
            jax.block_until_ready(step(model, optimizer, batch))
        straight = host(nnx.state((model, optimizer)))
        assert not np.array_equal(straight["[0]['drop']['rngs']['count'].value"], np.zeros(8))  # dropout drew

        fresh_model, fresh_optimizer = build(mesh, seed=1)  # another seed: other parameters and RNG key
        like = nnx.state((fresh_model, fresh_optimizer))
        assert not np.array_equal(host(like)["[0]['drop']['rngs']['key'].value"],
                                  saved["[0]['drop']['rngs']['key'].value"])
        restored, _ = ckpt.restore(like)
    assert_bitwise_equal(host(restored), saved)
    for new, old in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
        assert new.dtype == old.dtype and new.sharding == old.sharding
    nnx.update((fresh_model, fresh_optimizer), restored)
    for batch in batches[3:]:
        jax.block_until_ready(step(fresh_model, fresh_optimizer, batch))
    assert_bitwise_equal(host(nnx.state((fresh_model, fresh_optimizer))), straight)


class Inner(NamedTuple):
    key: jax.Array
    count: jax.Array


class Outer(NamedTuple):
    inner: Inner
    keys: dict
    w: jax.Array


def keyed_state(mesh, seed):
    """Typed keys of three implementations: worker-stacked (one key per worker, sharded), replicated, one device."""
    stacked = jax.device_put(jax.random.split(jax.random.key(seed), 8), NamedSharding(mesh, P(AXIS)))
    return Outer(
        inner=Inner(key=stacked, count=parallel.replicate(jnp.int32(seed), mesh)),
        keys={"rbg": jax.random.key(seed + 1, impl="rbg"),
              "urbg": parallel.replicate(jax.random.key(seed + 2, impl="unsafe_rbg"), mesh)},
        w=parallel.replicate(jnp.full(3, float(seed)), mesh),
    )


def test_typed_keys_in_named_tuples_round_trip_onto_arrays_and_abstract_targets(mesh, tmp_path):
    state = keyed_state(mesh, 10)
    like = keyed_state(mesh, 20)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    sig = signature(state)
    assert sig["leaves"][".inner.key"] == [[8], "key<fry>"] and sig["leaves"][".keys['rbg']"] == [[], "key<rbg>"]
    assert sig["keys"] == {".inner.key": "threefry2x32", ".keys['rbg']": "rbg", ".keys['urbg']": "unsafe_rbg"}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        for target in (like, abstract):  # the implementation from the target's keys, or from the checkpoint
            restored, _ = ckpt.restore(target)
            assert type(restored) is Outer and type(restored.inner) is Inner
            assert_bitwise_equal(host(restored), host(state))
            for new, old in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
                assert new.dtype == old.dtype and new.sharding == old.sharding
            assert jax.random.key_impl(restored.keys["urbg"]) == jax.random.key_impl(state.keys["urbg"])


def test_typed_against_raw_keys_is_refused_naming_the_leaf(mesh, tmp_path):
    typed = {"key": jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh, P(AXIS)))}
    raw = {"key": jax.random.key_data(typed["key"])}  # the same bits as uint32, shape (8, 2)
    rbg = {"key": jax.device_put(jax.random.split(jax.random.key(0, impl="rbg"), 8), NamedSharding(mesh, P(AXIS)))}
    with Checkpointer(tmp_path / "typed") as ckpt:
        ckpt.save(1, typed)
        with pytest.raises(ValueError, match=r"leaf \['key'\] holds typed PRNG keys \(key<fry>\) in the checkpoint "
                                             r"but raw uint32 key data in this run"):
            ckpt.restore(raw)
        with pytest.raises(ValueError, match=r"leaf \['key'\] holds key<fry> PRNG keys in the checkpoint but "
                                             r"key<rbg> keys in this run"):
            ckpt.restore(rbg)
    with Checkpointer(tmp_path / "raw") as ckpt:
        ckpt.save(1, raw)
        with pytest.raises(ValueError, match=r"leaf \['key'\] holds typed PRNG keys \(key<fry>\) in this run but "
                                             r"raw uint32 key data in the checkpoint"):
            ckpt.restore(typed)
