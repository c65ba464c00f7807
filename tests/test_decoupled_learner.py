"""The decoupled learner: Streaming DiLoCo's schedule, sends from a background thread while inner steps go on,
the α merge of a late reply with its delay recorded, and a run that completes without a silent learner."""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np
import optax
import pytest

import compjax as cj
from compjax.decoupled import InProcessTransport, Learner, Reply, Syncer
from compjax.decoupled.messages import RESTARTED

LR = 0.1


def init():
    rng = np.random.default_rng(0)
    return {"blocks": [{"w": rng.normal(size=(3, 2)).astype(np.float32)} for _ in range(3)],
            "out": rng.normal(size=(4,)).astype(np.float32)}


def sgd_step(params, inner_state, target):
    """One SGD step on 0.5 |θ - target|^2 (target: a float)."""
    return jax.tree.map(lambda x: x - LR * (x - target), params), inner_state, 0.0


def learner(name, transport, **kwargs):
    kwargs = {"sync_every": 2, "reply_timeout_s": 30.0, **kwargs}
    return Learner(name, sgd_step, init(), (), transport, **kwargs)


def test_schedule_is_streaming_diloco():
    """Fragment p is due after step s when s ≡ (p H) // P (mod H), s >= 1: cj.diloco's offsets."""
    lrn = learner("a", InProcessTransport(["a"]), sync_every=6, fragments=4)
    assert [lrn.due(s) for s in range(8)] == [[], [1], [], [2], [3], [], [0], [1]]


class HeldTransport(InProcessTransport):
    """Its send blocks until ``release`` is set (a slow network)."""

    def __init__(self, learners):
        super().__init__(learners)
        self.release, self.entered = threading.Event(), threading.Event()

    def send(self, contribution):
        self.entered.set()
        assert self.release.wait(timeout=30)
        super().send(contribution)


def test_inner_steps_go_on_while_a_send_is_held_then_a_late_reply_is_mixed_with_alpha():
    alpha = 0.25
    transport = HeldTransport(["a"])
    syncer = Syncer(init(), learners=["a"], outer=optax.sgd(1.0))
    lrn = learner("a", transport, alpha=alpha)
    lrn.step(1.0)
    lrn.step(1.0)  # fragment 0 is due: handed to the sender thread, whose send is held
    assert transport.entered.wait(timeout=30)
    lrn.step(1.0)  # the learner trains on while the bytes are on their way
    assert lrn.count == 3 and transport.receive() is None and lrn.stats.sends == [1]
    transport.release.set()
    incoming = transport.receive(timeout=30)
    assert incoming.header.step == 2 and incoming.header.tokens == 2.0
    for reply in syncer.handle(incoming):
        transport.reply(reply)
    theta3 = jax.tree.leaves(lrn.params)
    merged = syncer.fragment_values(0)
    lrn.step(1.0)  # the reply is mixed in before step 4: θ ← α θ + (1 - α) θ̃, then the SGD step
    for got, x, g in zip(jax.tree.leaves(lrn.params), theta3, merged):
        mixed = alpha * x + (1 - alpha) * g
        np.testing.assert_allclose(got, mixed - LR * (mixed - 1.0), rtol=1e-6, atol=1e-6)
    assert lrn.stats.delays == [[1]]  # sent after step 2, used after step 3
    for reply in syncer.handle(transport.receive(timeout=30)):  # step 4's send
        transport.reply(reply)
    lrn.finish()
    assert lrn.stats.sends == [2] and lrn.stats.delays == [[1, 0]] and syncer.versions() == [2]
    assert lrn.stats.bytes_sent == [2 * 4 * (3 * 6 + 4)]  # identity: float32 outer gradients


def test_with_late_reply_defer_a_fragment_due_again_before_its_reply_is_sent_after_it_without_blocking():
    transport = HeldTransport(["a"])
    syncer = Syncer(init(), learners=["a"], outer=optax.sgd(1.0))
    lrn = learner("a", transport, late_reply="defer")
    lrn.step(1.0)
    lrn.step(1.0)  # fragment 0 sent after step 2; its send is held
    assert transport.entered.wait(timeout=30)
    lrn.step(1.0)
    lrn.step(1.0)  # due again after step 4, no reply yet: deferred, the learner does not wait
    assert lrn.count == 4 and lrn.stats.sends == [1] and lrn.stats.wait_seconds == 0.0
    transport.release.set()
    for reply in syncer.handle(transport.receive(timeout=30)):
        transport.reply(reply)
    lrn.step(1.0)  # the reply is mixed in, then the deferred fragment goes: its tokens cover steps 3 and 4
    assert lrn.stats.sends == [2] and lrn.stats.delays == [[2]]
    incoming = transport.receive(timeout=30)
    assert incoming.header.step == 4 and incoming.header.tokens == 2.0 and incoming.header.base_version == 1
    for reply in syncer.handle(incoming):
        transport.reply(reply)
    lrn.step(1.0)  # step 6: due, its reply came: sent at once
    for reply in syncer.handle(transport.receive(timeout=30)):
        transport.reply(reply)
    lrn.finish()
    assert lrn.stats.sends == [3] and syncer.versions() == [3]


def test_a_silent_learner_holds_the_others_only_for_the_grace_window():
    """min_quorum = all three, "c" never sends: every round of a and b merges at the end of its window."""
    names = ["a", "b", "c"]
    transport = InProcessTransport(names)
    syncer = Syncer(init(), learners=names, fragments=2, grace_s=0.5)
    learners = [learner(n, transport, fragments=2, wait_for_merge=True) for n in ("a", "b")]
    errors = []

    def work(lrn):
        try:
            for _ in range(4):
                lrn.step(1.0)
            lrn.finish()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    stop = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(transport, stop))
    threads = [threading.Thread(target=work, args=(lrn,)) for lrn in learners]
    server.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    stop.set()
    server.join(timeout=10)
    assert not errors and not any(t.is_alive() for t in threads)
    # Every merge came from a grace window (the quorum of three never formed); both learners' last sends merged.
    assert syncer.merges and all("c" not in m[2] for m in syncer.merges)
    assert min(syncer.versions()) >= 2 and syncer.last_merged()["c"] == [-1, -1]
    assert all(v >= 1 for k in "ab" for v in syncer.last_merged()[k])
    assert all(lrn.stats.sends == [2, 2] for lrn in learners)


def test_error_feedback_stays_on_the_learner():
    """top-k of half the outer gradient: what was not sent is in the learner's compressor state, per fragment."""
    transport, tx = InProcessTransport(["a"]), cj.topk(0.5, skip_nonfinite=False)
    lrn = learner("a", transport, compressor=tx)
    lrn.step(1.0)
    lrn.step(1.0)
    sent = Syncer(init(), learners=["a"], compressor=tx).decode(0, transport.receive(timeout=30).pull())
    anchor = jax.tree.leaves(init())
    delta = [a - x for a, x in zip(anchor, jax.tree.leaves(lrn.params))]
    residual = lrn.compressor_state(0).residual
    for d, s, r in zip(delta, sent, residual):
        np.testing.assert_allclose(np.asarray(s) + np.asarray(r), d, rtol=1e-6, atol=1e-6)
        assert np.count_nonzero(np.asarray(r)) > 0


@pytest.mark.parametrize("kwargs, word", [
    ({"sync_every": 0}, "sync_every"), ({"fragments": 0}, "fragments"), ({"alpha": 1.5}, "alpha"),
    ({"reply_timeout_s": 0.0}, "reply_timeout_s"), ({"compressor": "topk"}, "compressor"), ({"late_reply": "skip"}, "late_reply"),
])
def test_bad_arguments_raise_naming_the_parameter(kwargs, word):
    with pytest.raises(ValueError, match=word):
        learner("a", InProcessTransport(["a"]), **kwargs)


class BrokenTransport(InProcessTransport):
    """Its send fails (a network error on the sender thread)."""

    def send(self, contribution):
        raise ConnectionError("the link is down")


def test_a_failed_send_raises_at_the_next_send_not_as_a_missing_reply():
    lrn = learner("a", BrokenTransport(["a"]), fragments=3, sync_every=3)
    lrn.step(1.0)  # fragment 1 is due after step 1: its send fails on the sender thread
    with pytest.raises(ConnectionError, match="the link is down"):
        for _ in range(6):  # the next send (or the wait for a reply) raises the sender thread's error
            lrn.step(1.0)


def test_with_late_reply_drop_a_learner_trains_on_while_the_syncer_is_down_and_gives_up_late_sends(caplog):
    """No syncer serves: with late_reply="drop" no step blocks; a send unanswered for reply_timeout_s is given up
    (logged, counted) and its fragment sent anew, at most one send in flight per fragment; finish gives up the
    last one instead of raising; once the syncer serves, the queued contributions are merged or refused."""
    from tests.test_decoupled_membership import init, sgd_step

    transport = InProcessTransport(["a"])
    lrn = Learner("a", sgd_step, init(), (), transport, sync_every=1, late_reply="drop", reply_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        for k in range(4):
            lrn.step(1.0)
            if k == 1:
                time.sleep(0.25)  # the send of step 1 is now late
        assert lrn.stats.wait_seconds == 0.0  # no step waited for the syncer
        lrn.finish()  # waits reply_timeout_s for the last send, then gives it up
    assert lrn.stats.sends == [2] and lrn.stats.abandoned == [2]  # steps 1 and 3 sent; both given up
    assert caplog.text.count("the send is given up") == 2
    s = Syncer(init(), learners=["a"], min_quorum=1)
    while (incoming := transport.receive(timeout=0.0)) is not None:
        s.handle(incoming)
    assert s.versions() == [1] and [r[2][:5] for r in s.refused] == ["stale"]  # the second, from version 0
    with pytest.raises(ValueError, match="reply_timeout_s"):
        Learner("a", sgd_step, init(), (), transport, sync_every=1, late_reply="drop")


def test_a_send_lost_with_a_syncer_restart_is_sent_again_and_the_inner_steps_are_kept():
    """A restarted syncer's refusal at the learner's anchor version (its checkpoint had every merge the learner
    saw): no mix, the inner steps since the anchor stay, and the send lost with the restart goes again at the next
    step with its tokens (the same outer gradient: nothing moved).  At another version the learner mixes in the
    restored values as for a stale refusal and sends nothing extra."""
    transport = InProcessTransport(["a"])
    lrn = Learner("a", sgd_step, init(), (), transport, sync_every=2, alpha=0.5, max_tokens=100.0)
    lrn.step(1.0, tokens=8.0)
    lrn.step(1.0, tokens=8.0)  # fragment 0 sent: 16 tokens from version 0
    first = transport.receive(timeout=30)
    sent = [np.asarray(v) for v in first.pull()]
    params = [np.asarray(x).copy() for x in jax.tree.leaves(lrn.params)]
    lrn._use(Reply("a", 0, 0, lrn.anchor(0), accepted=False, reason=f"{RESTARTED}: resuming at versions [0]"))
    for a, b in zip(jax.tree.leaves(lrn.params), params):
        np.testing.assert_array_equal(np.asarray(a), b)  # not mixed with the anchor
    assert lrn.stats.resent == [1]
    lrn.step(1.0, tokens=8.0)  # the lost send goes first, then the step
    again = transport.receive(timeout=30)
    assert again is not None and again.header.tokens == 16.0 and again.header.base_version == 0
    assert again.header.seq == first.header.seq + 1
    for a, b in zip(again.pull(), sent):
        np.testing.assert_array_equal(np.asarray(a), b)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(lrn.params)]
    ahead = tuple(np.asarray(v) + np.float32(1.0) for v in lrn.anchor(0))
    lrn._use(Reply("a", 0, 3, ahead, accepted=False, reason=f"{RESTARTED}: resuming at versions [3]"))
    assert lrn.versions() == [3] and lrn.stats.resent == [1]
    for a, b in zip(jax.tree.leaves(lrn.params), before):
        assert not np.array_equal(np.asarray(a), b)  # mixed in: 0.5 x + 0.5 (the restored values)
    lrn._sender.shutdown(wait=True)


def test_a_learner_whose_outer_gradient_is_not_finite_says_so(caplog):
    """Parameters gone NaN: the compressor's guard sends the message of zeros (finite) in place of the outer gradient,
    and the learner warns (it used to send it without a word)."""
    transport = InProcessTransport(["a"])
    nan_step = lambda params, inner_state, target: (jax.tree.map(lambda x: x * np.nan, params), inner_state, 0.0)
    lrn = Learner("a", nan_step, init(), (), transport, sync_every=1, compressor=cj.e3m0())  # skips non-finite
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        lrn.step(1.0)
        incoming = transport.receive(timeout=30)
        lrn._sender.shutdown(wait=True)
    values = incoming.pull()
    assert all(np.all(np.isfinite(np.asarray(v, np.float64))) for v in values if np.asarray(v).dtype.kind == "f")
    assert "outer gradient of fragment 0 is not finite" in caplog.text
