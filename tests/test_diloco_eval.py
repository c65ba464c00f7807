"""Which parameters a DiLoCo run is evaluated with: ``cj.diloco_global_params`` against NumPy references.

The global model is the outer optimizer's iterate, kept per fragment in the state (as of the fragment's last
synchronization): it is neither a worker's local parameters nor their mean between synchronizations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compjax as cj
from compjax import parallel
from compjax.algorithms import fragment_assignment
from tests.helpers import AXIS
from tests.test_diloco import init_params, stack, targets

B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adamw's defaults


# --- NumPy reference ---------------------------------------------------------------------------------


def np_diloco_global(steps, n, *, H, P=1, tau=0, alpha=0.5, inner="sgd", lr=0.1, beta=0.0, wd=0.0, outer_lr=0.7,
                     momentum=0.9, seed=1):
    """DiLoCo (Douillard et al. 2023, Alg. 1) and Streaming DiLoCo (2025, Alg. 2) in float64 on the quadratic
    losses of ``targets``: per step, (each worker's local leaves, the global leaves θ_g).

    Inner: per worker, SGD(lr) with momentum beta (optax's: m ← g + beta m, θ ← θ - lr m) or AdamW(lr, 0.9,
    0.999, 1e-8, weight decay wd) on g = θ - c, its state never reset.  Fragment p (offset (p H) // P), tau = 0:
    after step s with (s - t_p) mod H == 0, Δ = θ_g - mean θ_i, θ_g ← θ_g + Nesterov-SGD(Δ), every worker takes
    θ_g.  With tau > 0: Δ_i stored then, exchanged tau steps later, when θ_g moves and the workers merge
    α θ_i + (1 - α) θ_g.
    """
    leaves0 = [x.astype(np.float64) for x in jax.tree.leaves(init_params())]
    frags = fragment_assignment(init_params(), P)
    offsets = [(p * H) // P for p in range(P)]
    theta = [[x.copy() for x in leaves0] for _ in range(n)]
    mu = [[np.zeros_like(x) for x in leaves0] for _ in range(n)]
    nu = [[np.zeros_like(x) for x in leaves0] for _ in range(n)]
    anchor = [x.copy() for x in leaves0]
    trace = [np.zeros_like(x) for x in leaves0]
    pending = [[np.zeros_like(x) for x in leaves0] for _ in range(n)]
    hist = []

    def outer_step(i, delta):  # optax.sgd(outer_lr, momentum, nesterov=True) on the averaged outer gradient
        trace[i] = delta + momentum * trace[i]
        anchor[i] = anchor[i] - outer_lr * (delta + momentum * trace[i])

    for t, c in enumerate(targets(steps, n, seed)):
        s = t + 1
        for w in range(n):
            cw = jax.tree.leaves(jax.tree.map(lambda x, w=w: x[w], c))
            for i, x in enumerate(theta[w]):
                g = x - cw[i]
                if inner == "sgd":
                    mu[w][i] = g + beta * mu[w][i]
                    theta[w][i] = x - lr * mu[w][i]
                else:
                    mu[w][i] = B1 * mu[w][i] + (1 - B1) * g
                    nu[w][i] = B2 * nu[w][i] + (1 - B2) * g * g
                    m_hat, v_hat = mu[w][i] / (1 - B1 ** s), nu[w][i] / (1 - B2 ** s)
                    theta[w][i] = x - lr * (m_hat / (np.sqrt(v_hat) + EPS) + wd * x)
        for p, idx in enumerate(frags):
            if tau == 0 and (s - offsets[p]) % H == 0:
                for i in idx:
                    outer_step(i, np.mean([anchor[i] - theta[w][i] for w in range(n)], 0))
                    for w in range(n):
                        theta[w][i] = anchor[i].copy()
            if tau:
                if s - tau >= 1 and (s - tau - offsets[p]) % H == 0:
                    for i in idx:
                        outer_step(i, np.mean([pending[w][i] for w in range(n)], 0))
                        for w in range(n):
                            theta[w][i] = alpha * theta[w][i] + (1 - alpha) * anchor[i]
                if (s - offsets[p]) % H == 0:
                    for i in idx:
                        for w in range(n):
                            pending[w][i] = anchor[i] - theta[w][i]
        hist.append(([[x.copy() for x in th] for th in theta], [x.copy() for x in anchor]))
    return hist


# --- runs under shard_map ----------------------------------------------------------------------------


def run_shard_map(tx, steps, n):
    """n workers under shard_map; per step the local params, the global model computed inside the step (one
    worker's layout) and outside it (worker-stacked layout), as NumPy trees with a leading worker axis."""
    mesh = parallel.make_mesh(n, AXIS)
    spec = P(AXIS)
    put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))

    def body(p, s, c):
        p, s, c = jax.tree.map(lambda x: x[0], (p, s, c))
        u, s = tx.update(jax.tree.map(lambda x, y: x - y, p, c), s, p)
        p = optax.apply_updates(p, u)
        return jax.tree.map(lambda x: x[None], (p, s, cj.diloco_global_params(s, p)))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    p, s = put(stack(init_params(), n)), put(stack(tx.init(init_params()), n))
    out = []
    for c in targets(steps, n):
        p, s, inside = jax.block_until_ready(f(p, s, put(c)))
        outside = cj.diloco_global_params(s, p)
        out.append(tuple(jax.tree.map(np.asarray, x) for x in (p, inside, outside)))
    return out


def check_against_reference(got, want, tol):
    """Every step: local params and, on every worker, the global model equal the reference's."""
    for t, ((local, inside, outside), (w_local, w_global)) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(jax.tree.leaves(inside), jax.tree.leaves(outside))):
            np.testing.assert_array_equal(a, b, err_msg=f"step {t + 1}: inside vs outside shard_map, leaf {j}")
            assert np.ptp(a, axis=0).max() == 0, f"step {t + 1}: the workers' global models differ"
            np.testing.assert_allclose(a[0], w_global[j], rtol=tol, atol=tol, err_msg=f"step {t + 1}, leaf {j}")
        for w, th in enumerate(w_local):
            for j, a in enumerate(jax.tree.leaves(local)):
                np.testing.assert_allclose(a[w], th[j], rtol=tol, atol=tol, err_msg=f"local, step {t + 1}")


def test_plain_diloco_global_model_matches_numpy_after_two_syncs_and_between():
    """4 workers, inner AdamW, H = 3: syncs after steps 3 and 6, then one more inner step."""
    n, H, steps = 4, 3, 7
    tx = cj.diloco(optax.adamw(0.05, weight_decay=0.1), sync_every=H, axis_name=AXIS)
    got = run_shard_map(tx, steps, n)
    want = np_diloco_global(steps, n, H=H, inner="adamw", lr=0.05, wd=0.1)
    check_against_reference(got, want, 2e-5)
    init = jax.tree.leaves(init_params())
    for t in (0, 1):  # before the first sync: the initialization, exactly
        for a, b in zip(jax.tree.leaves(got[t][1]), init):
            np.testing.assert_array_equal(a[0], b)
    # Step 7, between syncs: the global model of step 6, not the workers' local parameters nor their mean.
    local, glob, _ = got[6]
    for a, b, x in zip(jax.tree.leaves(glob), jax.tree.leaves(got[5][1]), jax.tree.leaves(local)):
        np.testing.assert_array_equal(a, b)
        assert np.abs(x - a).max() > 1e-2 and np.abs(x.mean(0) - a[0]).max() > 1e-3
    # Right after a sync the workers hold the global values (up to the rounding of params + updates).
    for a, x in zip(jax.tree.leaves(got[5][1]), jax.tree.leaves(got[5][0])):
        np.testing.assert_allclose(x, a, atol=1e-6)


def test_streaming_global_model_joins_each_fragments_last_merged_value():
    """4 workers, 2 fragments, H = 4, overlap 1: fragment 1 (offset 2) merges after steps 3 and 7, fragment 0
    after 5 and 9; a fragment whose outer gradient is pending (steps 4, 8 for fragment 0) keeps its last merged
    value."""
    n, H, Pf, steps = 4, 4, 2, 10
    tx = cj.diloco(optax.sgd(0.1, momentum=0.5), sync_every=H, fragments=Pf, overlap=1, alpha=0.5, axis_name=AXIS,
                   outer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    got = run_shard_map(tx, steps, n)
    want = np_diloco_global(steps, n, H=H, P=Pf, tau=1, alpha=0.5, lr=0.1, beta=0.5)
    check_against_reference(got, want, 1e-5)
    frags = fragment_assignment(init_params(), Pf)
    glob = [jax.tree.leaves(g[1]) for g in got]
    init = jax.tree.leaves(init_params())
    for i in frags[0]:
        np.testing.assert_array_equal(glob[3][i][0], init[i])  # step 4: Δ taken, not merged: still the init
        np.testing.assert_array_equal(glob[7][i], glob[4][i])  # step 8: pending again: the value of step 5
        assert np.abs(glob[4][i] - glob[3][i]).max() > 1e-3  # and it does move at its merges
    for i in frags[1]:
        np.testing.assert_array_equal(glob[5][i], glob[2][i])  # steps 3 to 6: fragment 1's merge of step 3
        assert np.abs(glob[6][i] - glob[5][i]).max() > 1e-3


# --- wrapped states, dtypes, buffers, bad input ----------------------------------------------------------


def run_one_worker(tx, steps, params=None, grads=None):
    """One worker (``axis_name=None``) on its quadratic loss (or the fixed ``grads``): the params after each step
    and the last state."""
    params = init_params() if params is None else params
    state = tx.init(params)
    update = jax.jit(tx.update)
    hist = []
    for c in targets(steps, 1):
        g = jax.tree.map(lambda x, y: x - y[0], params, c) if grads is None else grads
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        hist.append(params)
    return hist, state


def test_found_inside_chained_injected_and_guarded_states():
    def build(lr):
        return cj.diloco(optax.sgd(lr), sync_every=2, axis_name=None)

    (_, p2, p3), bare_state = run_one_worker(build(0.1), 3)
    want = cj.diloco_global_params(bare_state, p3)
    # After step 3 (one past the sync of step 2) the global model is step 2's params, not step 3's.
    for a, b, x in zip(jax.tree.leaves(want), jax.tree.leaves(p2), jax.tree.leaves(p3)):
        np.testing.assert_allclose(a, b, atol=1e-6)
        assert np.abs(np.asarray(x) - np.asarray(a)).max() > 1e-2
    for wrapped in (optax.chain(optax.identity(), build(0.1)),
                    optax.apply_if_finite(build(0.1), 3),
                    optax.chain(optax.inject_hyperparams(build)(lr=0.1))):
        hist, state = run_one_worker(wrapped, 3)
        for a, b in zip(jax.tree.leaves(cj.diloco_global_params(state, hist[-1])), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # a traced lr: another program, same math


def test_leaves_diloco_does_not_sync_come_from_params_and_dtypes_are_params():
    params = {"w": jnp.full((4, 3), 0.5, jnp.bfloat16), "b": jnp.ones(3), "n": jnp.zeros((), jnp.int32),
              "e": jnp.zeros((0,))}
    grads = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.ones(3), "n": jnp.zeros((), jnp.int32),
             "e": jnp.zeros((0,))}
    tx = cj.diloco(optax.sgd(0.1), sync_every=2, fragments=2, axis_name=None)
    (*_, params), state = run_one_worker(tx, 3, params, grads)
    given = {**params, "n": jnp.asarray(41, jnp.int32)}  # e.g. a step counter the caller keeps
    got = cj.diloco_global_params(state, given)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in params.items()}
    assert got["n"] == 41 and got["e"].shape == (0,)
    # The anchor holds w in float32: the global model casts it to bfloat16; b (float32) exactly.
    anchors = [x for frag in state.anchor for x in frag]
    assert {a.dtype for a in anchors} == {jnp.dtype(jnp.float32)} and len(anchors) == 2
    (b_anchor,), (w_anchor,) = state.anchor  # leaves in order b, e, n, w: b is fragment 0, w fragment 1
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w_anchor.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(got["b"]), np.asarray(b_anchor))


def test_result_holds_new_buffers_that_outlive_a_donated_state():
    (*_, params), state = run_one_worker(cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None), 2)
    got = cj.diloco_global_params(state, params)
    want = jax.tree.map(np.array, got)
    for x in jax.tree.leaves((state, params)):
        if isinstance(x, jax.Array):
            x.delete()  # what donating them to the next step does
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_worker_stacked_layout_outside_jit_keeps_the_sharding(mesh):
    (*_, params), state = run_one_worker(cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None), 3)
    n = mesh.shape[AXIS]
    p, s = parallel.replicate(params, mesh, AXIS), parallel.replicate(state, mesh, AXIS)
    got = cj.diloco_global_params(s, p)
    one = cj.diloco_global_params(state, params)
    for a, b, x in zip(jax.tree.leaves(got), jax.tree.leaves(one), jax.tree.leaves(p)):
        assert a.shape == (n, *b.shape) and a.sharding.is_equivalent_to(x.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.broadcast_to(np.asarray(b), a.shape))


@pytest.mark.parametrize(("case", "match"), [
    ("no diloco", r"opt_state must hold exactly one DilocoState .*found 0"),
    ("two dilocos", r"opt_state must hold exactly one DilocoState .*found 2"),
    ("missing leaf", r"params must be the parameters opt_state was built for: params has 8 floating-point leaves"),
    ("extra leaf", r"params must be the parameters opt_state was built for: params has 10 floating-point"),
    ("stacked state", r"params\['blocks'\]\[0\]\['b'\] has shape \(3,\), the DilocoState's global copy \(2, 3\)"),
    ("wrong shape", r"params\['embed'\] has shape \(4, 5\)"),
])
def test_bad_input_raises_naming_the_argument(case, match):
    params = init_params()
    state = cj.diloco(optax.sgd(0.1), sync_every=2, fragments=2, axis_name=None).init(params)
    args = {
        "no diloco": (optax.sgd(0.1).init(params), params),
        "two dilocos": ((state, state), params),
        "missing leaf": (state, {**params, "embed": None}),
        "extra leaf": (state, {**params, "more": np.ones(2, np.float32)}),
        "stacked state": (stack(state, 2), params),
        "wrong shape": (state, {**params, "embed": params["embed"].T}),
    }[case]
    with pytest.raises(ValueError, match=match):
        cj.diloco_global_params(*args)


# --- where runs are evaluated ------------------------------------------------------------------------


@pytest.mark.slow
def test_lm_testbed_evaluates_the_global_model():
    """experiments.lm.train reports val_loss_global: at step 0 the init, just after a sync the workers' (equal)
    model, one step later still the synced global model while the workers have moved."""
    from experiments.lm.train import holds_diloco_state, train

    rng = np.random.default_rng(0)
    words = ["the ", "king ", "and ", "queen ", "of ", "a ", "land ", "far ", "away, ", "said ", "she.\n"]
    text = "".join(rng.choice(words, size=6000))
    res = train(lambda ax: cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=ax), text=text,
                model_config={"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16}, steps=3, workers=4,
                batch_per_worker=2, seq_len=16, eval_every=2, eval_batches=1)
    assert res["eval_step"] == [0, 2, 3]
    glob, w0, mean = res["val_loss_global"], res["val_loss_worker0"], res["val_loss_mean"]
    assert glob[0] == w0[0] == mean[0]
    assert glob[1] == pytest.approx(w0[1], rel=1e-5) and glob[1] == pytest.approx(mean[1], rel=1e-5)
    assert glob[2] == glob[1] and w0[2] != glob[2] and mean[2] != glob[2]
    assert res["eval_compilations"] == 1
    assert not holds_diloco_state(optax.adamw(3e-3).init({"w": jnp.ones(2)}))
    chained = optax.chain(cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=None))
    assert holds_diloco_state(chained.init({"w": jnp.ones(2)}))


@pytest.mark.slow
def test_reproduction_reports_the_global_model_and_refuses_old_records():
    from experiments import config_cli
    from experiments.reproduce import diloco as repro

    config = config_cli.load(repro.DEFAULT_CONFIG)
    base = {"total_bytes": 100, "peak_bytes": 10, "payload_bytes": [10] * 10, "config": {"steps": 10}, "wall_s": 1.0}
    results = {"data-parallel": {**base, "row": "data-parallel", "val_loss_global": None, "val_loss_mean": [2.0],
                                 "val_loss_worker0": [2.0]},
               "streaming": {**base, "row": "streaming", "val_loss_global": [2.2], "val_loss_mean": [2.1],
                             "val_loss_worker0": [2.3]}}
    rows = {r["row"]: r for r in repro.summarize(results, config)}
    assert rows["data-parallel"]["val_loss_global"] == 2.0 and rows["streaming"]["val_loss_global"] == 2.2
    assert rows["streaming"]["vs_dp_pct"] == pytest.approx(10.0)
    assert "| 2.2000 | 2.1000 | 2.3000 | +10.00% |" in repro.table(list(rows.values()), config)
    del results["data-parallel"]["val_loss_global"]  # an older data-parallel record: its workers' common model
    assert repro.summarize(results, config) == list(rows.values())
    del results["streaming"]["val_loss_global"]  # an older DiLoCo record: its global model was never evaluated
    with pytest.raises(SystemExit, match="record of row 'streaming' has no val_loss_global"):
        repro.summarize(results, config)


# --- Flax NNX: the global model of a model and its nnx.Optimizer -----------------------------------------------


def test_nnx_global_model_and_swap_evaluate_the_global_model_of_a_worker_stacked_cnn(mesh):
    """An NNX CNN trained by DiLoCo (H = 2) on 8 workers with worker_step: after step 3 the workers' local
    parameters moved on; the global model is the one of the sync at step 2 (what the workers held right then)."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.head = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.mean(nnx.relu(self.conv(x)), axis=(1, 2)))

    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, cj.diloco(optax.sgd(0.1), sync_every=2, axis_name=AXIS), wrt=nnx.Param)
    parallel.nnx_replicate(mesh, model, optimizer)

    def train_step(model, optimizer, batch):
        x, y = batch
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    step = parallel.worker_step(train_step, mesh)
    rng = np.random.default_rng(0)
    local = []
    for _ in range(3):
        batch = (jnp.asarray(rng.normal(size=(16, 6, 6, 1)), jnp.float32), jnp.asarray(rng.normal(size=(16, 2)),
                                                                                        jnp.float32))
        step(model, optimizer, batch)
        local.append(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    glob = cj.diloco_global_model(model, optimizer)
    got = nnx.to_pure_dict(nnx.state(glob, nnx.Param))
    jax.tree.map(lambda g, s2, s3: (np.testing.assert_allclose(np.asarray(g), s2, atol=1e-6),
                                    np.testing.assert_array_equal(np.asarray(g)[0], np.asarray(g)[1])), got,
                 local[1], local[2])
    assert any(not np.allclose(a, b, atol=1e-6) for a, b in zip(jax.tree.leaves(local[1]), jax.tree.leaves(local[2])))
    x = jnp.ones((1, 6, 6, 1))
    want = parallel.nnx_unreplicate(glob)(x)  # the eval a user writes: one copy of the global model
    with cj.diloco_swap_global(model, optimizer) as m:
        np.testing.assert_array_equal(np.asarray(parallel.nnx_unreplicate(m)(x)), np.asarray(want))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.Param)), local[2])  # put back
    one = CNN(nnx.Rngs(0))  # one worker's model against the worker-stacked optimizer: refused, naming the layout
    with pytest.raises(ValueError, match=r"same layout -- both worker-stacked by parallel.nnx_replicate"):
        cj.diloco_global_model(one, optimizer)
