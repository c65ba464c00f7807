"""Deep Gradient Compression against a NumPy reference of Lin et al. (ICLR 2018), and its pieces."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import parallel
from tests.helpers import AXIS, VOTE, init_stacked, run_workers, stack
from tests.test_accounting import batch_data, init_params, loss_fn

SHAPES = {"w": (64, 32), "b": (32,), "c": (3, 3, 4, 8)}
PAPER_SPARSITY = [0.75, 0.9375, 0.984375, 0.996, 0.999]  # Sec. 3.4, warm-up stages then the final


def paper_density(t, ratio, warmup_steps):
    """The density at step t, from the paper's list (four equal warm-up stages, then ratio)."""
    if t >= warmup_steps:
        return ratio
    return max(ratio, 0.25 * 0.25 ** (4 * t // warmup_steps))


def dgc_reference(grads, ratio, m, nesterov, clip_norm, masking, warmup_steps, sparsify_vectors=True):
    """NumPy DGC: grads[t][w] is worker w's gradient dict at step t; returns the outputs and final u, v.

    With ``sparsify_vectors=False`` (the authors' code) 1-D leaves send their momentum-corrected
    gradient dense and accumulate nothing.
    """
    n = len(grads[0])
    u = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(n)]
    v = [{k: np.zeros(s) for k, s in SHAPES.items()} for _ in range(n)]
    outs = []
    for t, gs in enumerate(grads):
        density = paper_density(t, ratio, warmup_steps)
        total = {k: np.zeros(s) for k, s in SHAPES.items()}
        for w in range(n):
            g = {k: np.asarray(x, np.float64) for k, x in gs[w].items()}
            if clip_norm is not None:  # local gradient clipping, threshold clip_norm * N^-1/2
                norm = math.sqrt(sum(np.sum(x**2) for x in g.values()))
                bound = clip_norm / math.sqrt(n)
                if norm > bound:
                    g = {k: x * bound / norm for k, x in g.items()}
            for k, shape in SHAPES.items():
                if nesterov:
                    u[w][k] = m * (u[w][k] + g[k])
                    inc = u[w][k] + g[k]
                else:
                    u[w][k] = m * u[w][k] + g[k]
                    inc = u[w][k]
                if not sparsify_vectors and len(shape) == 1:
                    total[k] += inc
                    continue
                v[w][k] = v[w][k] + inc
                flat_v, flat_u = v[w][k].reshape(-1), u[w][k].reshape(-1)
                kk = max(1, math.ceil(density * flat_v.size))
                idx = np.argsort(-np.abs(flat_v), kind="stable")[:kk]
                sent = np.zeros_like(flat_v)
                sent[idx] = flat_v[idx]
                total[k] += sent.reshape(shape)
                flat_v[idx] = 0.0
                if masking:
                    flat_u[idx] = 0.0
        outs.append({k: x / n for k, x in total.items()})
    return outs, u, v


def random_grads(steps, n, seed=0):
    rng = np.random.default_rng(seed)
    return [[{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]
            for _ in range(steps)]


@pytest.mark.parametrize(
    "nesterov,clip_norm,masking,sparsify_vectors",
    [*(pytest.param(*v, marks=pytest.mark.slow) for v in [
        (False, None, True, True), (True, None, True, True), (False, 10.0, True, True),
        (True, 10.0, False, True), (False, None, False, True)]),
     (True, 10.0, True, False)],  # the fast tier: Nesterov, clipping, masking and dense vectors at once
)
def test_dgc_matches_numpy_reference(nesterov, clip_norm, masking, sparsify_vectors):
    n, steps, ratio, warmup = 4, 5, 0.001, 4  # densities 25%, 6.25%, 1.5625%, 0.39%, then 0.1%
    mesh4 = parallel.make_mesh(n)
    grads = random_grads(steps, n)
    tx = cj.dgc(ratio, momentum=0.9, nesterov=nesterov, clip_norm=clip_norm, warmup_steps=warmup,
                sample_ratio=None, momentum_masking=masking, sparsify_vectors=sparsify_vectors, axis_name=AXIS)
    state = init_stacked(tx, {k: jnp.zeros(s) for k, s in SHAPES.items()}, n)
    want, want_u, want_v = dgc_reference(grads, ratio, 0.9, nesterov, clip_norm, masking, warmup, sparsify_vectors)
    for t in range(steps):
        out, state = run_workers(tx, stack(grads[t]), state, "shard_map", mesh4)
        for k in SHAPES:
            for w in range(n):
                np.testing.assert_allclose(out[k][w], want[t][k], rtol=1e-5, atol=1e-5)
    for w in range(n):
        for k in SHAPES:
            np.testing.assert_allclose(state.velocity[k][w], want_u[w][k], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(state.accumulator[k][w], want_v[w][k], rtol=1e-5, atol=1e-5)
    # The last step sent max(1, ceil(0.001 * size)) pairs per layer: int32 index + f32 value (dense vectors: 4 B).
    sparse = [s for s in SHAPES.values() if sparsify_vectors or len(s) > 1]
    dense = [s for s in SHAPES.values() if s not in sparse]
    want_bytes = sum(max(1, math.ceil(0.001 * math.prod(s))) for s in sparse) * 8 + sum(4 * math.prod(s) for s in dense)
    assert np.all(cj.payload_bytes(state) == want_bytes + VOTE)


@pytest.mark.slow
def test_dgc_backends_agree(mesh):
    n = 8
    grads = random_grads(3, n, seed=1)
    tx = cj.dgc(0.01, momentum=0.9, clip_norm=5.0, warmup_steps=2, axis_name=AXIS)
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    results = {}
    for backend in ("shard_map", "vmap"):
        state = init_stacked(tx, params, n)
        for t in range(3):
            out, state = run_workers(tx, stack(grads[t]), state, backend, mesh)
        results[backend] = (out, state.accumulator)
    for k in SHAPES:
        np.testing.assert_allclose(results["shard_map"][0][k], results["vmap"][0][k], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(results["shard_map"][1][k], results["vmap"][1][k], rtol=1e-6, atol=1e-6)


def test_dgc_without_momentum_is_topk_with_error_feedback():
    grads = random_grads(4, 1, seed=2)
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    a, b = cj.dgc(0.05, momentum=0.0, sample_ratio=None), cj.topk(0.05)
    sa, sb = a.init(params), b.init(params)
    for gs in grads:
        oa, sa = jax.jit(a.update)(gs[0], sa)
        ob, sb = jax.jit(b.update)(gs[0], sb)
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(oa[k]), np.asarray(ob[k]))
            np.testing.assert_array_equal(np.asarray(sa.accumulator[k]), np.asarray(sb.residual[k]))


def test_sampled_selection_gives_the_exact_update_on_large_layers():
    rng = np.random.default_rng(3)
    shapes = {"big": (400, 500), "small": (50,)}
    params = {k: jnp.zeros(s) for k, s in shapes.items()}
    exact, sampled = cj.dgc(0.001, sample_ratio=None), cj.dgc(0.001, sample_ratio=0.01)
    se, ss = exact.init(params), sampled.init(params)
    for _ in range(3):
        g = {k: jnp.asarray(rng.standard_t(2, s), jnp.float32) for k, s in shapes.items()}
        oe, se = jax.jit(exact.update)(g, se)
        os_, ss = jax.jit(sampled.update)(g, ss)
        for k in shapes:
            np.testing.assert_array_equal(np.asarray(oe[k]), np.asarray(os_[k]))
    assert int(cj.message_bytes(ss)) == (200 + 1) * 8


def test_warmup_schedule_matches_the_paper():
    warmup = 400
    s = cj.dgc_warmup_schedule(0.001, warmup)
    boundaries = [0, 100, 200, 300, 400]
    for t, want in zip(boundaries, PAPER_SPARSITY):
        assert float(s(t)) == pytest.approx(want, abs=5e-4)
    assert [float(s(t)) for t in (0, 100, 200, 300)] == [0.75, 0.9375, 0.984375, 0.99609375]  # exact powers of 4
    for t in (99, 199, 299, 399):  # a stage lasts until the next boundary
        assert float(s(t)) == float(s(t - 99))
    assert float(s(10**6)) == pytest.approx(0.999)
    assert float(cj.dgc_warmup_schedule(0.001, 0)(0)) == pytest.approx(0.999)
    assert float(cj.dgc_warmup_schedule(0.1, 400)(300)) == pytest.approx(0.9)  # never sparser than 1 - ratio


@pytest.mark.slow
def test_warmup_densities_reach_the_wire(mesh):
    """Each stage sends its own k per layer; the audited program holds one exchange per stage."""
    params = init_params()
    warmup = 8
    tx = optax.chain(cj.dgc(0.001, warmup_steps=warmup, axis_name=AXIS), optax.sgd(0.05))
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    batch = batch_data(mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    ops = cj.audit_collectives(step, p, s, batch)
    seen = []
    sizes = [x.size for x in jax.tree.leaves(params)]
    for t in range(warmup + 1):
        p, s, _ = jax.block_until_ready(step(p, s, batch))
        seen.append(int(np.asarray(cj.payload_bytes(s))[0]))
        want = sum(max(1, math.ceil(paper_density(t, 0.001, warmup) * n)) for n in sizes) * 8
        assert seen[-1] == want + VOTE
    stages = sorted(set(seen))
    assert len(stages) == 5 and len(ops) == 2 * len(stages) + 1  # indices + values per stage, and the vote
    assert sum(op.bytes for op in ops) == sum(stages) - (len(stages) - 1) * VOTE


@pytest.mark.parametrize("sparsify_vectors", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_dgc_payload_bytes_equals_audited_bytes(mesh, sparsify_vectors):
    params = init_params()
    tx = optax.chain(cj.dgc(0.01, momentum=0.9, sparsify_vectors=sparsify_vectors, axis_name=AXIS), optax.sgd(0.05))
    p, s = parallel.replicate(params, mesh), parallel.init_worker_state(tx, params, mesh)
    batch = batch_data(mesh)
    step = parallel.data_parallel_step(loss_fn, tx, mesh)
    ops = cj.audit_collectives(step, p, s, batch)
    p, s, loss = jax.block_until_ready(step(p, s, batch))
    payload = [op for op in ops if op.operands != (("s32", ()),)]  # all but the non-finite vote
    assert len(payload) == len(ops) - 1
    if sparsify_vectors:
        assert {op.op for op in payload} == {"all-gather"} and len(payload) == 2
    else:  # the biases travel dense in one all-reduce
        assert sorted(op.op for op in payload) == ["all-gather", "all-gather", "all-reduce"]
        n_vec = sum(x.size for x in jax.tree.leaves(params) if x.ndim == 1)
        assert [op.bytes for op in payload if op.op == "all-reduce"] == [4 * n_vec]
    assert int(np.asarray(cj.payload_bytes(s))[0]) == sum(op.bytes for op in ops)
    assert np.all(np.isfinite(np.asarray(loss)))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"ratio": 0.0}, "ratio"),
        ({"ratio": 1.5}, "ratio"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"sample_ratio": 0.0}, "sample_ratio"),
        ({"sample_ratio": 1.01}, "sample_ratio"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"key": 1.5}, "key"),
    ],
)
def test_dgc_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        cj.dgc(**kwargs)


def test_dgc_rejects_a_foreign_tree():
    tx = cj.dgc(0.1)
    state = tx.init({"w": jnp.zeros((4, 4))})
    with pytest.raises(ValueError, match="velocity"):
        tx.update({"w": jnp.zeros((4, 5))}, state)
