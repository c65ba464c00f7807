"""Federated learning with compressed uplinks (cj.federated): NumPy references written from the update rules,
the c = mean(c_i) invariant, partial participation, vmapped == sharded, bytes == audit, splits, bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax as cj
from compjax.algorithms.federated import uplink

N, K, B, LR = 6, 3, 4, 0.1
AX = "clients"


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def data(num_clients=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_clients, K, B, 3)).astype(np.float32)
    y = (rng.normal(size=(num_clients, K, B, 2)) + np.arange(num_clients)[:, None, None, None]).astype(np.float32)
    return x, y  # client i's targets are shifted by i: heterogeneous optima


P0 = {"w": np.full((3, 2), 0.1, np.float32), "b": np.zeros(2, np.float32)}


# ---------------------------------------------------------------- NumPy references (float64)

def np_grad(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"w": 2 * x.T @ r / r.size, "b": 2 * r.sum(0) / r.size}


def np_local(p, corr, xs, ys):
    """K local steps y <- y - lr (g(y) + c - c_i) (Karimireddy et al. 2020, Alg. 1 line 10)."""
    y = {k: v.astype(np.float64).copy() for k, v in p.items()}
    for x, t in zip(xs, ys):
        g = np_grad(y, x.astype(np.float64), t.astype(np.float64))
        y = {k: y[k] - LR * (g[k] + corr[k]) for k in y}
    return y


def zeros():
    return {k: np.zeros(v.shape) for k, v in P0.items()}


def np_single_message(picks, X, Y, *, kind, compress, alpha=1.0, beta=1.0, glr=1.0, num_clients=N):
    """Single-message SCAFFOLD / SCALLION / SCAFCOM, written from the update rules in the docstrings.

    compress(t, s, msg) -> what slot s sends in round t (decoded).
    """
    x = {k: v.astype(np.float64) for k, v in P0.items()}
    c, ci, v = zeros(), [zeros() for _ in range(num_clients)], [zeros() for _ in range(num_clients)]
    for t, clients in enumerate(picks):
        sent = []
        for s, i in enumerate(clients):
            y = np_local(x, {k: c[k] - ci[i][k] for k in c}, X[i], Y[i])
            g = {k: (x[k] - y[k]) / (K * LR) for k in x}
            if kind == "scallion":  # delta = alpha ((x - y)/(K lr) - c)
                m = {k: alpha * (g[k] - c[k]) for k in x}
            else:  # SCAFCOM: v <- (1 - beta) v + beta ((x - y)/(K lr) + c_i - c); send C(v - c_i)
                v[i] = {k: (1 - beta) * v[i][k] + beta * (g[k] + ci[i][k] - c[k]) for k in x}
                m = {k: v[i][k] - ci[i][k] for k in x}
            sent.append(compress(t, s, m))
        for s, i in enumerate(clients):
            ci[i] = {k: ci[i][k] + sent[s][k] for k in x}
        mean = {k: np.mean([d[k] for d in sent], axis=0) for k in x}
        x = {k: x[k] - glr * K * LR * (c[k] + mean[k]) for k in x}
        c = {k: c[k] + len(clients) / num_clients * mean[k] for k in x}
    return x, c, ci, v


def np_topk(ratio):
    def compress(t, s, m):
        out = {}
        for k, a in m.items():
            flat = a.ravel()
            kk = min(flat.size, max(1, math.ceil(ratio * flat.size)))
            keep = np.argsort(-np.abs(flat), kind="stable")[:kk]
            z = np.zeros_like(flat)
            z[keep] = flat[keep]
            out[k] = z.reshape(a.shape)
        return out
    return compress


def run(alg, picks, X, Y, state=None):
    state = alg.init(P0) if state is None else state
    for clients in picks:
        cl = jnp.asarray(clients, jnp.int32)
        state, _info = alg.round(state, cl, (jnp.asarray(X)[cl], jnp.asarray(Y)[cl]))
    return state


def assert_tree_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=tol, rtol=tol)


def assert_invariant(state, tol=1e-6):
    """The global control variate equals the mean of the N clients' control variates."""
    for c, ci in zip(jax.tree.leaves(state.server.control), jax.tree.leaves(state.clients.control)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(ci).mean(0), atol=tol)


# ---------------------------------------------------------------- exactness against references

def test_scallion_identity_is_single_message_scaffold_and_classic_scaffold():
    """identity, alpha = 1, full participation, 5 rounds: SCALLION == single-message SCAFFOLD (NumPy,
    Huang et al. Alg. 1 form) == classic two-message SCAFFOLD option II (Karimireddy et al. Alg. 1) to 1e-5."""
    X, Y = data()
    picks = [list(range(N))] * 5
    common = {"num_clients": N, "participation": 1.0, "local_steps": K, "local_lr": LR}
    scal = run(cj.federated.scallion(loss_fn, alpha=1.0, **common), picks, X, Y)
    classic = run(cj.federated.scaffold(loss_fn, **common), picks, X, Y)
    x, c, ci, _ = np_single_message(picks, X, Y, kind="scallion", compress=lambda t, s, m: m)
    assert_tree_close(scal.server.params, x)
    assert_tree_close(scal.server.control, c)
    assert_tree_close(scal.clients.control, {k: np.stack([d[k] for d in ci]) for k in x})
    assert_tree_close(classic.server, scal.server)
    assert_tree_close(classic.clients, scal.clients)
    assert int(scal.server.round) == 5
    assert_invariant(scal)
    assert_invariant(classic)
    d = sum(np.size(v) for v in P0.values())
    assert cj.payload_bytes(classic).tolist() == [8 * d] * N   # two float32 messages
    assert cj.payload_bytes(scal).tolist() == [4 * d] * N      # one: the uplink halved


PARTIAL = [[0, 2, 3, 5], [1, 2, 4, 5]]  # 4 of N = 6 clients per round


def np_fedavg(picks, X, Y, *, compress, glr):
    """FedAvg (McMahan et al. 2017, Alg. 1) with a server learning rate (Reddi et al. 2021, Alg. 1, SGD server):
    y_i = K local SGD steps from x;  x <- x + glr * mean_S C(y_i - x).  compress(t, s, delta) -> decoded delta."""
    x = {k: v.astype(np.float64) for k, v in P0.items()}
    for t, clients in enumerate(picks):
        sent = [compress(t, s, {k: y[k] - x[k] for k in x}) for s, y in
                enumerate(np_local(x, zeros(), X[i], Y[i]) for i in clients)]
        x = {k: x[k] + glr * np.mean([d[k] for d in sent], axis=0) for k in x}
    return x


@pytest.mark.parametrize("compressed", [False, True], ids=["fp32", "topk"])
def test_fedavg_matches_numpy_reference_with_a_server_learning_rate(compressed):
    """FedAvg and compressed FedAvg (top-k, no error feedback), global_lr = 0.6, 3 rounds, 4 of 6 clients, against
    NumPy: x <- x + 0.6 mean_S C(y_i - x) (a flipped sign, or global_lr dropped, would move x elsewhere)."""
    X, Y = data(seed=6)
    picks = PARTIAL + [[0, 1, 3, 4]]
    comp = cj.topk(0.34, error_feedback=False, axis_name=AX) if compressed else None
    alg = cj.federated.fedavg(loss_fn, num_clients=N, participation=4 / N, local_steps=K, local_lr=LR,
                              global_lr=0.6, compressor=comp)
    state = run(alg, picks, X, Y)
    x = np_fedavg(picks, X, Y, compress=np_topk(0.34) if compressed else (lambda t, s, m: m), glr=0.6)
    assert_tree_close(state.server.params, x)
    assert int(state.server.round) == 3 and state.server.control is None
    moved = max(np.abs(x[k] - P0[k]).max() for k in x)
    assert moved > 0.1  # the rounds moved x: the reference is not x0 == x0
    d = sum(np.size(v) for v in P0.values())
    assert cj.payload_bytes(state).tolist() == ([(3 + 1) * 8 + 4] if compressed else [4 * d]) * 4


@pytest.mark.parametrize("beta", [0.2, 0.3])
def test_scafcom_topk_matches_numpy_reference(beta):
    """SCAFCOM (Huang et al. Alg. 3), top-k without error feedback, 2 rounds, 4 of 6 clients; beta = 0.2 (the
    paper's) and 0.3: v_i <- (1 - beta) v_i + beta (...), not beta v_i + (1 - beta) (...) (the same at 0.5)."""
    X, Y = data()
    alg = cj.federated.scafcom(loss_fn, num_clients=N, participation=4 / N, local_steps=K, local_lr=LR, beta=beta,
                               global_lr=0.8, compressor=cj.topk(0.34, error_feedback=False, axis_name=AX))
    state = run(alg, PARTIAL[:1], X, Y)
    after_one = state.clients
    state = run(alg, PARTIAL[1:], X, Y, state)
    x, c, ci, v = np_single_message(PARTIAL, X, Y, kind="scafcom", compress=np_topk(0.34), beta=beta, glr=0.8)
    assert_tree_close(state.server.params, x)
    assert_tree_close(state.server.control, c)
    assert_tree_close(state.clients.control, {k: np.stack([d[k] for d in ci]) for k in x})
    assert_tree_close(state.clients.momentum, {k: np.stack([d[k] for d in v]) for k in x})
    assert_invariant(state)
    # Client 3 took part in round 1 only: round 2 left its state untouched (bitwise); client 0 likewise.
    for a, b in zip(jax.tree.leaves(after_one), jax.tree.leaves(state.clients)):
        np.testing.assert_array_equal(np.asarray(a)[[0, 3]], np.asarray(b)[[0, 3]])
    # Uplink: per layer k = ceil(0.34 * size) int32 indices + float32 values (w: 6 -> 3, b: 2 -> 1), + the vote.
    assert cj.payload_bytes(state).tolist() == [(3 + 1) * 8 + 4] * 4


def randomk_oracle(comp, rounds, slots):
    """C_{t,s}(1) for every round t and slot s, from the compressor's public update alone: slot s sends ones,
    every other slot zeros; S times the mean is what slot s sent. Random-k is elementwise: C(m) = C(1) * m."""
    st0 = comp.init(P0)

    @jax.jit
    def sent_by(slot, count):
        st = jax.tree.map(lambda a: jnp.stack([a] * slots), st0._replace(count=jnp.asarray(count, jnp.int32)))
        ones = {k: jnp.zeros((slots, *v.shape)).at[slot].set(1.0) for k, v in P0.items()}
        mean = jax.vmap(lambda m, s: comp.update(m, s)[0], axis_name=AX)(ones, st)
        return jax.tree.map(lambda a: a[0] * slots, mean)

    return [[jax.tree.map(np.asarray, sent_by(s, t)) for s in range(slots)] for t in range(rounds)]


def test_scallion_randomk_unbiased_matches_numpy_reference():
    """SCALLION (Huang et al. Alg. 2) with unbiased random-k (d/k scaling), alpha = 0.5, 2 rounds, 4 of 6."""
    X, Y = data(seed=1)
    comp = cj.randomk(0.5, key=7, error_feedback=False, axis_name=AX)
    alg = cj.federated.scallion(loss_fn, num_clients=N, participation=4 / N, local_steps=K, local_lr=LR, alpha=0.5,
                                compressor=comp)
    state = run(alg, PARTIAL, X, Y)
    masks = randomk_oracle(comp, 2, 4)
    for t in range(2):
        for s in range(4):  # k of d entries, each scaled by d / k: unbiased
            for m in masks[t][s].values():
                d = m.size
                kk = math.ceil(0.5 * d)
                assert np.count_nonzero(m) == kk and np.allclose(m[m != 0], d / kk)
    x, c, ci, _ = np_single_message(PARTIAL, X, Y, kind="scallion", alpha=0.5,
                                    compress=lambda t, s, m: {k: masks[t][s][k] * m[k] for k in m})
    assert_tree_close(state.server.params, x)
    assert_tree_close(state.server.control, c)
    assert_tree_close(state.clients.control, {k: np.stack([d[k] for d in ci]) for k in x})
    assert_invariant(state)


def test_classic_scaffold_partial_participation_keeps_c_mean_of_ci():
    """Classic SCAFFOLD with 4 of 6 clients over 3 rounds equals its single-message form; c == mean c_i."""
    X, Y = data(seed=2)
    picks = PARTIAL + [[0, 1, 3, 4]]
    common = {"num_clients": N, "participation": 4 / N, "local_steps": K, "local_lr": LR, "global_lr": 0.7}
    classic = run(cj.federated.scaffold(loss_fn, **common), picks, X, Y)
    single = run(cj.federated.scaffold(loss_fn, single_message=True, **common), picks, X, Y)
    assert_invariant(classic)
    assert_tree_close(classic.server, single.server)
    assert_tree_close(classic.clients, single.clients)
    assert np.abs(np.asarray(classic.server.control["w"])).max() > 1e-3  # the invariant is not 0 == 0


@pytest.mark.parametrize("which", ["fedavg", "scafcom"])
def test_a_round_with_a_nonfinite_client_is_skipped_and_changes_nothing(which):
    """One participant's loss is NaN and the uplink votes (top-k, skip_nonfinite=True): RoundInfo.skipped, and the
    server's parameters, control variate and round, every c_i and v_i are bitwise as before; the next round then
    gives bitwise what it gives without the skipped round in between."""
    X, Y = data(seed=7)
    comp = cj.topk(0.5, error_feedback=False, skip_nonfinite=True, axis_name=AX)
    common = {"num_clients": N, "participation": 4 / N, "local_steps": K, "local_lr": LR, "global_lr": 0.8,
              "compressor": comp}
    alg = cj.federated.scafcom(loss_fn, beta=0.3, **common) if which == "scafcom" else cj.federated.fedavg(
        loss_fn, **common)
    first, second = PARTIAL
    before = run(alg, [first], X, Y)
    Xbad = X.copy()
    Xbad[second[1], 1, 2, 0] = np.nan  # client 2 (slot 1): NaN from its second local step on
    cl = jnp.asarray(second, jnp.int32)
    after, info = alg.round(before, cl, (jnp.asarray(Xbad)[cl], jnp.asarray(Y)[cl]))
    assert bool(info.skipped)
    loss = np.asarray(info.loss)
    assert np.isnan(loss[1]) and np.isfinite(np.delete(loss, 1)).all()
    kept = (before.server, before.clients), (after.server, after.clients)
    assert len(jax.tree.leaves(kept[0])) == (9 if which == "scafcom" else 3)  # x (2 leaves), c, round; c_i, v_i
    for a, b in zip(*(jax.tree.leaves(t) for t in kept), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if which == "scafcom":
        assert np.abs(np.asarray(before.clients.momentum["w"])).max() > 0  # kept means something: they had moved
    assert int(after.server.round) == 1 and int(after.comm.skipped[0]) == 1
    # The round after: as if the skipped one had not happened.
    again, info = alg.round(after, cl, (jnp.asarray(X)[cl], jnp.asarray(Y)[cl]))
    straight = run(alg, [second], X, Y, before)
    assert not bool(info.skipped) and int(again.server.round) == 2
    for a, b in zip(*(jax.tree.leaves((t.server, t.clients)) for t in (again, straight)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _clients_sent(comp, msg, clients=4):
    """Every client's (mean, sent) of one uplink exchange under jax.vmap over the client axis."""
    st = jax.tree.map(lambda a: jnp.stack([a] * clients), comp.init(jax.tree.map(lambda x: x[0], msg)))
    up = jax.jit(jax.vmap(lambda m, s: uplink.exchange(comp, m, s, sent=True), axis_name=AX))(msg, st)
    return up.mean, up.sent


def test_sent_is_the_numpy_decoded_topk_payload():
    """What each client sent, from the pipeline (uplink.exchange(..., sent=True), i.e. base.update_with_sent), is its
    top-k payload decoded in NumPy (the k largest |entries| of each leaf, zeros elsewhere); an integer leaf passes
    through as itself; the uplink mean is the mean of the clients' payloads; a skipped exchange sent zeros."""
    rng = np.random.default_rng(5)
    msg = {"w": jnp.asarray(rng.normal(size=(4, 5, 2)), jnp.float32), "b": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
           "n": jnp.arange(8, dtype=jnp.int32).reshape(4, 2)}
    comp = cj.topk(0.34, error_feedback=False, axis_name=AX)
    mean, sent = _clients_sent(comp, msg)
    for s in range(4):
        ref = np_topk(0.34)(0, s, {k: np.asarray(msg[k][s]) for k in ("w", "b")})
        for k in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(sent[k][s]), ref[k])
    np.testing.assert_array_equal(np.asarray(sent["n"]), np.asarray(msg["n"]))
    assert np.count_nonzero(np.asarray(sent["w"][0])) == 4 and np.count_nonzero(np.asarray(sent["b"][0])) == 2
    assert_tree_close({k: mean[k][0] for k in ("w", "b")}, {k: np.asarray(sent[k]).mean(0) for k in ("w", "b")}, 1e-6)
    bad = {**msg, "w": msg["w"].at[2, 0, 0].set(jnp.nan)}   # client 2 votes the exchange away
    mean, sent = _clients_sent(cj.topk(0.34, error_feedback=False, skip_nonfinite=True, axis_name=AX), bad)
    for k in ("w", "b"):
        assert not np.asarray(sent[k]).any() and not np.asarray(mean[k]).any()


@pytest.mark.parametrize("name", ["identity", "randomk", "qsgd", "cast-bf16", "cast-fp16", "signsgd", "e3m0"])
def test_sent_averages_to_the_uplink_mean(name):
    """For every compressor a SCALLION or SCAFCOM client can use, the clients' decoded payloads average to the
    uplink collective's mean (random-k and QSGD: keyed by slot, so the draws are the exchange's own; fp16: its
    all-reduce divides by the 4 clients before summing, in fp16); random-k without error feedback sends k of d
    entries of each leaf scaled by d / k (unbiased)."""
    comp = {"identity": lambda: cj.identity(AX), "randomk": lambda: cj.randomk(0.5, key=0, error_feedback=False,
                                                                             axis_name=AX),
            "qsgd": lambda: cj.qsgd(4, key=3, axis_name=AX), "cast-bf16": lambda: cj.cast(jnp.bfloat16, axis_name=AX),
            "cast-fp16": lambda: cj.cast(jnp.float16, axis_name=AX),
            "signsgd": lambda: cj.signsgd(error_feedback=False, axis_name=AX), "e3m0": lambda: cj.e3m0(axis_name=AX),
            }[name]()
    msg = {"w": jax.random.normal(jax.random.PRNGKey(0), (4, 5, 2)), "b": jax.random.normal(jax.random.PRNGKey(1), (4, 2))}
    mean, sent = _clients_sent(comp, msg)
    assert_tree_close(jax.tree.map(lambda a: a[0], mean), jax.tree.map(lambda a: np.asarray(a).mean(0), sent),
                      1e-3 if name == "cast-fp16" else 1e-6)
    if name == "identity":
        assert_tree_close(sent, msg, 0)
    else:
        assert not np.allclose(np.asarray(sent["w"]), np.asarray(msg["w"]))  # it did compress
    if name == "randomk":
        for k in ("w", "b"):
            got, m = np.asarray(sent[k]).reshape(4, -1), np.asarray(msg[k]).reshape(4, -1)
            d = m.shape[1]
            kk = math.ceil(0.5 * d)
            assert (np.count_nonzero(got, axis=1) == kk).all()
            np.testing.assert_allclose(got[got != 0], (d / kk) * m[got != 0], rtol=1e-6)
            assert len({tuple(np.flatnonzero(r)) for r in got}) > 1  # each slot draws its own entries


def test_update_with_sent_refuses_what_cannot_tell():
    """update_with_sent: ValueError for an optax transformation that is no compjax compressor, and for a compressor
    whose exchange does not report what it sent (TernGrad: its scaler is shared by all workers)."""
    from compjax.compressors.base import update_with_sent

    g = {"w": jnp.ones(4)}
    sgd = optax_sgd()
    with pytest.raises(ValueError, match="compjax compressor"):
        update_with_sent(sgd, g, sgd.init(g))
    tern = cj.terngrad(key=0)
    with pytest.raises(ValueError, match="does not report what it sent"):
        update_with_sent(tern, g, tern.init(g))
    top = cj.topk(0.5, error_feedback=False)
    mean, state, sent = update_with_sent(top, g, top.init(g))  # one worker: the mean is what it sent
    assert_tree_close(mean, sent, 0)
    assert int(state.count) == 1


def test_update_with_sent_on_sharded_parameters_gives_each_device_its_shard(mesh):
    """On a 2 x 2 (slow x fast) mesh with "w" sharded over the fast axis (FSDP layout), what each device gets back
    as sent is its shard of what the replicated layout sends: the whole layer's top-k, then sliced."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from compjax import layout
    from compjax.compressors.base import update_with_sent

    mesh = jax.make_mesh((2, 2), ("slow", "fast"), devices=mesh.devices.ravel()[:4])
    rng = np.random.default_rng(0)
    g = {"b": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32), "w": jnp.asarray(rng.normal(size=(2, 8, 3)), jnp.float32)}
    tx = cj.topk(0.25, error_feedback=False, axis_name="slow")
    st = jax.vmap(tx.init)(g)

    def run(specs, dims):
        def body(g, s):
            g, s = jax.tree.map(lambda a: a[0], (g, s))
            with layout.fast_layout("fast", g, dims):
                _, _, sent = update_with_sent(tx, g, s)
            return jax.tree.map(lambda a: a[None], sent)

        put = lambda t, sp: jax.tree.map(lambda a, p: jax.device_put(a, NamedSharding(mesh, p)), t, sp)
        st_specs = jax.tree.map(lambda a: P("slow"), st)
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, st_specs), out_specs=specs))
        return jax.tree.map(np.asarray, step(put(g, specs), put(st, st_specs)))

    sharded = run({"b": P("slow"), "w": P("slow", "fast")}, [None, 0])
    whole = run({"b": P("slow"), "w": P("slow")}, None)
    assert_tree_close(sharded, whole, 0)
    assert [np.count_nonzero(sharded["w"][s]) for s in range(2)] == [6, 6]  # 25 % of the whole layer's 24 entries


# ---------------------------------------------------------------- vmap vs shard_map, bytes vs audit

@pytest.mark.parametrize("which", ["scallion-randomk", "scallion-qsgd", "scafcom-topk"])
def test_vmapped_and_sharded_agree_and_bytes_are_audited(mesh, which):
    """One round's numbers under jax.vmap and under jax.shard_map agree, and the bytes are the audited ones (QSGD with
    the non-finite vote: each client's decoded message comes from the exchange itself under shard_map too)."""
    n, s = 12, 8
    X, Y = data(n, seed=3)
    mesh = jax.make_mesh((s,), (AX,), devices=mesh.devices.ravel()[:s])
    common = {"num_clients": n, "participation": s / n, "local_steps": K, "local_lr": LR}
    if which == "scallion-randomk":
        alg = cj.federated.scallion(loss_fn, alpha=0.5, compressor=cj.randomk(
            0.5, key=1, error_feedback=False, skip_nonfinite=False, axis_name=AX), **common)
    elif which == "scallion-qsgd":
        alg = cj.federated.scallion(loss_fn, alpha=0.5, compressor=cj.qsgd(16, key=2, axis_name=AX), **common)
    else:
        alg = cj.federated.scafcom(loss_fn, compressor=cj.topk(0.5, error_feedback=False, axis_name=AX), **common)
    sharded = alg.sharded(mesh)
    a = b = alg.init(P0)
    for r in range(2):
        cl = alg.sample_clients(jax.random.PRNGKey(r))
        batches = (jnp.asarray(X)[cl], jnp.asarray(Y)[cl])
        a, info_a = alg.round(a, cl, batches)
        b, info_b = sharded(b, cl, batches)
        np.testing.assert_allclose(np.asarray(info_a.loss), np.asarray(info_b.loss), rtol=1e-6)
    assert_tree_close(a.server, b.server, 1e-6)
    assert_tree_close(a.clients, b.clients, 1e-6)
    assert_invariant(b)
    audit = cj.audit_collectives(sharded.step, *sharded.args(b, cl, batches))
    sent = cj.payload_bytes(b)
    assert sent.tolist() == [sum(op.bytes for op in audit)] * s and sent[0] > 0
    assert {op.op for op in audit} <= {"all-gather", "all-reduce"}


# ---------------------------------------------------------------- determinism, splits, bad input

def test_same_seed_same_result():
    """Two runs from the same seed (client sampling, minibatches, random-k keys) are bitwise equal; another seed differs."""
    X, Y = data(seed=4)
    padded, counts = cj.federated.pad_clients((X.reshape(-1, 3), Y.reshape(-1, 2)),
                                              np.arange(N * K * B).reshape(N, K * B))
    alg = cj.federated.scallion(loss_fn, num_clients=N, participation=0.5, local_steps=K, local_lr=LR,
                                compressor=cj.randomk(0.5, key=3, error_feedback=False, axis_name=AX))

    @jax.jit
    def step(state, key):
        k1, k2 = jax.random.split(key)
        cl = alg.sample_clients(k1)
        return alg.round(state, cl, cj.federated.sample_batches(k2, padded, counts, cl, K, B))[0]

    def go(seed):
        state = alg.init(P0)
        for r in range(2):
            state = step(state, jax.random.fold_in(jax.random.PRNGKey(seed), r))
        return jax.tree.leaves(state)

    first, second, other = go(0), go(0), go(1)
    for x, y in zip(first, second):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(first[0]), np.asarray(other[0]))


def test_state_resumes_bit_exact_from_a_checkpoint(tmp_path):
    """SCAFCOM: 2 rounds, save (compjax.checkpoint), restore onto a fresh state, 2 more == 4 rounds straight."""
    from compjax.checkpoint import Checkpointer

    X, Y = data(seed=5)
    alg = cj.federated.scafcom(loss_fn, num_clients=N, participation=0.5, local_steps=K, local_lr=LR,
                               compressor=cj.topk(0.5, error_feedback=False, axis_name=AX))
    step = jax.jit(lambda state, cl: alg.round(state, cl, (jnp.asarray(X)[cl], jnp.asarray(Y)[cl]))[0])
    picks = [jnp.array(p) for p in ([0, 2, 4], [1, 2, 5], [3, 4, 5], [0, 1, 3])]
    state = alg.init(P0)
    for cl in picks[:2]:
        state = step(state, cl)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state)
        resumed, _ = ckpt.restore(alg.init(P0))
    assert type(resumed).__name__ == "FederatedState"
    for cl in picks[2:]:
        state, resumed = step(state, cl), step(resumed, cl)
    assert np.abs(np.asarray(state.clients.control["w"])).max() > 0  # the clients' control variates moved
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_splits_are_seeded_partitions_with_the_asked_heterogeneity():
    y = np.repeat(np.arange(10), 60)
    parts = cj.federated.classes_per_client_split(y, 20, 2, seed=0)
    hist = cj.federated.label_histogram(y, parts, 10)
    assert hist.shape == (20, 10) and hist.sum() == y.size
    assert ((hist > 0).sum(1) == 2).all()                     # exactly 2 classes per client
    assert ((hist > 0).sum(0) == 4).all()                     # each class held by N c / K = 4 clients
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(y.size))
    again = cj.federated.classes_per_client_split(y, 20, 2, seed=0)
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))
    other = cj.federated.classes_per_client_split(y, 20, 2, seed=1)
    assert not all(np.array_equal(p, q) for p, q in zip(parts, other))
    d = cj.federated.dirichlet_split(y, 20, 0.1, seed=0)
    assert np.array_equal(np.sort(np.concatenate(d)), np.arange(y.size))
    assert all(np.array_equal(p, q) for p, q in zip(d, cj.federated.dirichlet_split(y, 20, 0.1, seed=0)))
    few = (cj.federated.label_histogram(y, d, 10) > 0).sum(1).mean()
    many = (cj.federated.label_histogram(y, cj.federated.dirichlet_split(y, 20, 100.0, seed=0), 10) > 0).sum(1).mean()
    assert few < 4 and many > 9  # small alpha: few classes per client; large alpha: nearly all


def test_sample_clients_draws_s_distinct_clients_by_key():
    draw = jax.jit(lambda k: cj.federated.sample_clients(k, 20, 5))
    draws = [np.asarray(draw(jax.random.PRNGKey(k))) for k in range(40)]
    for d in draws:
        assert d.shape == (5,) and (np.diff(d) > 0).all() and 0 <= d.min() and d.max() < 20
    assert len({tuple(d) for d in draws}) > 35                       # the key decides who takes part
    assert np.array_equal(draws[3], np.asarray(draw(jax.random.PRNGKey(3))))
    assert np.bincount(np.concatenate(draws), minlength=20).min() > 0  # every client gets its turn
    assert cj.federated.clients_per_round(200, 0.1) == 20 and cj.federated.clients_per_round(10, 0.01) == 1


def _alg(factory, **kw):
    base = {"num_clients": 10, "participation": 0.5, "local_steps": 2, "local_lr": 0.1}
    return factory(loss_fn, **{**base, **kw})


@pytest.mark.parametrize("call, match", [
    (lambda: _alg(cj.federated.fedavg, participation=0.0), "participation"),
    (lambda: _alg(cj.federated.scaffold, participation=1.5), "participation"),
    (lambda: _alg(cj.federated.scallion, num_clients=0), "num_clients"),
    (lambda: _alg(cj.federated.scafcom, local_steps=0), "local_steps"),
    (lambda: _alg(cj.federated.scallion, alpha=0.0), "alpha"),
    (lambda: _alg(cj.federated.scafcom, beta=1.5), "beta"),
    (lambda: _alg(cj.federated.fedavg, local_lr=0.0), "local_lr"),
    (lambda: cj.federated.dirichlet_split(np.arange(10) % 3, 4, 0.0, seed=0), "alpha"),
    (lambda: cj.federated.dirichlet_split(np.arange(10) % 3, 4, -1.0, seed=0), "alpha"),
    (lambda: cj.federated.classes_per_client_split(np.arange(10) % 3, 4, 4, seed=0), "classes_per_client"),
    (lambda: cj.federated.clients_per_round(0, 0.5), "num_clients"),
    (lambda: _alg(cj.federated.scallion, compressor=cj.topk(0.1, error_feedback=False, axis_name=AX)),
     "biased compressor; SCALLION"),
    (lambda: _alg(cj.federated.scafcom, compressor=cj.randomk(0.1, key=0, error_feedback=False, axis_name=AX)),
     "unbiased compressor"),
    (lambda: _alg(cj.federated.scafcom, compressor=cj.topk(0.1, axis_name=AX)), "error_feedback=False"),
    (lambda: _alg(cj.federated.fedavg, compressor=cj.topk(0.1, error_feedback=False, axis_name="data")),
     "axis_name='clients'"),
    (lambda: _alg(cj.federated.fedavg, compressor=cj.topk(0.1, error_feedback=False)), "not axis_name=None"),
    (lambda: _alg(cj.federated.scallion, compressor=cj.terngrad(key=0, axis_name=AX)), "cannot know"),
    (lambda: _alg(cj.federated.fedavg, compressor=optax_sgd()), "compressor"),
])
def test_bad_input_raises_at_build_time(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def optax_sgd():
    import optax

    return optax.sgd(0.1)


def test_round_rejects_wrong_shapes():
    alg = _alg(cj.federated.fedavg)
    state = alg.init(P0)
    with pytest.raises(ValueError, match="clients must be"):
        alg.round(state, jnp.arange(4), (jnp.zeros((5, 2, 4, 3)), jnp.zeros((5, 2, 4, 2))))
    with pytest.raises(ValueError, match="local_steps"):
        alg.round(state, jnp.arange(5), (jnp.zeros((5, 3, 4, 3)), jnp.zeros((5, 3, 4, 2))))
