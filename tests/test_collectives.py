"""The wire layer: each collective's result and its byte count, on one and on 8 workers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax import collectives
from tests.helpers import AXIS


def test_dense_mean_one_worker_is_identity_and_counts_bytes():
    x = jnp.arange(6.0).reshape(2, 3)
    y, nbytes = collectives.dense_mean(x, None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert nbytes == 24


def test_dense_mean_arrays_buckets_by_dtype():
    xs = np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32)
    hs = xs[:, :3].astype(np.float16)

    def f(a, h):
        (ma, mh), nbytes = collectives.dense_mean_arrays([a, h], AXIS)
        return ma, mh, jnp.asarray(nbytes)

    ma, mh, nbytes = jax.vmap(f, axis_name=AXIS)(xs, hs)
    np.testing.assert_allclose(np.asarray(ma)[0], xs.mean(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mh)[0], hs.astype(np.float32).mean(0), rtol=2e-3)
    assert mh.dtype == jnp.float16
    assert int(nbytes[0]) == 10 * 4 + 3 * 2


def test_sparse_mean_scatter_adds_duplicates():
    idx = np.array([[0, 2], [2, 3], [2, 2]], np.int32)
    val = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)

    def f(i, v):
        out, nbytes = collectives.sparse_mean(i, v, 5, AXIS)
        return out, jnp.asarray(nbytes)

    out, nbytes = jax.vmap(f, axis_name=AXIS)(idx, val)
    want = np.zeros(5, np.float32)
    np.add.at(want, idx.ravel(), val.ravel())
    np.testing.assert_allclose(np.asarray(out), np.stack([want / 3] * 3), rtol=1e-6)
    assert int(nbytes[0]) == 2 * 4 + 2 * 4


def test_sparse_mean_segments_equals_one_dense_mean_split_at_the_segments():
    """Three workers' pairs into two buffers (entries 0:4 and 4:10): each buffer is its slice of the dense mean."""
    rng = np.random.default_rng(3)
    idx = np.stack([np.concatenate([rng.choice(4, 2, replace=False), 4 + rng.choice(6, 3, replace=False)])
                    for _ in range(3)]).astype(np.int32)
    val = rng.standard_normal(idx.shape).astype(np.float32)

    def f(i, v):
        means, nbytes = collectives.sparse_mean_segments(i, v, [(0, 2, 0, 4), (2, 5, 4, 6)], AXIS)
        return means, jnp.asarray(nbytes)

    (lo, hi), nbytes = jax.vmap(f, axis_name=AXIS)(idx, val)
    want = np.zeros(10, np.float32)
    np.add.at(want, idx.ravel(), val.ravel())
    np.testing.assert_allclose(np.asarray(lo)[1], want[:4] / 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(hi)[2], want[4:] / 3, rtol=1e-6)
    assert int(nbytes[0]) == 5 * 4 + 5 * 4


def test_sparse_mean_segments_rejects_a_segment_outside_the_pairs():
    idx, val = jnp.arange(3, dtype=jnp.int32), jnp.ones(3)
    with pytest.raises(ValueError, match="segments must lie in"):
        collectives.sparse_mean_segments(idx, val, [(0, 4, 0, 8)], None)


@pytest.mark.parametrize("take", [True, False])
def test_cond_unified_traces_the_first_branch_once_and_unifies_varying_axes(take):
    """Under shard_map: the first branch returns a mean (invariant) and state (varying), the second the
    reverse; both come out varying where either is, the values of the branch taken, and the first branch
    (the costly one: an all-reduce) is traced once."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    traced = []
    mesh = jax.make_mesh((4,), (AXIS,))

    def f(x, pred):
        def costly():
            traced.append(1)
            return jax.lax.pmean(x, AXIS), x * 2.0

        def cheap():
            return x, jnp.zeros(x.shape)  # invariant where the first branch is varying

        mean, state = collectives.cond_unified(pred[0], costly, cheap)
        return mean, state

    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P(AXIS)))
    run = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=(P(AXIS), P(AXIS))))
    mean, state = run(x, jax.device_put(jnp.array([take]), NamedSharding(mesh, P())))
    assert len(traced) == 1
    xs = np.arange(8.0).reshape(4, 2)
    want_mean = np.tile(xs.mean(0), 4) if take else xs.ravel()
    np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state), xs.ravel() * 2.0 if take else 0.0)


def test_dense_mean_arrays_caps_its_buckets_and_counts_the_same_bytes(monkeypatch):
    """Buckets of at most BUCKET_CAP_BYTES: a larger array alone, smaller ones together; the bytes unchanged."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(4, n)).astype(np.float32) for n in (3, 5, 40, 2, 6)]
    h = rng.normal(size=(4, 7)).astype(np.float16)

    def f(*arrays):
        means, nbytes = collectives.dense_mean_arrays(list(arrays), AXIS)
        return means, jnp.asarray(nbytes)

    def psums(*arrays):
        jaxpr = jax.make_jaxpr(jax.vmap(f, axis_name=AXIS))(*arrays)
        return sum(e.primitive.name == "psum" for e in jaxpr.jaxpr.eqns)

    whole_means, whole_bytes = jax.vmap(f, axis_name=AXIS)(*xs, h)
    assert psums(*xs, h) == 2  # one bucket per dtype under the default cap
    monkeypatch.setattr(collectives, "BUCKET_CAP_BYTES", 40)  # float32: [3, 5] (32 B), [40] alone, [2, 6] (32 B)
    means, nbytes = jax.vmap(f, axis_name=AXIS)(*xs, h)
    assert psums(*xs, h) == 4  # three float32 buckets and the float16 one (14 B)
    for m, w, x in zip(means, whole_means, xs + [h]):
        np.testing.assert_array_equal(np.asarray(m), np.asarray(w))
        assert m.shape == x.shape and m.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(means[2])[0], xs[2].mean(0), rtol=1e-6)
    assert int(nbytes[0]) == int(whole_bytes[0]) == (3 + 5 + 40 + 2 + 6) * 4 + 7 * 2
