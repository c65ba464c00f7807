"""Compressed replies: the syncer sends each merge's outer update through a reply compressor and applies to its
own global values exactly the decoded message, so every learner's anchor stays bit-identical to the syncer's."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax as cj
from compjax.decoupled import Contribution, Header, InProcessTransport, Learner, Reply, Syncer
from tests.test_decoupled_equivalence import train_step_for
from tests.test_diloco import init_params, targets

N, LR = 3, 0.1
CODECS = {"bfloat16": lambda: cj.cast(jnp.bfloat16), "e3m0": lambda: cj.e3m0()}


def run(steps, H, P, reply, *, wait, quorum=N, max_staleness=0, sleeps=(0.0, 0.0, 0.0)):
    """Learners in threads over the in-process transport; the syncer and the learners after the run."""
    params0 = init_params()
    names = [f"learner{i}" for i in range(N)]
    transport = Recording(names)
    syncer = Syncer(params0, learners=names, fragments=P, min_quorum=quorum, max_staleness=max_staleness,
                    grace_s=None if wait else 5.0, reply_compressor=reply)
    inner = optax.sgd(LR)
    step = train_step_for(inner)
    learners = [Learner(n, step, params0, inner.init(params0), transport, sync_every=H, fragments=P,
                        wait_for_merge=wait, reply_timeout_s=30.0, reply_compressor=reply) for n in names]
    data = targets(steps, N)
    errors = []

    def work(i):
        try:
            for c in data:
                learners[i].step(jax.tree.map(lambda x: x[i], c), tokens=8)
                threading.Event().wait(sleeps[i])
            learners[i].finish()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    stop = threading.Event()
    server = threading.Thread(target=syncer.serve, args=(transport, stop))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
    server.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    stop.set()
    server.join(timeout=10)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    syncer.transport = transport
    return syncer, learners


class Recording(InProcessTransport):
    """Records the form of every reply: 'update' (compressed), 'values' (whole) or 'none'."""

    def __init__(self, learners):
        super().__init__(learners)
        self.kinds = []

    def reply(self, reply):
        self.kinds.append("update" if reply.update is not None else "values" if reply.values is not None else "none")
        super().reply(reply)


def assert_bit_identical(syncer, learners):
    """Every learner at the syncer's current version of a fragment holds its global values bit for bit."""
    for p in range(syncer.fragments):
        current = [lrn for lrn in learners if lrn.versions()[p] == syncer.versions()[p]]
        assert current, f"fragment {p}: no learner holds the syncer's version {syncer.versions()[p]}"
        for lrn in current:
            for a, b in zip(lrn.anchor(p), syncer.fragment_values(p)):
                assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32)), (lrn.name, p)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["bfloat16", "e3m0"])
def test_lockstep_learners_hold_the_syncer_global_bit_for_bit_and_the_replies_are_compressed(codec):
    P, H, steps = 2, 2, 8
    syncer, learners = run(steps, H, P, CODECS[codec](), wait=True)
    assert syncer.versions() == [steps // H] * P and not syncer.refused
    assert set(syncer.transport.kinds) == {"update"}
    assert_bit_identical(syncer, learners)
    assert all(lrn.versions() == syncer.versions() for lrn in learners)
    # Every reply was an update of the codec's size: bfloat16 2 bytes an entry; e3m0 4 bits and a scale a leaf.
    for p in range(P):
        values = syncer.fragment_values(p)
        entries = sum(x.size for x in values)
        each = 2 * entries if codec == "bfloat16" else sum(4 * -(-x.size // 8) + 4 for x in values)
        assert syncer.reply_bytes[p] == (steps // H) * N * each
    # The updates were applied (the model moved) and differ from the float32 replies' by the codec's rounding.
    exact, _ = run(steps, H, P, None, wait=True)
    for a, b, c in zip(jax.tree.leaves(syncer.global_params()), jax.tree.leaves(exact.global_params()),
                       jax.tree.leaves(init_params())):
        assert not np.array_equal(a, b)
        assert np.max(np.abs(a - b)) < {"bfloat16": 0.01, "e3m0": 0.15}[codec] * np.max(np.abs(b - c))


@pytest.mark.slow
def test_asynchronous_learners_with_stale_contributions_stay_bit_identical():
    """Quorum 2 of 3, one slow learner whose contributions arrive stale (merged with staleness 1, or refused):
    a stale one's reply brings the whole values, a fresh one's the update; every anchor at the syncer's version
    of a fragment is its global values bit for bit."""
    syncer, learners = run(24, 4, 2, cj.cast(jnp.bfloat16), wait=False, quorum=2, max_staleness=1,
                           sleeps=(0.0, 0.0, 0.05))
    assert len(syncer.merges) >= 8
    kinds = syncer.transport.kinds
    assert "update" in kinds and "values" in kinds, kinds  # fresh contributions, and stale ones (merged or refused)
    assert_bit_identical(syncer, learners)


def test_a_learner_drops_an_update_it_cannot_apply_and_keeps_its_anchor(caplog):
    params0 = init_params()
    reply = cj.cast(jnp.bfloat16)
    syncer = Syncer(params0, learners=["a"], reply_compressor=reply)
    transport = InProcessTransport(["a"])
    lrn = Learner("a", train_step_for(optax.sgd(LR)), params0, (), transport, sync_every=2, reply_compressor=reply)
    bare = Learner("a", train_step_for(optax.sgd(LR)), params0, (), transport, sync_every=2)
    size = sum(x.size for x in syncer.fragment_values(0))
    update = (np.full((size,), 0x3F80, np.uint16),)  # bfloat16 1.0 everywhere
    before = lrn.anchor(0)
    with caplog.at_level(logging.WARNING, logger="compjax.decoupled"):
        lrn._use(Reply("a", 0, 2, None, update=update))  # starts from version 1; the anchor is at 0
        bare._use(Reply("a", 0, 1, None, update=update))  # no reply compressor
        lrn._use(Reply("a", 0, 1, None, update=(update[0][:-1],)))  # not the codec's message
    assert caplog.text.count("dropped the merged update") == 3
    assert lrn.versions() == [0] and bare.versions() == [0]
    for a, b in zip(lrn.anchor(0), before):
        np.testing.assert_array_equal(a, b)
    lrn._use(Reply("a", 0, 1, None, update=update))  # from version 0: applied, +1 everywhere
    assert lrn.versions() == [1]
    for a, b in zip(lrn.anchor(0), before):
        np.testing.assert_array_equal(a, b + np.float32(1.0))


@pytest.mark.slow
def test_the_reply_codec_state_is_checkpointed(tmp_path):
    params0 = init_params()
    s = Syncer(params0, learners=["a"], outer=optax.sgd(1.0), reply_compressor=cj.e3m0())
    for k in range(2):
        delta = np.concatenate([np.ravel(v) * 0.013 * (k + 1) for v in s.fragment_values(0)]).astype(np.float32)
        h = Header("a", 0, k, 8.0, k, (delta.shape,), ("<f4",), delta.nbytes, k + 1)
        assert s.submit(Contribution(h, (delta,)))[0].update is not None
    s.save(tmp_path, 1)
    t = Syncer(params0, learners=["a"], outer=optax.sgd(1.0), reply_compressor=cj.e3m0())
    t.restore(tmp_path)
    for a, b in zip(jax.tree.leaves(s.state()), jax.tree.leaves(t.state())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    residual = [x for x in jax.tree.leaves(t.state()["reply"]) if np.asarray(x).dtype == np.float32]
    assert any(np.any(np.asarray(x) != 0) for x in residual)  # e3m0's error feedback on the replies travelled


def test_the_first_merge_of_each_fragment_after_a_restore_replies_with_whole_values(tmp_path):
    """After a restore every fragment's next merge sends its contributors the whole values (their anchors set right
    once), and the merge after that the compressed update again."""
    params0 = init_params()

    def submit(s, k):
        delta = np.concatenate([np.ravel(v) * 0.013 * (k + 1) for v in s.fragment_values(0)]).astype(np.float32)
        h = Header("a", 0, k, 8.0, k, (delta.shape,), ("<f4",), delta.nbytes, k + 1)
        (reply,) = s.submit(Contribution(h, (delta,)))
        return reply

    s = Syncer(params0, learners=["a"], outer=optax.sgd(1.0), reply_compressor=cj.cast(jnp.bfloat16))
    assert submit(s, 0).update is not None
    s.save(tmp_path, 1)
    t = Syncer(params0, learners=["a"], outer=optax.sgd(1.0), reply_compressor=cj.cast(jnp.bfloat16))
    t.restore(tmp_path)
    first = submit(t, 1)
    assert first.update is None and first.values is not None
    for a, b in zip(first.values, t.fragment_values(0)):
        np.testing.assert_array_equal(a, b)
    second = submit(t, 2)
    assert second.update is not None and second.values is None


def test_reply_compressor_must_be_a_compressor():
    with pytest.raises(ValueError, match="reply_compressor"):
        Syncer(init_params(), learners=["a"], reply_compressor="bfloat16")


class Compiles:
    """Counts traces and XLA compilations while active (jax.monitoring's events): programs not compiled before."""

    def __enter__(self):
        self.count = 0

        def listen(event, duration, **kwargs):
            if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
                self.count += 1

        self._listen = listen
        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


@pytest.mark.slow
def test_after_warm_up_rounds_of_any_size_and_compressed_replies_compile_nothing():
    """The syncer's warm_up compiles decoding, the merge (summed one contribution at a time) and the reply codec;
    it changes nothing; afterwards rounds of 1 to 3 contributions, and of 4 after a late join, compile nothing."""
    params0 = init_params()
    names = ["a", "b", "c"]
    s = Syncer(params0, learners=names, fragments=2, outer=optax.sgd(1.0), reply_compressor=cj.cast(jnp.bfloat16))
    before = [np.asarray(x).copy() for x in jax.tree.leaves(s.state())]
    s.warm_up()
    for a, b in zip(before, jax.tree.leaves(s.state())):
        np.testing.assert_array_equal(a, np.asarray(b))
    with Compiles() as c:
        for k, group in enumerate([["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]]):
            if "d" in group:
                s.register("d")  # a late join: more learners, no new program
            for p in range(2):
                s.min_quorum = len(group)
                size = s.payload_spec(p)[0].shape
                for name in group:
                    delta = np.full(size, 0.01 * (k + 1), np.float32)
                    h = Header(name, p, s.versions()[p], 8.0, k, (size,), ("<f4",), delta.nbytes, k + 1)
                    replies = s.submit(Contribution(h, (delta,)))
                assert len(replies) == len(group) and all(r.update is not None for r in replies)
    assert s.versions() == [4, 4] and not s.refused
    assert c.count == 0


@pytest.mark.slow
def test_a_warmed_up_learner_compiles_nothing_when_it_sends_and_mixes_in_replies():
    params0 = init_params()
    reply = cj.cast(jnp.bfloat16)
    transport = InProcessTransport(["a"])
    s = Syncer(params0, learners=["a"], outer=optax.sgd(1.0), reply_compressor=reply)
    inner = optax.sgd(LR)
    lrn = Learner("a", train_step_for(inner), params0, inner.init(params0), transport, sync_every=2,
                  reply_compressor=reply, alpha=0.5)
    data = targets(6, 1)
    batch = lambda c: jax.tree.map(lambda x: x[0], c)
    s.warm_up()
    lrn.warm_up(batch(data[0]))
    stop = threading.Event()
    server = threading.Thread(target=s.serve, args=(transport, stop))
    with Compiles() as c:
        server.start()
        for d in data:
            lrn.step(batch(d), tokens=8)
        lrn.finish()
        stop.set()
        server.join(timeout=10)
    assert s.versions() == [3] and sum(len(d) for d in lrn.stats.delays) == 3
    assert c.count == 0


def test_a_contribution_refused_one_merge_late_gets_the_last_update_and_its_learner_catches_up_bit_for_bit():
    params0 = init_params()
    reply = cj.cast(jnp.bfloat16)
    transport = InProcessTransport(["a", "b"])
    s = Syncer(params0, learners=["a", "b"], outer=optax.sgd(1.0), min_quorum=1, reply_compressor=reply)
    inner = optax.sgd(LR)
    a, b = (Learner(n, train_step_for(inner), params0, inner.init(params0), transport, sync_every=2,
                    reply_compressor=reply) for n in ("a", "b"))
    data = targets(2, 2)
    for k, lrn in enumerate((a, b)):  # a's contribution merges alone (quorum 1); b's, from version 0, is late
        for d in data:
            lrn.step(jax.tree.map(lambda x: x[k], d), tokens=8)  # noqa: B023
        for r in s.handle(transport.receive(timeout=30)):  # waits for the sender thread's contribution
            transport.reply(r)
    a.finish()
    b.finish()
    assert s.versions() == [1] and [x[2] for x in s.refused] == ["stale: staleness 1 > max_staleness 0"]
    assert b.stats.refusals and b.versions() == [1]
    for x, y in zip(b.anchor(0), s.fragment_values(0)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    size = sum(v.size for v in s.fragment_values(0))
    assert s.reply_bytes == [2 * 2 * size]  # a's update and b's refusal: two bfloat16 messages


def test_a_contributor_merged_one_version_late_gets_the_whole_values_and_a_fresh_one_the_update():
    """Quorum 1, max_staleness 1: a's contribution (from version 0) merges alone into version 1; b's, also from
    version 0, merges alone into version 2 with staleness 1.  Its anchor is two merges behind, so the update from
    1 to 2 would not bring it there: its reply carries the whole values, bit-identical to the syncer's."""
    params0 = init_params()
    s = Syncer(params0, learners=["a", "b"], outer=optax.sgd(1.0), min_quorum=1, max_staleness=1,
               reply_compressor=cj.cast(jnp.bfloat16))
    size = s.payload_spec(0)[0].shape
    delta = np.full(size, 0.01, np.float32)
    (fresh,) = s.submit(Contribution(Header("a", 0, 0, 8.0, 1, (size,), ("<f4",), delta.nbytes, 1), (delta,)))
    (late,) = s.submit(Contribution(Header("b", 0, 0, 8.0, 1, (size,), ("<f4",), delta.nbytes, 1), (delta,)))
    assert s.versions() == [2] and fresh.accepted and late.accepted
    assert fresh.update is not None and fresh.values is None
    assert late.update is None and late.values is not None
    for x, y in zip(late.values, s.fragment_values(0)):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
