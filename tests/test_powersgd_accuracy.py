"""PowerSGD in float32 stays within 1e-5 (relative) of the same algorithm in float64.

The gradients are ill-conditioned on purpose: ``M = U diag(s) Vᵀ`` plus a
little noise, with singular values ``s`` from 1 down to 1e-3.  On one matrix
the spectrum has ``max(2, rank)`` values, so the rank-r factor ``P = M Q̂`` has
columns whose norms differ by up to 10³ and directions at the noise level
beyond: there, Gram-Schmidt in float32 loses orthogonality (its outputs land
1e-4 to 1e-3 away from float64 at ranks 2 to 8), where Householder QR stays
within ~1e-6.  Another matrix of the same shape (orthonormalized in the same
batch) carries the full spectrum, and a third, of another shape, a short one.

The reference is Algorithm 1 of Vogels et al. (NeurIPS 2019) with error
feedback, in float64, started from the same Q as ``cj.powersgd`` (read from its
state), warm-started, with Q orthonormalized before ``P = M Q̂`` at every step
and the same orthonormalization: Gram-Schmidt at rank 1, QR above.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from tests.helpers import AXIS, init_stacked

NUM_WORKERS = 4
STEPS = 8
TOL = 1e-5
NOISE = 1e-5
#: leaf -> (shape, singular values of the signal: "rank" for max(2, rank), "full" for min(m, n), or a number).
LEAVES = {
    "a": ((48, 64), "rank"),  # the (64, 48) matrix view
    "b": ((3, 4, 4, 64), "full"),  # also (64, 48): orthonormalized in one batch with "a"
    "c": ((40, 32), 2),  # (32, 40); at ranks 4 and 8, fewer signal directions than the rank
    "bias": ((64,), None),  # dense
}


# --- float64 reference ----------------------------------------------------------------------


def np_orthonormalize(p, method=None):
    """Columns of ``p`` (m, r) made orthonormal: Gram-Schmidt at r = 1, Householder QR above (float64)."""
    method = method or ("gram_schmidt" if p.shape[1] == 1 else "qr")
    if method == "qr":
        return np.linalg.qr(p, mode="reduced")[0]
    q = np.zeros_like(p)
    for i in range(p.shape[1]):
        v = p[:, i].copy()
        for j in range(i):
            v = v - (q[:, j] @ v) * q[:, j]
        q[:, i] = v / (np.linalg.norm(v) + 1e-8)
    return q


def to_matrix(x):
    """The (out, rest) matrix view of a leaf of shape (..., out)."""
    return x.reshape(-1, x.shape[-1]).T


def from_matrix(mat, shape):
    return mat.T.reshape(shape)


def np_powersgd_step(mats, q):
    """One PowerSGD step on the workers' matrices ``M_w = g_w + e_w`` (float64).

    Returns ``(output, new_q, residuals)``: the output ``P̂ Qᵀ`` every worker
    gets, the averaged Q (the next step's warm start) and each worker's
    ``M_w - output``.
    """
    q_hat = np_orthonormalize(q)
    p = np.mean([m @ q_hat for m in mats], axis=0)
    p_hat = np_orthonormalize(p)
    q = np.mean([m.T @ p_hat for m in mats], axis=0)
    out = p_hat @ q.T
    return out, q, [m - out for m in mats]


def np_powersgd(grads_steps, q0, compressed):
    """PowerSGD with error feedback over steps, in float64.

    Args:
      grads_steps: list over steps of ``{name: (W, *shape)}`` worker gradients.
      q0: ``{name: (rest, r)}`` initial Q of each compressed leaf.
      compressed: names of the leaves that go low-rank; the others are a dense mean.

    Returns:
      ``(outputs, residuals)``: per step ``{name: shape}`` outputs, and the final
      ``{name: (W, *shape)}`` residuals.
    """
    names = list(grads_steps[0])
    res = {k: np.zeros(grads_steps[0][k].shape) for k in names}
    q = {k: np.asarray(v, np.float64) for k, v in q0.items()}
    outs = []
    for g in grads_steps:
        out = {}
        for k in names:
            m_all = np.asarray(g[k], np.float64) + res[k]
            if k not in compressed:
                out[k], res[k] = m_all.mean(0), np.zeros_like(m_all)
                continue
            shape = m_all.shape[1:]
            o, q[k], r = np_powersgd_step([to_matrix(m) for m in m_all], q[k])
            out[k] = from_matrix(o, shape)
            res[k] = np.stack([from_matrix(x, shape) for x in r])
        outs.append(out)
    return outs, res


# --- test ----------------------------------------------------------------------------------


def ill_conditioned_grads(rank, seed=0):
    """Per step, ``{name: (W, *shape)}`` float32 gradients: a fixed ``U diag(s) Vᵀ`` plus fresh noise."""
    rng = np.random.default_rng(seed)
    signal = {}
    for name, (shape, spectrum) in LEAVES.items():
        if spectrum is None:
            continue
        m, n = shape[-1], int(np.prod(shape[:-1]))
        k = {"full": min(m, n), "rank": max(2, rank)}.get(spectrum, spectrum)
        u = np.linalg.qr(rng.normal(size=(m, k)))[0]
        v = np.linalg.qr(rng.normal(size=(n, k)))[0]
        signal[name] = (u * np.logspace(0, -3, k)) @ v.T
    steps = []
    for _ in range(STEPS):
        g = {}
        for name, (shape, _) in LEAVES.items():
            if name in signal:
                ws = [from_matrix(signal[name] + NOISE * rng.normal(size=signal[name].shape), shape)
                      for _ in range(NUM_WORKERS)]
            else:
                ws = [rng.normal(size=shape) for _ in range(NUM_WORKERS)]
            g[name] = np.stack(ws).astype(np.float32)
        steps.append(g)
    return steps


def relative_error(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("rank", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow),
                                  pytest.param(8, marks=pytest.mark.slow)])
def test_float32_powersgd_matches_float64_reference(rank):
    tx = cj.powersgd(rank=rank, min_compression_rate=0.0, axis_name=AXIS)
    state = init_stacked(tx, {k: jnp.zeros(s, jnp.float32) for k, (s, _) in LEAVES.items()}, NUM_WORKERS)
    compressed = [k for k in sorted(LEAVES) if LEAVES[k][1] is not None]  # dicts flatten in sorted key order
    assert len(state.q) == len(compressed)
    q0 = {k: q[0] for k, q in zip(compressed, state.q)}
    assert all(q.shape[1] == rank for q in q0.values())
    steps = ill_conditioned_grads(rank)
    want, want_res = np_powersgd(steps, q0, compressed)

    # As tests.helpers.run_workers(..., "vmap"), but compiled once for all steps.
    step = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    errors = []
    for t, g in enumerate(steps):
        out, state = jax.tree.map(np.asarray, step(g, state))
        for w in range(1, NUM_WORKERS):  # every worker gets the same output
            for k in LEAVES:
                np.testing.assert_array_equal(out[k][w], out[k][0])
        errors.append({k: relative_error(out[k][0], want[t][k]) for k in compressed})
        np.testing.assert_allclose(out["bias"][0], want[t]["bias"], rtol=1e-5, atol=1e-6)
    worst = max(max(e.values()) for e in errors)
    per_step = [f"{max(e.values()):.1e}" for e in errors]
    print(f"rank {rank}: max relative error {worst:.2e}; per step", per_step)  # shown with pytest -s
    for t, e in enumerate(errors):
        for k, err in e.items():
            assert err <= TOL, f"rank {rank}, step {t}, leaf {k}: relative error {err:.2e} > {TOL:g}"
    for k in compressed:  # the residuals follow the reference too, relative to the last step's M = g + e
        m_last = want_res[k] + want[-1][k]
        err = np.linalg.norm(np.asarray(state.residual[k], np.float64) - want_res[k]) / np.linalg.norm(m_last)
        assert err <= TOL, f"rank {rank}, residual of {k}: relative error {err:.2e} > {TOL:g}"


def test_warm_q_is_orthonormalized_before_p():
    """A warm Q with nearly parallel columns: Q̂ = orthonormalize(Q) is exact here, M Q itself is not.

    ``Q = [e1, e1 + 2**-22 e2]`` spans the same plane as ``[e1, e2]``, so in exact
    arithmetic the output does not depend on orthonormalizing Q first; in
    float32, ``P = M Q`` without it keeps only a few bits of ``M e2`` in its
    second column (the rest is rounding of ``M e1``), and the output drifts.
    """
    m, n, rank = 24, 16, 2
    rng = np.random.default_rng(3)
    g = rng.normal(size=(NUM_WORKERS, n, m)).astype(np.float32)  # leaves (rest, out): matrices (out, rest)
    q = np.zeros((n, rank), np.float32)
    q[0, :] = 1.0
    q[1, 1] = 2.0**-22
    tx = cj.powersgd(rank=rank, min_compression_rate=0.0, axis_name=AXIS)
    state = init_stacked(tx, {"w": jnp.zeros((n, m))}, NUM_WORKERS)
    state = state._replace(q=(np.stack([q] * NUM_WORKERS),))
    (want,), _ = np_powersgd([{"w": g}], {"w": q}, ["w"])
    out, _ = jax.jit(jax.vmap(tx.update, axis_name=AXIS))({"w": g}, state)
    assert relative_error(out["w"][0], want["w"]) <= TOL
