"""Error feedback: the outputs follow NumPy references, and mass is conserved (sent + residual = gradients).

Conservation alone holds whatever is sent (the residual keeps the rest), so
every check also compares the outputs and residuals with a NumPy reference:
top-k + error feedback (float32, as the selection is discrete) and PowerSGD
with error feedback (float64, :func:`tests.test_powersgd_accuracy.np_powersgd`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import compjax as cj
from compjax.codecs.sparse import layer_k
from tests.helpers import AXIS, init_stacked, run_workers
from tests.test_powersgd_accuracy import np_powersgd

shape_st = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def _grads(shapes, steps, n, seed):
    rng = np.random.default_rng(seed)
    return [[{f"l{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)} for _ in range(n)]
            for _ in range(steps)]


def np_topk_ef(grads_steps, ratio):
    """Top-k with error feedback on each worker, then the mean of what was sent (float32, as compjax).

    grads_steps: list over steps of lists over workers of ``{name: array}``.
    Returns the per-step mean outputs and the final per-worker residuals.
    """
    n = len(grads_steps[0])
    res = [{k: np.zeros_like(v) for k, v in g.items()} for g in grads_steps[0]]
    outs = []
    for step in grads_steps:
        sent = []
        for w, g in enumerate(step):
            s_w = {}
            for k, x in g.items():
                p = (x + res[w][k]).ravel()
                keep = np.argsort(-np.abs(p), kind="stable")[: layer_k(p.size, ratio)]  # ties: lowest index
                s = np.zeros_like(p)
                s[keep] = p[keep]
                s_w[k] = s.reshape(x.shape)
                res[w][k] = (p - s).reshape(x.shape)
            sent.append(s_w)
        outs.append(
            {k: np.sum([s[k] for s in sent], axis=0, dtype=np.float32) / np.float32(n) for k in step[0]}
        )
    return outs, res


def _powersgd_reference(gs_steps, state_q, rank_compressed_names):
    """np_powersgd on worker-stacked steps, from the Q's of a (worker-stacked or single) state."""
    stacked = [{k: np.stack([g[k] for g in step]) for k in step[0]} for step in gs_steps]
    q0 = {k: np.asarray(q) for k, q in zip(rank_compressed_names, state_q)}
    return np_powersgd(stacked, q0, rank_compressed_names)


def _check_one_worker(tx, shapes, seed, reference=None, steps=3, rtol=1e-5, atol=1e-6):
    """One worker: outputs and residuals follow ``reference``, and sent + residual = the gradients.

    ``reference(grads_steps, state) -> (outputs per step, final residual)``, with
    ``grads_steps`` a list over steps of one-worker lists.  Without a reference
    only conservation is checked, which holds whatever is sent.
    """
    gs = [g[0] for g in _grads(shapes, steps, 1, seed)]
    state = tx.init(jax.tree.map(jnp.zeros_like, gs[0]))
    want_outs, want_res = reference([[g] for g in gs], state) if reference is not None else (None, None)
    update = jax.jit(tx.update)
    sent_total = jax.tree.map(np.zeros_like, gs[0])
    for t, g in enumerate(gs):
        out, state = update(g, state)
        for k in g if reference is not None else ():
            np.testing.assert_allclose(
                np.asarray(out[k]), want_outs[t][k], rtol=rtol, atol=atol, err_msg=f"step {t} {k}"
            )
        sent_total = jax.tree.map(lambda a, b: a + np.asarray(b, np.float64), sent_total, out)
    for k in gs[0] if reference is not None else ():
        np.testing.assert_allclose(
            np.asarray(state.residual[k]), want_res[k], rtol=rtol, atol=atol, err_msg=f"residual {k}"
        )
    g_total = jax.tree.map(lambda *xs: np.sum(xs, axis=0, dtype=np.float64), *gs)
    for k in g_total:
        np.testing.assert_allclose(sent_total[k] + np.asarray(state.residual[k]), g_total[k], atol=1e-4)


def _compressed(names_shapes):
    """PowerSGD with min_compression_rate=0 compresses every leaf of ndim >= 2 (dicts flatten sorted)."""
    return [k for k in sorted(names_shapes) if len(names_shapes[k]) >= 2]


@settings(max_examples=15, deadline=None)
@given(st.lists(shape_st, min_size=1, max_size=3), st.floats(0.01, 1.0), st.integers(0, 2**16))
def test_topk_follows_reference_and_conserves_mass(shapes, ratio, seed):
    def reference(gs_steps, state):
        outs, res = np_topk_ef(gs_steps, ratio)
        return outs, res[0]

    _check_one_worker(cj.topk(ratio), shapes, seed, reference)


@settings(max_examples=10, deadline=None)
@given(st.lists(shape_st, min_size=1, max_size=3), st.integers(1, 3), st.integers(0, 2**16))
def test_powersgd_follows_reference_and_conserves_mass(shapes, rank, seed):
    names = {f"l{i}": s for i, s in enumerate(shapes)}

    def reference(gs_steps, state):
        outs, res = _powersgd_reference(gs_steps, state.q, _compressed(names))
        return outs, {k: v[0] for k, v in res.items()}

    # float32 against float64 on small random matrices: a looser tolerance than the accuracy test's.
    tx = cj.powersgd(rank=rank, min_compression_rate=0.0)
    _check_one_worker(tx, shapes, seed, reference, rtol=1e-4, atol=1e-4)


def test_conservation_across_workers():
    """4 workers: outputs and residuals follow the references, and n * mean output + residuals = gradients."""
    n, steps = 4, 3
    shapes = [(5, 4), (7,), (2, 3, 4)]
    names = {f"l{i}": s for i, s in enumerate(shapes)}
    for name, tx in (("topk", cj.topk(0.1, axis_name=AXIS)),
                     ("powersgd", cj.powersgd(1, min_compression_rate=0.0, axis_name=AXIS))):
        gs = _grads(shapes, steps, n, seed=7)
        state = init_stacked(tx, {k: jnp.zeros(v.shape) for k, v in gs[0][0].items()}, n)
        if name == "topk":
            want_outs, want_res = np_topk_ef(gs, 0.1)
            want_res = {k: np.stack([r[k] for r in want_res]) for k in names}
            tol = {"rtol": 1e-6, "atol": 1e-6}
        else:
            want_outs, want_res = _powersgd_reference(gs, [q[0] for q in state.q], _compressed(names))
            tol = {"rtol": 1e-4, "atol": 1e-5}
        total_out = None
        for t in range(steps):
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *gs[t])
            out, state = run_workers(tx, stacked, state, "vmap")
            for k in names:
                for w in range(n):
                    np.testing.assert_allclose(
                        out[k][w], want_outs[t][k], err_msg=f"{name} step {t} {k}", **tol
                    )
            total_out = out if total_out is None else jax.tree.map(np.add, total_out, out)
        g_sum = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *[g for step in gs for g in step])
        for k in g_sum:
            np.testing.assert_allclose(state.residual[k], want_res[k], err_msg=f"{name} {k}", **tol)
            np.testing.assert_allclose(
                total_out[k][0] * n + state.residual[k].sum(0), g_sum[k], atol=1e-4, err_msg=f"{name} {k}"
            )


def _whiles_carrying(tx, g):
    """The input shapes of every ``while`` in the jaxpr of ``tx.update(g, state)`` that carries an array shaped like ``g``."""
    def walk(j):
        out = []
        for e in j.eqns:
            if e.primitive.name == "while":
                out.append([tuple(v.aval.shape) for v in e.invars])
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        out += walk(inner)
        return out

    jaxpr = jax.make_jaxpr(tx.update)(g, tx.init(g))
    return [w for w in walk(jaxpr.jaxpr) if tuple(g.shape) in w]


def test_sparse_and_e3m0_exchanges_read_p_written_once_and_unchanged(monkeypatch):
    """topk and e3m0 (materialize=True) write p = g + e once (a one-trip loop XLA neither fuses across nor removes),
    so the gradient can die before the selection's passes; the values are those without it, bit for bit."""
    import importlib

    base = importlib.import_module("compjax.compressors.base")
    g = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
    assert _whiles_carrying(cj.topk(0.1), g) and _whiles_carrying(cj.e3m0(), g)
    assert not _whiles_carrying(cj.onebit(), g)  # materialize=False: p as XLA fuses it
    outs = {}
    for name in ("on", "off"):
        if name == "off":
            monkeypatch.setattr(base.ordering, "settled", lambda xs, count: xs)
        tx = cj.topk(0.1)
        state = tx.init(g)
        for _ in range(2):
            out, state = tx.update(g, state)
        outs[name] = (np.asarray(out), np.asarray(state.residual))
    np.testing.assert_array_equal(outs["on"][0], outs["off"][0])
    np.testing.assert_array_equal(outs["on"][1], outs["off"][1])
