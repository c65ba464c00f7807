"""Decoupled DiLoCo's membership, in one process: learners that draw their own random numbers, a late join
from the syncer's current state, a checkpoint with a grown learner list, and lost learners."""

from __future__ import annotations

import logging
import sys
import time

import jax
import numpy as np
import optax
import pytest

import compjax as cj
from compjax.decoupled import InProcessTransport, Learner, Start, Syncer
from tests.test_decoupled_syncer import init, message, snapshot


def sgd_step(params, inner_state, target):
    return jax.tree.map(lambda x: x - 0.1 * (x - target), params), inner_state, 0.0


def sent_after_two_steps(compressor, **kwargs):
    """The decoded message a fresh learner sends after two inner steps (sync_every=2)."""
    transport = InProcessTransport(["a"])
    lrn = Learner("a", sgd_step, init(), (), transport, sync_every=2, compressor=compressor, **kwargs)
    lrn.step(1.0)
    lrn.step(1.0)
    values = transport.receive(timeout=30).pull()
    lrn._sender.shutdown(wait=True)
    return [np.asarray(v) for v in values]


@pytest.mark.parametrize("make", [
    lambda: cj.randomk(0.5, key=3, skip_nonfinite=False),
    lambda: cj.qsgd(4, key=3, skip_nonfinite=False),
    lambda: cj.terngrad(key=3, skip_nonfinite=False),
], ids=["randomk", "qsgd", "terngrad"])
def test_learners_fold_their_index_into_the_compressor_keys(make):
    tx = make()
    a0, a0_again, a1 = (sent_after_two_steps(tx, worker_index=i) for i in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(a0, a0_again))  # reproducible
    assert not all(np.array_equal(x, y) for x, y in zip(a0, a1))  # but another learner draws otherwise
    by_name = [sent_after_two_steps(tx, worker_index=None) for _ in range(2)]  # the default: from the name
    assert all(np.array_equal(x, y) for x, y in zip(*by_name))


def test_bad_worker_index_and_start_raise():
    transport = InProcessTransport(["a"])
    with pytest.raises(ValueError, match="worker_index"):
        Learner("a", sgd_step, init(), (), transport, sync_every=2, worker_index=-1)
    with pytest.raises(ValueError, match="start"):
        Learner("a", sgd_step, init(), (), transport, sync_every=2, start=Start(((),), (0,)))
    good = Syncer(init(), learners=["a"]).start()
    with pytest.raises(ValueError, match="seqs"):
        Learner("a", sgd_step, init(), (), transport, sync_every=2, start=Start(good.values, good.versions, (-1,)))


def test_a_restarted_learner_numbers_its_contributions_after_the_last_the_syncer_took():
    """Learner a sent two contributions, then restarts from a fresh process (its counters at zero): it rejoins with
    register's start and its next contribution is numbered 3, not 1 (which would read as a replay)."""
    s = Syncer(init(), learners=["a"], outer=optax.sgd(1.0), min_quorum=1)
    for seq in (1, 2):
        s.submit(message(s, "a", 0, seq - 1, 1.0, seed=seq, seq=seq))
    transport = InProcessTransport(["a"])
    lrn = Learner("a", sgd_step, init(), (), transport, sync_every=1, start=s.register("a"))
    lrn.step(1.0)
    incoming = transport.receive(timeout=30)
    lrn._sender.shutdown(wait=True)
    assert incoming.header.seq == 3 and [r.accepted for r in s.handle(incoming)] == [True]


def test_a_late_joiner_starts_from_the_current_state_and_its_first_contribution_is_merged():
    s = Syncer(init(), learners=["a"], fragments=2, outer=optax.sgd(1.0), min_quorum=1)
    for v in range(2):
        for p in range(2):
            assert s.submit(message(s, "a", p, v, 1.0, seed=10 * v + p))[0].accepted
    start = s.register("b")
    assert s.learners == ("a", "b") and start.versions == (2, 2)
    for p in range(2):
        for x, y in zip(start.values[p], s.fragment_values(p)):
            np.testing.assert_array_equal(x, y)
    transport = InProcessTransport(["b"])
    lrn = Learner("b", sgd_step, init(), (), transport, sync_every=2, fragments=2, start=start)
    assert lrn.versions() == [2, 2]
    for x, y in zip(jax.tree.leaves(lrn.params), jax.tree.leaves(s.global_params())):
        np.testing.assert_array_equal(x, y)  # the parameters are the global model's, not init()'s
    lrn.step(1.0)  # fragment 1 is due after step 1 (offset 2 * 1 // 2)
    incoming = transport.receive(timeout=30)
    assert incoming.header.base_version == 2
    replies = s.handle(incoming)
    assert [(r.learner, r.accepted) for r in replies] == [("b", True)]
    assert s.merges[-1] == (1, 3, ("b",)) and s.last_merged()["b"] == [-1, 3]
    assert s.register("b").versions == (2, 3) and s.learners == ("a", "b")  # a known name: nothing added


def test_a_checkpoint_after_a_late_join_restores_into_a_syncer_built_with_the_first_learners(tmp_path):
    s = Syncer(init(), learners=["x", "y"], fragments=2, min_quorum=2)
    s.register("z")
    for v in range(2):
        s.submit(message(s, "x", 0, v, 1.0, seed=2 * v))
        s.submit(message(s, "z", 0, v, 3.0, seed=2 * v + 1))
    s.save(tmp_path / "ckpt", step=2)
    fresh = Syncer(init(), learners=["x", "y"], fragments=2, min_quorum=2)
    assert fresh.restore(tmp_path / "ckpt") == 2
    assert fresh.learners == ("x", "y", "z")
    assert fresh.last_merged() == s.last_merged() == {"x": [2, -1], "y": [-1, -1], "z": [2, -1]}
    assert snapshot(fresh) == snapshot(s)
    with pytest.raises(ValueError, match="learners"):
        Syncer(init(), learners=["x", "w"], fragments=2).restore(tmp_path / "ckpt")


def test_a_silent_learner_is_lost_named_and_the_others_stop_waiting_for_it(caplog):
    s = Syncer(init(), learners=["a", "b"], heartbeat_timeout_s=5.0)  # min_quorum: both
    s.heartbeat("a", now=0.0)
    s.heartbeat("b", now=0.0)
    assert s.submit(message(s, "a", 0, 0, 1.0, seed=1), now=1.0) == []  # waits for b
    s.heartbeat("a", now=4.0)
    assert s.tick(now=4.0) == [] and s.lost == []
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        replies = s.tick(now=6.0)  # b silent for 6 s > 5 s: lost, and a's round merges without it
    assert [(r.learner, r.version) for r in replies] == [("a", 1)]
    assert [name for name, _ in s.lost] == ["b"] and s.live() == ("a",)
    assert any("'b' lost" in r.getMessage() for r in caplog.records)
    # a alone merges at once now; a lost learner that speaks again is waited for again
    assert [r.learner for r in s.submit(message(s, "a", 0, 1, 1.0, seed=2), now=7.0)] == ["a"]
    s.heartbeat("b", now=8.0)
    assert s.live() == ("a", "b")
    assert s.submit(message(s, "a", 0, 2, 1.0, seed=3), now=9.0) == []


def test_without_a_heartbeat_timeout_no_learner_is_ever_lost():
    s = Syncer(init(), learners=["a", "b"])
    s.submit(message(s, "a", 0, 0, 1.0, seed=1), now=0.0)
    assert s.tick(now=1e9) == [] and s.lost == [] and s.versions() == [0]
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        Syncer(init(), learners=["a"], heartbeat_timeout_s=0.0)


def test_the_multiprocess_transport_names_its_extra_when_pyzmq_is_missing(monkeypatch):
    from compjax.decoupled import MultiProcessTransport

    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    with pytest.raises(ImportError, match=r"compjax\[decoupled\]"):
        MultiProcessTransport.for_syncer()


def test_the_multiprocess_transport_checks_its_arguments():
    pytest.importorskip("zmq")
    from compjax.decoupled import MultiProcessTransport

    with pytest.raises(ValueError, match="address"):
        MultiProcessTransport.for_syncer("tcp://127.0.0.1")  # no port
    with pytest.raises(ValueError, match="address"):
        MultiProcessTransport.for_learner("a", "tcp://*:5555")  # a learner connects to one host
    with pytest.raises(ValueError, match="name"):
        MultiProcessTransport.for_learner("", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="pull_timeout_s"):
        MultiProcessTransport.for_syncer(pull_timeout_s=0)
    t = MultiProcessTransport.for_syncer()
    try:
        assert t.address.startswith("tcp://127.0.0.1:") and not t.address.endswith(":0")
        with pytest.raises(RuntimeError, match="learner"):
            t.poll("a")
    finally:
        t.close()


def test_warm_up_changes_nothing_and_start_from_needs_no_send_in_flight():
    s = Syncer(init(), learners=["a"], outer=optax.sgd(1.0), min_quorum=1)
    s.submit(message(s, "a", 0, 0, 1.0, seed=1))
    transport = InProcessTransport(["b"])
    lrn = Learner("b", sgd_step, init(), (), transport, sync_every=1)
    before = [np.array(x) for x in jax.tree.leaves(lrn.params)]
    lrn.warm_up(1.0)
    assert lrn.count == 0 and transport.receive() is None
    assert all(np.array_equal(x, y) for x, y in zip(before, jax.tree.leaves(lrn.params)))
    lrn.start_from(s.register("b"))
    assert lrn.versions() == [1]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(lrn.params), jax.tree.leaves(s.global_params())))
    lrn.step(1.0)  # sent; its reply not taken yet
    with pytest.raises(ValueError, match="in flight"):
        lrn.start_from(s.start())
    lrn._sender.shutdown(wait=True)


def test_a_learner_clips_its_tokens_to_the_cap_it_declared():
    """sync_every 3 at 8 tokens a step is 24 tokens a contribution; declared 16, it reports 16 (never above)."""
    transport = InProcessTransport(["a"])
    lrn = Learner("a", sgd_step, init(), (), transport, sync_every=3, max_tokens=16.0)
    for _ in range(3):
        lrn.step(1.0, tokens=8.0)
    incoming = transport.receive(timeout=30)
    lrn._sender.shutdown(wait=True)
    assert incoming.header.tokens == 16.0
    with pytest.raises(ValueError, match="max_tokens"):
        Learner("a", sgd_step, init(), (), transport, sync_every=3, max_tokens=0.0)


def test_a_learner_that_leaves_shrinks_the_quorum_at_once_and_counts_again_when_it_registers():
    s = Syncer(init(), learners=["a", "b", "c"], outer=optax.sgd(1.0))  # quorum: all three
    s.submit(message(s, "a", 0, 0, 1.0, seed=1))
    s.submit(message(s, "b", 0, 0, 1.0, seed=2))
    replies = s.leave("c")  # a and b are every live learner: their round merges now, no time-out
    assert [r.learner for r in replies] == ["a", "b"] and s.versions() == [1] and s.live() == ("a", "b")
    assert s.leave("c") == [] and s.leave("nobody") == []
    s.register("c")
    s.submit(message(s, "a", 0, 1, 1.0, seed=3))
    assert s.submit(message(s, "b", 0, 1, 1.0, seed=4)) == [] and s.versions() == [1]  # waits for c again


def test_a_silence_during_warm_up_does_not_make_a_learner_lost(caplog):
    """A restarted syncer counts every learner as heard when it restores; its compiles (warm_up) may outlast the
    heartbeat time-out: after warm_up the learners count as heard again, none is lost."""
    s = Syncer(init(), learners=["a"], heartbeat_timeout_s=5.0)
    s.heartbeat("a", now=time.monotonic() - 60.0)  # heard a minute ago, then the syncer compiled
    s.warm_up()
    s.tick()
    assert s.lost == [] and s.live() == ("a",)
    s.tick(now=time.monotonic() + 6.0)  # silent for longer than the time-out once serving: lost
    assert [n for n, _ in s.lost] == ["a"]


def test_a_quorum_fraction_follows_the_live_membership():
    s = Syncer(init(), learners=["a", "b", "c", "d"], quorum_fraction=0.5)
    assert s._quorum() == 2
    for n in ("e", "f"):
        s.register(n)
    assert s._quorum() == 3  # ceil(0.5 x 6)
    s.leave("f")
    s.leave("e")
    s.leave("d")
    assert s._quorum() == 2  # ceil(0.5 x 3)
    s.submit(message(s, "a", 0, 0, 1.0, seed=1))
    assert s.versions() == [0] and [r.learner for r in s.submit(message(s, "b", 0, 0, 1.0, seed=2))] == ["a", "b"]
    for bad in ({"quorum_fraction": 0.0}, {"quorum_fraction": 1.5}, {"quorum_fraction": 0.5, "min_quorum": 2}):
        with pytest.raises(ValueError, match="quorum_fraction"):
            Syncer(init(), learners=["a", "b"], **bad)


def test_a_restored_syncer_keeps_who_was_lost_or_gone_and_the_declared_token_caps(tmp_path):
    """Lost (silent past the time-out) and gone (goodbye) learners stay out of the quorum after a restore until
    they are heard from again, and a learner's declared token cap still bounds its contributions."""
    s = Syncer(init(), learners=["a", "b", "c"], heartbeat_timeout_s=5.0, max_tokens=100.0)  # quorum: all live
    s.register("a", max_tokens=40.0, now=0.0)
    s.heartbeat("b", now=0.0)
    s.heartbeat("c", now=0.0)
    s.heartbeat("a", now=4.0)
    s.heartbeat("b", now=4.0)
    s.tick(now=6.0)  # c silent for 6 s: lost
    s.leave("b", now=6.0)
    assert s.live() == ("a",)
    s.save(tmp_path / "ckpt", step=1)
    fresh = Syncer(init(), learners=["a", "b", "c"], heartbeat_timeout_s=5.0, max_tokens=100.0)
    fresh.restore(tmp_path / "ckpt")
    assert fresh.live() == ("a",)
    over = fresh.submit(message(fresh, "a", 0, 0, 50.0, seed=1))  # above a's declared 40
    assert [r.accepted for r in over] == [False] and fresh.versions() == [0]
    assert [r.learner for r in fresh.submit(message(fresh, "a", 0, 0, 40.0, seed=2))] == ["a"]  # a alone: merged
    fresh.heartbeat("c")  # back
    assert fresh.live() == ("a", "c")
