"""What a decoupled learner puts on the wire: the compressor's encoded payload, exactly the bytes counted, decoded
by the syncer bit for bit as the learner's compressor decoded it; bad payloads refused before they are received
or decoded; compressors whose message cannot travel as arrays refused when the learner is built."""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax import collectives
from compjax.compressors.base import Exchanged, compressor
from compjax.decoupled import Contribution, Incoming, InProcessTransport, Learner, Syncer, wire
from tests.test_decoupled_syncer import snapshot

COMPRESSORS = {
    "identity": lambda: cj.identity(),
    "cast_bf16": lambda: cj.cast(jnp.bfloat16),
    "e3m0": lambda: cj.e3m0(),
    "topk": lambda: cj.topk(0.25),
    "chunktopk": lambda: cj.chunktopk(2, chunk=4),
    "chunktopk_bf16_values": lambda: cj.chunktopk(3, chunk=4, values="bfloat16"),  # bfloat16 travels as uint16
}


def init():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(8, 12)).astype(np.float32), "b": rng.normal(size=(13,)).astype(np.float32),
            "v": rng.normal(size=(4, 4)).astype(np.float32)}


def noisy_step(params, inner_state, seed):
    """A step that moves every entry differently (so top-k and the quantizers have something to choose)."""
    key = jax.random.key(seed)
    new = {k: x - 0.1 * jax.random.normal(jax.random.fold_in(key, i), x.shape) for i, (k, x) in
           enumerate(sorted(params.items()))}
    return new, inner_state, 0.0


class Recording(InProcessTransport):
    """Keeps every contribution handed to it (and queues it for a syncer, as usual)."""

    def __init__(self, learners):
        super().__init__(learners)
        self.sent: list[Contribution] = []

    def send(self, contribution):
        self.sent.append(contribution)
        super().send(contribution)


def delta_of(lrn, p):
    """Fragment ``p``'s outer gradient as the learner took it at its last send: anchor minus parameters."""
    leaves = jax.tree.leaves(lrn.params)
    return [a - jnp.asarray(leaves[i]).astype(a.dtype) for a, i in zip(lrn._anchor[p], lrn._index[p])]


def serve_now(lrn, syncer, transport):
    """Wait for the learner's sender thread, then let the syncer answer everything it was sent."""
    lrn._sender.submit(lambda: None).result()
    while (incoming := transport.receive()) is not None:
        for reply in syncer.handle(incoming):
            transport.reply(reply)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_the_learner_sends_the_payload_counted_and_the_syncer_decodes_it_bit_for_bit(name):
    """Two fragments, two sends each (the second with the error-feedback memory of the first): the arrays handed to
    the transport are the compressor's payload, their bytes the counted message bytes exactly (without a worker
    axis the non-finite vote counts 0 bytes: nothing to subtract), and the syncer's decoding of them equals the
    decoded value of the learner's compressor bit for bit."""
    tx = COMPRESSORS[name]()
    transport = Recording(["a"])
    lrn = Learner("a", noisy_step, init(), (), transport, sync_every=2, fragments=2, compressor=tx)
    syncer = Syncer(init(), learners=["a"], fragments=2, compressor=tx)
    encode = wire.encoder(tx)
    sizes = [sum(x.size for x in syncer.fragment_values(p)) for p in range(2)]
    for step in range(1, 5):
        due = lrn.due(step)
        before = {p: lrn.compressor_state(p) for p in due}
        n_sent = len(transport.sent)
        lrn.step(step)
        lrn._sender.submit(lambda: None).result()  # the sender thread handed this step's contributions over
        assert len(transport.sent) == n_sent + len(due)
        for p, c in zip(due, transport.sent[n_sent:]):
            assert c.header.fragment == p
            decoded, _, payload, skipped = encode(delta_of(lrn, p), before[p])
            assert not bool(skipped)
            assert len(c.values) == len(payload) and all(np.array_equal(a, b) for a, b in zip(c.values, payload))
            sent = sum(v.nbytes for v in c.values)
            assert sent == c.header.payload_bytes == int(cj.message_bytes(lrn.compressor_state(p)))
            assert [(v.shape, v.dtype) for v in c.values] == [(s.shape, s.dtype) for s in syncer.payload_spec(p)]
            if name == "identity":
                assert sent == 4 * sizes[p]
            else:  # compressed: fewer bytes than float32
                assert sent < 4 * sizes[p] and all(v.dtype != np.float32 or v.size < sizes[p] for v in c.values)
            got = syncer.decode(p, c.values)
            for a, b in zip(got, decoded):
                assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
        serve_now(lrn, syncer, transport)  # quorum of one: merged, the replies mixed in at the next step
    lrn.finish()
    assert syncer.versions() == [2, 2] and not syncer.refused
    assert lrn.stats.sends == [2, 2]
    assert lrn.stats.bytes_sent == [sum(sum(v.nbytes for v in c.values) for c in transport.sent
                                        if c.header.fragment == p) for p in range(2)]


@pytest.mark.parametrize("name", ["e3m0", "chunktopk"])
def test_the_merge_is_of_the_decoded_payload(name):
    """One learner, quorum 1, outer sgd(1): the new global fragment is the anchor minus the syncer's decoding."""
    tx = COMPRESSORS[name]()
    transport = Recording(["a"])
    lrn = Learner("a", noisy_step, init(), (), transport, sync_every=2, compressor=tx)
    syncer = Syncer(init(), learners=["a"], compressor=tx, outer=optax.sgd(1.0))
    lrn.step(1)
    lrn.step(2)
    (reply,) = syncer.handle(transport.receive(timeout=30))
    assert reply.accepted
    for g, a, d in zip(reply.values, jax.tree.leaves(init()), syncer.decode(0, transport.sent[0].values)):
        np.testing.assert_allclose(g, a - np.asarray(d), rtol=1e-6, atol=1e-6)
    lrn._sender.shutdown(wait=True)


def good_contribution(tx):
    transport = Recording(["x"])
    lrn = Learner("x", noisy_step, init(), (), transport, sync_every=1, compressor=tx)
    lrn.step(1)
    lrn._sender.shutdown(wait=True)
    return transport.sent[0]


def with_header(c, **changes):
    return Contribution(c.header.__class__(**{**c.header.__dict__, **changes}), c.values)


def bad_payloads():
    """name -> (bad contribution from a good one, a word of the reason, refused from the header alone)."""
    def arrays(c, change):
        values = [np.array(v, copy=True) for v in c.values]
        change(values)
        return Contribution(c.header, tuple(values))

    def nan_scale(v):
        v[1][0] = np.nan

    return {
        "declared dtype": (lambda c: with_header(c, dtypes=("<i4",) + c.header.dtypes[1:]), "wrong shape or dtype",
                           True),
        "declared shape": (lambda c: with_header(c, shapes=((1, *c.header.shapes[0]),) + c.header.shapes[1:]),
                           "wrong shape", True),
        "declared smaller": (lambda c: with_header(c, shapes=((c.header.shapes[0][0] - 1,),) + c.header.shapes[1:]),
                             "wrong shape", True),
        "declared too large": (lambda c: with_header(c, shapes=((1 << 40,),) + c.header.shapes[1:]),
                               "bytes declared", True),
        "an array left out": (lambda c: with_header(c, shapes=c.header.shapes[:1], dtypes=c.header.dtypes[:1]),
                              "wrong size", True),
        "an array too many": (lambda c: with_header(c, shapes=c.header.shapes * 2, dtypes=c.header.dtypes * 2),
                              "wrong size", True),
        "received dtype": (lambda c: arrays(c, lambda v: v.__setitem__(0, v[0].view(np.int32))),
                           "wrong shape or dtype", False),
        "received size": (lambda c: arrays(c, lambda v: v.__setitem__(0, v[0][:-1])), "wrong shape or dtype", False),
        "non-finite scale": (lambda c: arrays(c, nan_scale), "non-finite", False),
    }


@pytest.mark.parametrize("case", sorted(bad_payloads()))
def test_a_bad_payload_is_refused_and_the_model_is_unchanged(case, caplog):
    """e3m0's payload (packed uint32 codes, float32 scales): shapes, dtypes and sizes are checked against the
    compressor's message before the arrays are received, then again once received; a payload that decodes to a
    non-finite value is refused after its decoding."""
    tx = cj.e3m0()
    good = good_contribution(tx)
    assert [np.dtype(d) for d in good.header.dtypes] == [np.uint32, np.float32]
    s = Syncer(init(), learners=["x", "y"], compressor=tx, outer=optax.sgd(1.0))
    assert s.submit(with_header(good, learner="y")) == []  # an open round, waiting for x
    old = snapshot(s)
    build, reason, header_refused = bad_payloads()[case]
    bad = build(good)
    pulls = []
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        (reply,) = s.handle(Incoming(bad.header, lambda: pulls.append(1) or bad.values))
    assert not reply.accepted and reason in reply.reason and reason in s.refused[-1][2]
    assert any(reason in r.getMessage() for r in caplog.records)
    assert pulls == ([] if header_refused else [1])
    assert snapshot(s) == old and s.versions() == [0]
    replies = s.submit(good)  # the good payload completes the round: the refusal left it as it was
    assert [r.learner for r in replies] == ["y", "x"] and s.versions() == [1]


def test_decode_refuses_a_payload_of_the_wrong_spec():
    tx = cj.e3m0()
    s = Syncer(init(), learners=["x"], compressor=tx)
    good = good_contribution(tx)
    with pytest.raises(ValueError, match="wrong"):
        s.decode(0, good.values[:1])


def test_a_learner_whose_step_was_skipped_sends_the_message_of_zeros():
    """e3m0's non-finite guard skips a non-finite outer gradient (output zeros, residual kept): the learner then
    sends the compressor's message of zeros, which the syncer decodes to zeros, not the residual's message."""
    def nan_step(params, inner_state, _):
        return jax.tree.map(lambda x: x * np.nan, params), inner_state, 0.0

    tx = cj.e3m0()
    transport = Recording(["a"])
    syncer = Syncer(init(), learners=["a"], compressor=tx)
    lrn = Learner("a", noisy_step, init(), (), transport, sync_every=1, compressor=tx)
    lrn.step(1)  # a first send: the error-feedback memory holds something
    serve_now(lrn, syncer, transport)
    lrn._step_fn = nan_step
    lrn.step(2)
    lrn._sender.shutdown(wait=True)
    assert int(lrn.compressor_state(0).skipped) == 1
    assert np.count_nonzero(np.asarray(jax.tree.leaves(lrn.compressor_state(0).residual)[0])) > 0
    c = transport.sent[1]
    assert sum(v.nbytes for v in c.values) == c.header.payload_bytes
    decoded = Syncer(init(), learners=["a"], compressor=tx).decode(0, c.values)
    assert all(not np.any(np.asarray(d)) for d in decoded)


# --- compressors whose message cannot travel as arrays -------------------------------------------------------


class _State(NamedTuple):
    count: jnp.ndarray
    skipped: jnp.ndarray
    payload_bytes: jnp.ndarray


def uncaptured_bytes():
    """Dense float32, plus 4 bytes counted that no captured collective carries (a collective not intercepted)."""
    def exchange(ps, fields, ctx):
        means, nbytes = collectives.dense_mean_arrays(ps, ctx.axis_name)
        return Exchanged(means, list(ps), {}, nbytes + 4)

    return compressor(_State, exchange, axis_name=None, skip_nonfinite=False)


def decoded_with_local_state():
    """identity, then a scale by the step count: the decoding needs the learner's count, which does not travel."""
    return optax.chain(cj.identity(skip_nonfinite=False), optax.scale_by_schedule(lambda n: n + 1.0))


def decoded_slightly_off():
    """identity, then a scale of 1 + 1e-3 per step: the syncer's decoding (a fresh count) is off by 1e-3 relative
    from the second update on, about 3e-5 on these outer gradients: far above float rounding, far below 1e-2."""
    return optax.chain(cj.identity(skip_nonfinite=False), optax.scale_by_schedule(lambda n: 1.0 + 1e-3 * n))


@pytest.mark.parametrize("make, words", [
    (uncaptured_bytes, ["_State", "bytes"]),
    (decoded_with_local_state, ["chain(IdentityState, ScaleByScheduleState)", "decoding"]),
    (decoded_slightly_off, ["chain(IdentityState, ScaleByScheduleState)", "decoding"]),
], ids=["bytes", "decoding", "decoding off by 1e-3"])
def test_a_compressor_whose_message_cannot_travel_is_refused_by_the_learner(make, words):
    with pytest.raises(ValueError, match="compressor") as e:
        Learner("a", noisy_step, init(), (), InProcessTransport(["a"]), sync_every=1, compressor=make())
    assert all(w in str(e.value) for w in words), str(e.value)


# --- the capture and replay of compjax.collectives ------------------------------------------------------------


def test_replay_checks_what_it_is_given():
    tx = cj.topk(0.5, skip_nonfinite=False)
    g = [jnp.arange(4.0)]
    with collectives.capture() as cap:
        tx.update(g, tx.init(g))
    idx, val = cap.arrays
    z = [jnp.zeros(4)]
    with collectives.replay([idx, val]):
        (out,), _ = tx.update(z, tx.init(z))
    assert out.tolist() == [0.0, 0.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="expects"), collectives.replay([idx.astype(jnp.float32), val]):
        tx.update(z, tx.init(z))
    with pytest.raises(ValueError, match="used"), collectives.replay([idx, val, val]):
        tx.update(z, tx.init(z))
    with pytest.raises(ValueError, match="more"), collectives.replay([idx]):
        tx.update(z, tx.init(z))
    with pytest.raises(ValueError, match="one at a time"), collectives.capture(), collectives.replay([]):
        pass
    with collectives.capture() as cap:  # a worker axis is not captured
        jax.vmap(lambda x: collectives.dense_mean(x, "w"), axis_name="w")(jnp.ones((2, 3)))
    assert cap.arrays == []
