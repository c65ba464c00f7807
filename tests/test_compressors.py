"""identity, topk and powersgd: equalities, backend agreement and the PowerSGD NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from tests.helpers import AXIS, VOTE, init_stacked, run_workers

N = 8
SHAPES = {"conv": (3, 3, 2, 4), "dense": (6, 5), "bias": (5,), "out": (5, 3)}


def local_grads(n=N, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in shapes.items()}


def params_like(shapes=SHAPES):
    return {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}


def mean_over_workers(tree):
    return jax.tree.map(lambda x: x.mean(0), tree)


def assert_tree_close(a, b, **kw):
    """Same tree structure, same leaf shapes, then leaf values close (``assert_allclose`` keywords)."""
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    assert sa == sb, f"tree structures differ:\n{sa}\n{sb}"
    xs, ys = jax.tree.leaves(a), jax.tree.leaves(b)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(a)]
    for path, x, y in zip(paths, xs, ys, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, f"leaf {path}: shapes {x.shape} and {y.shape}"
        np.testing.assert_allclose(x, y, err_msg=f"leaf {path}", **kw)


def test_assert_tree_close_checks_structure_and_shapes():
    a = {"w": np.ones((2, 3)), "b": np.zeros(3)}
    assert_tree_close(a, {"w": np.ones((2, 3)), "b": np.zeros(3)})
    for b in (
        {"w": np.ones((2, 3))},  # a leaf missing
        {"w": np.ones((2, 3)), "b": np.zeros(3), "c": np.zeros(1)},  # a leaf too many
        {"w": np.ones((2, 3)), "c": np.zeros(3)},  # another name
        {"w": np.ones((1, 3)), "b": np.zeros(3)},  # broadcasts, but another shape
        {"w": np.ones((2, 3)), "b": np.zeros(())},
        [np.ones((2, 3)), np.zeros(3)],  # the same leaves in another container
    ):
        with pytest.raises(AssertionError):
            assert_tree_close(a, b)
        with pytest.raises(AssertionError):
            assert_tree_close(b, a)


def test_identity_is_mean_of_local_gradients(mesh):
    tx = cj.identity(axis_name=AXIS)
    g = local_grads()
    out, state = run_workers(tx, g, init_stacked(tx, params_like(), N), "shard_map", mesh)
    want = mean_over_workers(g)
    for w in range(N):
        assert_tree_close(jax.tree.map(lambda x, w=w: x[w], out), want, atol=1e-6, rtol=1e-6)
    assert int(cj.payload_bytes(state)[0]) == 4 * sum(int(np.prod(s)) for s in SHAPES.values()) + VOTE


def test_topk_ratio_one_equals_identity(mesh):
    g = local_grads(seed=1)
    tx_i = cj.identity(axis_name=AXIS)
    tx_t = cj.topk(1.0, axis_name=AXIS)
    out_i, _ = run_workers(tx_i, g, init_stacked(tx_i, params_like(), N), "shard_map", mesh)
    out_t, st = run_workers(tx_t, g, init_stacked(tx_t, params_like(), N), "shard_map", mesh)
    assert_tree_close(out_t, out_i, atol=1e-6, rtol=1e-6)
    for r in jax.tree.leaves(st.residual):
        assert np.all(r == 0)  # everything was sent


def test_powersgd_full_rank_equals_identity(mesh):
    g = local_grads(seed=2)
    tx_i = cj.identity(axis_name=AXIS)
    tx_p = cj.powersgd(rank=8, min_compression_rate=0.0, axis_name=AXIS)  # rank >= min(m, n) for every matrix
    st0 = init_stacked(tx_p, params_like(), N)
    assert len(st0.q) == 3  # conv, dense, out compressed; bias dense
    out_i, _ = run_workers(tx_i, g, init_stacked(tx_i, params_like(), N), "shard_map", mesh)
    out_p, _ = run_workers(tx_p, g, st0, "shard_map", mesh)
    assert_tree_close(out_p, out_i, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: cj.identity(axis_name=AXIS), marks=pytest.mark.slow),
        lambda: cj.topk(0.2, axis_name=AXIS),
        pytest.param(lambda: cj.powersgd(rank=2, min_compression_rate=1.0, axis_name=AXIS),
                     marks=pytest.mark.slow),
    ],
    ids=["identity", "topk", "powersgd"],
)
def test_shard_map_pmap_vmap_agree(mesh, make):
    tx = make()
    g = local_grads(seed=3)
    s0 = init_stacked(tx, params_like(), N)
    results = {b: run_workers(tx, g, s0, b, mesh) for b in ("shard_map", "pmap", "vmap")}
    for b in ("pmap", "vmap"):
        assert_tree_close(results[b], results["shard_map"], atol=1e-6, rtol=1e-6)


# --- PowerSGD against a NumPy reference of Algorithm 1 with error feedback -------------------


def np_gram_schmidt(p):
    q = np.zeros_like(p)
    for i in range(p.shape[1]):
        v = p[:, i] - q[:, :i] @ (q[:, :i].T @ p[:, i])
        q[:, i] = v / (np.linalg.norm(v) + 1e-8)
    return q


def np_powersgd(grads_steps, q0, rank_of, compressed):
    """Vogels et al. 2019, Algorithm 1 + error feedback, in float64.

    grads_steps: list over steps of {name: (W, *shape)} local gradients.
    q0: {name: (rest, r)} initial Q (the same on every worker).
    Returns the per-step outputs and the final residuals {name: (W, *shape)}.
    """
    names = list(grads_steps[0])
    n = grads_steps[0][names[0]].shape[0]
    res = {k: np.zeros(grads_steps[0][k].shape) for k in names}
    q = {k: v.astype(np.float64) for k, v in q0.items()}
    outs = []
    for g in grads_steps:
        out = {}
        for k in names:
            mfull = g[k] + res[k]
            if k not in compressed:
                out[k] = mfull.mean(0)
                res[k] = np.zeros_like(mfull)
                continue
            shape = mfull.shape[1:]
            mats = [mfull[w].reshape(-1, shape[-1]).T for w in range(n)]  # (out, rest)
            p = np.mean([m @ q[k] for m in mats], axis=0)
            p_hat = np_gram_schmidt(p)
            q[k] = np.mean([m.T @ p_hat for m in mats], axis=0)
            approx = p_hat @ q[k].T
            out[k] = approx.T.reshape(shape)
            res[k] = np.stack([mats[w] - approx for w in range(n)]).transpose(0, 2, 1).reshape(mfull.shape)
        outs.append(out)
    return outs, res


@pytest.mark.parametrize("backend", [pytest.param("vmap", marks=pytest.mark.slow), "shard_map"])
def test_powersgd_matches_numpy_algorithm1(mesh, backend):
    shapes = {"conv": (3, 3, 4, 8), "dense": (12, 10), "bias": (10,), "small": (2, 2)}
    n = 4 if backend == "vmap" else N
    tx = cj.powersgd(rank=2, min_compression_rate=1.0, axis_name=AXIS)
    state = init_stacked(tx, params_like(shapes), n)
    leaves_order = sorted(shapes)  # dict pytrees flatten in sorted key order
    compressed = [k for k in leaves_order if k in ("conv", "dense")]  # small (2,2) and bias go dense
    assert len(state.q) == len(compressed)
    q0 = {k: np.asarray(q[0]) for k, q in zip(compressed, state.q)}
    steps = [local_grads(n, seed=10 + t, shapes=shapes) for t in range(3)]
    want_outs, want_res = np_powersgd(steps, q0, 2, compressed)
    for t in range(3):
        out, state = run_workers(tx, steps[t], state, backend, mesh)
        for k in shapes:
            for w in range(n):
                np.testing.assert_allclose(out[k][w], want_outs[t][k], atol=1e-5, err_msg=f"step {t} {k}")
    for k in shapes:
        np.testing.assert_allclose(state.residual[k], want_res[k], atol=1e-5, err_msg=k)
    assert int(state.count[0]) == 3


def test_powersgd_start_step_is_dense_then_compressed(mesh):
    g = local_grads(seed=4)
    tx = cj.powersgd(rank=1, start_step=2, min_compression_rate=1.0, axis_name=AXIS)
    state = init_stacked(tx, params_like(), N)
    want = mean_over_workers(g)
    dense_bytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    for step in range(3):
        out, state = run_workers(tx, g, state, "shard_map", mesh)
        if step < 2:  # dense mean of the raw gradients, nothing kept
            assert_tree_close(jax.tree.map(lambda x: x[0], out), want, atol=1e-6)
            assert int(cj.payload_bytes(state)[0]) == dense_bytes + VOTE
            assert all(np.all(r == 0) for r in jax.tree.leaves(state.residual))
        else:
            assert int(cj.payload_bytes(state)[0]) < dense_bytes
            assert any(np.any(r != 0) for r in jax.tree.leaves(state.residual))


def test_powersgd_without_warm_start_redraws_q():
    tx_w = cj.powersgd(rank=1, min_compression_rate=0.0, warm_start=True)
    tx_c = cj.powersgd(rank=1, min_compression_rate=0.0, warm_start=False)
    p = {"w": jnp.zeros((6, 5))}
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.float32)}
    _, s_w = tx_w.update(g, tx_w.init(p))
    _, s_c = tx_c.update(g, tx_c.init(p))
    assert not np.allclose(np.asarray(s_w.q[0]), np.asarray(tx_w.init(p).q[0]))  # warm start keeps the new Q
    # cold start: the next step's Q is drawn from (key, step), independent of the previous output
    o1, s_c = tx_c.update(g, s_c)
    o2, _ = tx_w.update(g, s_w)
    assert not np.allclose(np.asarray(o1["w"]), np.asarray(o2["w"]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_any_nonfinite_is_exact(dtype):
    """True iff some entry is NaN or infinite: finite entries whose sum overflows are not flagged."""
    from compjax.compressors.base import any_nonfinite

    f = jax.jit(any_nonfinite)
    big = float(jnp.finfo(dtype).max)
    xs = [jnp.ones((3, 5), dtype), jnp.full((7,), big, dtype)]  # finite, but the float32 sum is inf
    assert not bool(f(xs))
    assert not bool(f([jnp.zeros((4,), dtype)]))
    for bad in (np.nan, np.inf, -np.inf):
        ys = [xs[0], xs[1].at[4].set(bad)]
        assert bool(f(ys)), bad
        assert bool(f([jnp.zeros((2, 2), dtype).at[1, 0].set(bad)])), bad


def test_a_skipped_step_keeps_the_state_and_counts_what_it_sent(mesh):
    """A NaN on one worker: every worker skips (zero updates, the residual untouched to the bit), though the
    exchange runs on the residual alone and its bytes are counted with the vote's; the next finite step
    sends the same payload again."""
    tx = cj.topk(0.5, axis_name=AXIS)
    state = init_stacked(tx, params_like(), N)
    _, state = run_workers(tx, local_grads(), state, "shard_map", mesh)
    sent = int(cj.payload_bytes(state)[0])
    assert sent > VOTE
    bad = local_grads(seed=1)
    leaf = jax.tree.leaves(bad)[0]
    leaf[2].flat[0] = np.nan  # worker 2 only
    out, skipped = run_workers(tx, bad, state, "shard_map", mesh)
    assert all(not np.any(x) for x in jax.tree.leaves(out))
    assert int(cj.payload_bytes(skipped)[0]) == sent
    np.testing.assert_array_equal(np.asarray(skipped.skipped), np.ones(N))
    assert_tree_close(skipped.residual, state.residual, atol=0, rtol=0)
    _, again = run_workers(tx, local_grads(seed=2), skipped, "shard_map", mesh)
    assert int(cj.payload_bytes(again)[0]) == sent


SELF_GUARDED = {  # sparse exchanges that send zero values on a skipped step; paths the battery leaves out
    "topk without error feedback": lambda: cj.topk(0.2, error_feedback=False, axis_name=AXIS),
    "dgc, Nesterov, dense vectors, no masking": lambda: cj.dgc(
        0.2, nesterov=True, sparsify_vectors=False, momentum_masking=False, axis_name=AXIS),
}


@pytest.mark.parametrize("name", [n if n.startswith("topk") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(SELF_GUARDED)])
def test_a_self_guarded_exchange_skips_like_the_pipeline(name):
    """A NaN on one worker: zero updates on every worker and the state untouched (but ``skipped`` and the
    byte count), though the exchange saw the raw non-finite gradients; the next finite step equals that of a
    state that never saw the bad one."""
    tx = SELF_GUARDED[name]()
    state = init_stacked(tx, params_like(), 4)
    _, state = run_workers(tx, local_grads(4), state, "vmap")
    bad = local_grads(4, seed=1)
    bad["dense"][3, 1, 2] = np.nan
    bad["bias"][0, 0] = np.inf
    out, skipped = run_workers(tx, bad, state, "vmap")
    assert all(not np.any(x) for x in jax.tree.leaves(out))
    np.testing.assert_array_equal(np.asarray(skipped.skipped), np.ones(4))
    keep = lambda s: s._replace(skipped=None, payload_bytes=None)
    assert_tree_close(keep(skipped), keep(state), atol=0, rtol=0)
    assert_tree_close(run_workers(tx, local_grads(4, seed=2), skipped, "vmap")[0],
                      run_workers(tx, local_grads(4, seed=2), state, "vmap")[0], atol=0, rtol=0)


@pytest.mark.parametrize("make", [lambda: cj.topk(0.2, error_feedback=False),
                                  lambda: cj.randomk(0.2, key=0, error_feedback=False)])
def test_sparse_guard_adds_no_select_over_the_dense_means(make):
    """The guard of top-k and random-k costs no pass over the dense leaves: the only selects are over the
    ``k`` values sent (the pipeline's select over every output leaf is what a skipped sparse step avoids)."""
    from jax.extend.core import jaxprs_in_params

    def selects(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "select_n":
                yield e.outvars[0].aval.shape
            for sub in jaxprs_in_params(e.params):
                yield from selects(sub)

    tx = make()
    g = {"w": jnp.ones((100, 100)), "b": jnp.ones(40)}
    shapes = list(selects(jax.make_jaxpr(tx.update)(g, tx.init(g)).jaxpr))
    assert shapes, "no select at all: the walk missed the program's sub-jaxprs"
    assert not [s for s in shapes if s in ((100, 100), (40,))], shapes


def test_sparse_exchanges_trace_for_models_past_two_to_the_31_entries():
    """Three float32 leaves of 1.34e9 entries each (4.0e9 in all, abstract: nothing allocated): top-k and DGC
    trace, their int32 wire indices counted from each segment's start (offsets from the model's start would pass
    2**31 and overflow)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import compjax as cj
    from compjax import parallel

    mesh = parallel.make_mesh(2)
    n = 2**30 + 2**28
    g = {k: jax.ShapeDtypeStruct((n,), jnp.float32) for k in "abc"}
    for tx in (cj.topk(0.001, axis_name="data"), cj.dgc(0.001, axis_name="data")):
        state = jax.eval_shape(tx.init, g)
        update = jax.shard_map(lambda g, s, tx=tx: tx.update(g, s, g)[0], mesh=mesh, in_specs=P(), out_specs=P(),
                               check_vma=False)
        out = jax.eval_shape(update, g, state)
        assert out["c"].shape == (n,)


def test_residual_in_exchange_needs_a_residual_field_and_no_pipeline_feedback():
    """An exchange that keeps the residual itself (PowerSGD, in place) gets it built by the pipeline; asking for
    both that and the pipeline's error feedback, or for it without a residual field, is refused when built."""
    from compjax.compressors import base

    with pytest.raises(TypeError, match="residual_in_exchange needs error_feedback=False"):
        base.compressor(cj.PowerSGDState, lambda ps, f, c: None, axis_name=None, error_feedback=True,
                        residual_in_exchange=True)
    with pytest.raises(TypeError, match="residual_in_exchange"):
        base.compressor(cj.IdentityState, lambda ps, f, c: None, axis_name=None, residual_in_exchange=True)
    tx = cj.powersgd(2)
    state = tx.init({"w": jnp.ones((8, 4))})
    assert state.residual["w"].shape == (8, 4) and not np.any(np.asarray(state.residual["w"]))
    assert cj.powersgd(2, error_feedback=False).init({"w": jnp.ones((8, 4))}).residual is None
