"""Worker-local state under a replicated sharding is refused (payload_bytes, checkpoints); worker-stacked passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax.checkpoint import Checkpointer
from compjax.replicas import SMALL_BYTES, check_replicas_agree
from tests.helpers import AXIS, VOTE

DIFFER = r"copies differ across devices"
FIX = r"in_axes=0, out_axes=0"


def claimed_replica(mesh, copies):
    """One array sharded P() (replicated) whose device i holds ``copies[i]``, as pmap(out_axes=None) returns."""
    sharding = NamedSharding(mesh, P())
    shards = [jax.device_put(c, d) for c, d in zip(copies, mesh.devices.flat)]
    return jax.make_array_from_single_device_arrays(shards[0].shape, sharding, shards)


def leaves_and_sizes():
    """Host values, one per dtype path of the check: small (host compare) and large (device fingerprint)."""
    rng = np.random.default_rng(0)
    return {
        "count": np.uint32([7, 0]),  # 8 bytes: compared on the host in both modes
        "nan": np.float32([np.nan, -0.0, 1.0]),  # equal copies with a NaN pass (compared as bits)
        "big": rng.standard_normal(40).astype(np.float32),  # 160 bytes: fingerprinted with exact=False
        "half": rng.standard_normal(64).astype(jnp.bfloat16),  # 2-byte words
        "flags": rng.random(100) < 0.5,  # bool
        "key": rng.integers(0, 2**32, (16, 2), dtype=np.uint32),  # typed threefry keys (wrapped below)
    }


def build(mesh, host, changed=None, position=-1):
    """The tree of claimed replicas, every device the same copy except device 5's ``changed`` leaf at ``position``."""
    tree = {}
    for name, value in host.items():
        copies = [np.array(value) for _ in range(mesh.size)]
        if name == changed:
            flat = copies[5].reshape(-1)
            flat[position] = ~flat[position] if flat.dtype == np.bool_ else (
                flat[position] + 1 if name in ("key", "count") else -flat[position] if name == "nan" else
                flat[position] * 2 + 1)
        tree[name] = claimed_replica(mesh, copies)
    tree["key"] = jax.random.wrap_key_data(tree["key"])  # runs on each device's own copy: still one per device
    return tree


def test_check_replicas_agree_compares_every_dtype_bitwise_in_both_modes(mesh):
    host = leaves_and_sizes()
    equal = build(mesh, host)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(equal))
    sizes = {k: v.nbytes for k, v in host.items()}
    assert sizes["count"] <= SMALL_BYTES < min(sizes[k] for k in ("big", "half", "flags", "key"))  # both paths run
    for exact in (True, False):
        check_replicas_agree(equal, "test", exact=exact)  # NaN and -0.0 in equal copies pass
    for changed in ("count", "nan", "big", "half", "flags", "key"):
        for position in (0, -1):  # the first and the last element: a sampled or truncated compare would miss one
            tree = build(mesh, host, changed, position)
            for exact in (True, False):
                match = rf"test: leaf \['{changed}'\] .*{DIFFER} \(cpu:0 and cpu:5.*{FIX}"
                with pytest.raises(ValueError, match=match):
                    check_replicas_agree(tree, "test", exact=exact)
    # -0.0 against 0.0 compares equal as floats but not as bits: the copies are not the same state
    signed = claimed_replica(mesh, [np.float32([-0.0 if i == 3 else 0.0]) for i in range(mesh.size)])
    with pytest.raises(ValueError, match=DIFFER):
        check_replicas_agree({"z": signed}, "test", exact=False)
    # the same values in another order on one device (a plain checksum would miss it)
    swapped = dict(equal, big=claimed_replica(mesh, [host["big"][::-1] if i == 6 else host["big"]
                                                     for i in range(mesh.size)]))
    for exact in (True, False):
        with pytest.raises(ValueError, match=rf"leaf \['big'\] .*{DIFFER} \(cpu:0 and cpu:6"):
            check_replicas_agree(swapped, "test", exact=exact)


def test_worker_stacked_and_single_device_arrays_pass_untouched(mesh):
    stacked = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, P(AXIS)))  # copies differ: by design
    single = jnp.arange(3.0)
    check_replicas_agree({"a": stacked, "b": single, "c": np.ones(2)}, "test", exact=False)
    check_replicas_agree(jax.tree.map(lambda x: x, {"a": stacked}), "test")


def grads(n=8):
    """Per-worker gradients: a small leaf (host compare) and a large one (fingerprint)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (n, 4)), "v": jax.random.normal(k2, (n, 32))}


def test_pmap_out_axes_none_state_is_refused_by_payload_bytes_and_checkpoints(tmp_path):
    """The wrong pmap pattern: optimizer state in_axes=None, out_axes=None keeps each worker's residual under P()."""
    tx = cj.topk(0.5, axis_name=AXIS)
    g = grads()
    state = tx.init(jax.tree.map(lambda x: x[0], g))
    step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS, in_axes=(0, None), out_axes=(0, None))
    _, state = step(g, state)
    residual = state.residual["v"]
    assert residual.sharding.is_fully_replicated and len(residual.addressable_shards) == 8
    copies = [np.asarray(s.data) for s in residual.addressable_shards]
    assert not np.array_equal(copies[0], copies[1])  # what the host view (worker 0's copy) hides
    assert np.array_equal(np.asarray(state.payload_bytes), [148, 0])  # counters agree: only the residuals differ
    with pytest.raises(ValueError, match=rf"payload_bytes: leaf \.residual\['v'\] .*{DIFFER}.*{FIX}"):
        cj.payload_bytes(state)
    with Checkpointer(tmp_path) as ckpt:
        match = rf"Checkpointer.save: leaf \['opt_state'\]\.residual\['v'\] .*{DIFFER}.*{FIX}"
        with pytest.raises(ValueError, match=match):
            ckpt.save(1, {"opt_state": state})
        assert ckpt.all_steps() == []


def test_pmap_worker_stacked_state_gives_per_worker_payload_bytes(tmp_path):
    """The right pmap pattern: the optimizer state in_axes=0, out_axes=0 (one state per worker)."""
    tx = cj.topk(0.5, axis_name=AXIS)
    g = grads()
    state = jax.pmap(tx.init)(jax.tree.map(jnp.zeros_like, g))  # one state per worker, stacked
    step = jax.pmap(lambda g, s: tx.update(g, s), axis_name=AXIS, in_axes=(0, 0), out_axes=(0, 0))
    _, state = step(g, state)
    residual = np.asarray(state.residual["v"])
    assert residual.shape == (8, 32) and not np.array_equal(residual[0], residual[1])  # each worker's own
    # top-k keeps 2 of 4 and 16 of 32 entries: an int32 index and a float32 value each, plus the vote
    np.testing.assert_array_equal(cj.payload_bytes(state), np.full(8, (2 + 16) * 8 + VOTE))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"opt_state": state})
        restored, _ = ckpt.restore({"opt_state": state})
    np.testing.assert_array_equal(np.asarray(restored["opt_state"].residual["v"]), residual)
