"""The sent-message contract of ``compjax.compressors.base.update_with_sent``, which the federated uplink relies on:
the decoded message is that of ``p = g + e`` (the error-feedback sum) for a compressor with error feedback, it is
zeros on a step the non-finite guard skips (whichever branch the exchange takes: dense ``sent`` or ``SentAt``), and
``check_uplink`` refuses at build time a compressor that cannot report it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import collectives
from compjax.algorithms.federated import uplink
from compjax.codecs.sparse import layer_k
from compjax.compressors.base import Exchanged, compressor, update_with_sent
from compjax.compressors.identity import IdentityState

W = "w"  # the worker axis of jax.vmap
N = 3
SHAPES = {"a": (4, 5), "b": (7,)}


def _grads(rng, bad=None):
    g = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    if bad is not None:
        g["a"][bad, 1, 2] = np.nan
    return g


def _with_sent(tx):
    """``update_with_sent`` on N workers under ``jax.vmap(axis_name=W)``: ``(grads, state) -> (means, state, sent)``."""
    return jax.jit(jax.vmap(lambda g, s: update_with_sent(tx, g, s), axis_name=W))


def _init(tx):
    return jax.vmap(tx.init)({k: jnp.zeros((N, *s)) for k, s in SHAPES.items()})


def np_topk_ef(steps, ratio):
    """Per step and worker: ``p = g + e``; sent = ``p`` at its ``k`` largest ``|p|`` (ties to the lowest index, as
    ``lax.top_k``), zeros elsewhere; ``e = p - sent``.  Returns the per-step sent ``{leaf: (N, *shape)}``."""
    e = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
    out = []
    for g in steps:
        sent = {}
        for k in SHAPES:
            p = g[k] + e[k]
            flat = p.reshape(N, -1)
            kk = layer_k(flat.shape[1], ratio)
            s = np.zeros_like(flat)
            for w in range(N):
                idx = np.argsort(-np.abs(flat[w]), kind="stable")[:kk]
                s[w, idx] = flat[w, idx]
            sent[k] = s.reshape(p.shape)
            e[k] = p - sent[k]
        out.append(sent)
    return out


def test_topk_with_error_feedback_sends_the_decoded_g_plus_e_over_steps():
    """Three steps of top-k with error feedback: from the second step on the residual is not zero, so the decoded
    message of ``g + e`` differs from that of ``g``; each step's ``sent`` is the NumPy reference's, the mean over
    workers of ``sent`` is the returned mean, and the residual is ``p - sent``."""
    ratio = 0.25
    tx = cj.topk(ratio, axis_name=W)
    rng = np.random.default_rng(0)
    steps = [_grads(rng) for _ in range(3)]
    want = np_topk_ef(steps, ratio)
    f, state = _with_sent(tx), _init(tx)
    e = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
    for t, g in enumerate(steps):
        means, state, sent = f(g, state)
        for k in SHAPES:
            np.testing.assert_allclose(np.asarray(sent[k]), want[t][k], rtol=1e-6, atol=1e-6, err_msg=(t, k))
            np.testing.assert_allclose(np.asarray(means[k]), np.broadcast_to(want[t][k].mean(0), want[t][k].shape),
                                       rtol=1e-5, atol=1e-6, err_msg=(t, k))
            p = g[k] + e[k]
            e[k] = p - want[t][k]
            np.testing.assert_allclose(np.asarray(state.residual[k]), e[k], rtol=1e-6, atol=1e-6, err_msg=(t, k))
    assert any(np.abs(e[k]).max() > 0 for k in SHAPES)


def test_randomk_with_error_feedback_sends_g_plus_e_at_the_drawn_entries():
    """Random-k with error feedback (its draws are its own): at every step, on every worker, ``sent`` is ``g + e``
    at the drawn entries (layer_k of each layer) and zero elsewhere, and the new residual is ``g + e - sent``."""
    ratio = 0.3
    tx = cj.randomk(ratio, key=4, axis_name=W)
    rng = np.random.default_rng(1)
    f, state = _with_sent(tx), _init(tx)
    e = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
    carried = 0
    for t in range(3):
        g = _grads(rng)
        _, state, sent = f(g, state)
        for k, shape in SHAPES.items():
            p, got = g[k] + e[k], np.asarray(sent[k])
            for w in range(N):
                drawn = got[w] != 0
                assert drawn.sum() == layer_k(int(np.prod(shape)), ratio), (t, k, w)
                np.testing.assert_allclose(got[w][drawn], p[w][drawn], rtol=1e-6, err_msg=(t, k, w))
                carried += int(np.count_nonzero(e[k][w][drawn]))  # entries where g + e differs from g
            e[k] = p - got
            np.testing.assert_allclose(np.asarray(state.residual[k]), e[k], rtol=1e-6, atol=1e-6)
    assert carried > 0  # the residual did take part


@pytest.mark.parametrize("name", ["randomk", "topk", "randomk_ef", "topk_ef", "identity", "cast_bf16", "qsgd",
                                  "signsgd"])
def test_a_skipped_step_sends_zeros(name):
    """One worker's NaN votes the step away: every worker's decoded message and the mean are zeros, the state counts
    the skip.  Random-k without error feedback takes the dense-``sent`` branch of a compressor that honours the
    skip itself (its exchange sees the non-finite gradients as they are)."""
    tx = {"randomk": lambda: cj.randomk(0.3, key=1, error_feedback=False, axis_name=W),
          "topk": lambda: cj.topk(0.3, error_feedback=False, axis_name=W),
          "randomk_ef": lambda: cj.randomk(0.3, key=1, axis_name=W),
          "topk_ef": lambda: cj.topk(0.3, axis_name=W),
          "identity": lambda: cj.identity(W),
          "cast_bf16": lambda: cj.cast(jnp.bfloat16, axis_name=W),
          "qsgd": lambda: cj.qsgd(4, key=2, axis_name=W),
          "signsgd": lambda: cj.signsgd(error_feedback=False, axis_name=W)}[name]()
    f, state = _with_sent(tx), _init(tx)
    rng = np.random.default_rng(2)
    _, state, _ = f(_grads(rng), state)  # a normal step first: residuals, counts and keys move
    means, after, sent = f(_grads(rng, bad=1), state)
    for k in SHAPES:
        assert not np.asarray(sent[k]).any(), (k, np.asarray(sent[k]))
        assert not np.asarray(means[k]).any(), k
    assert list(np.asarray(after.skipped)) == [1] * N and list(np.asarray(after.count)) == [1] * N
    if getattr(state, "residual", None) is not None:
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(after.residual[k]), np.asarray(state.residual[k]))


# --- check_uplink: a compressor that cannot report its decoded message is refused when built ----------------

AX = "clients"


def _wrapped_topk():
    """Top-k behind a user's own update function (e.g. for logging): the same state type (a biased compressor's), but
    no longer a compjax compressor that ``update_with_sent`` can ask for the decoded message."""
    top = cj.topk(0.25, error_feedback=False, axis_name=AX)
    return optax.GradientTransformationExtraArgs(top.init, lambda u, s, params=None, **kw: top.update(u, s, params))


def _silent_identity():
    """A dense mean built on compjax's compressor pipeline with the identity's state type, whose exchange does not
    say what it sent."""

    def exchange(ps, fields, ctx):
        outs = [collectives.dense_mean(p, ctx.axis_name) for p in ps]
        return Exchanged([m for m, _ in outs], None, {}, sum(b for _, b in outs))

    return compressor(IdentityState, exchange, axis_name=AX)


@pytest.mark.parametrize("make, match", [(_wrapped_topk, "must be a compjax compressor"),
                                         (_silent_identity, "does not report what it sent")],
                         ids=["wrapped_topk", "silent_identity"])
def test_check_uplink_refuses_a_compressor_that_cannot_report_what_it_sent(make, match):
    comp = make()
    g = {"w": jnp.ones((2, 3))}
    out, _ = jax.vmap(comp.update, axis_name=AX)(g, jax.vmap(comp.init)(g))  # it does work as a plain uplink ...
    np.testing.assert_allclose(np.asarray(out["w"]).sum(), 6.0 if make is _silent_identity else 2.0, rtol=1e-6)
    # ... which FedAvg takes, but not an algorithm that needs each client's decoded message.
    info = uplink.check_uplink(comp, AX, algorithm="fedavg", accepts=frozenset({"exact", "unbiased", "biased"}))
    assert info.kind in ("exact", "biased")
    accepts = frozenset({info.kind})
    with pytest.raises(ValueError, match=f"scafcom: .*{match}"):
        uplink.check_uplink(comp, AX, algorithm="scafcom", accepts=accepts, sent=True)
    if info.kind == "biased":  # the public builder refuses it too, before any round runs
        with pytest.raises(ValueError, match=match):
            cj.federated.scafcom(lambda p, b: jnp.mean((b @ p["w"]) ** 2), num_clients=4, participation=0.5,
                                 local_steps=1, local_lr=0.1, compressor=comp, client_axis=AX)
